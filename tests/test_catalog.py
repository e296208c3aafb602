"""The GPU and model catalogs: the cards added for issue 16, ROCm marking, and "did you mean"."""

from __future__ import annotations

import pytest

from r1sup.adapters import devices, modelinfo
from r1sup.cli.app import main
from r1sup.core import catalog
from r1sup.core.errors import ConfigError

GIB = 1024**3


@pytest.mark.parametrize(
    ("nvml_name", "canonical", "total_gib", "cc"),
    [
        # names as NVML / rocm-smi print them
        ("NVIDIA GeForce RTX 5090", "RTX 5090", 31.37, (12, 0)),
        ("NVIDIA RTX A6000", "RTX A6000", 47.53, (8, 6)),
        ("NVIDIA L40", "L40", 44.40, (8, 9)),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 44.43, (8, 9)),
        ("NVIDIA B200", "B200", 178.35, (10, 0)),
        ("NVIDIA GH200 480GB", "GH200 96GB", 94.50, (9, 0)),
        ("AMD Instinct MI300X", "MI300X", 191.98, (9, 4)),
        ("AMD Instinct MI325X", "MI325X", 255.98, (9, 4)),
    ],
)
def test_new_cards_are_found_by_their_device_names(
    nvml_name: str, canonical: str, total_gib: float, cc: tuple[int, int]
) -> None:
    found = catalog.find_gpu(nvml_name)
    assert found is not None and found[0] == canonical
    assert found[1].total_gib == total_gib and found[1].compute_capability == cc
    assert catalog.find_gpu(canonical) == found


def test_l40_and_l40s_stay_apart() -> None:
    assert catalog.find_gpu("L40")[0] == "L40"  # type: ignore[index]
    assert catalog.find_gpu("L40S")[0] == "L40S"  # type: ignore[index]


def test_amd_cards_are_marked_rocm_and_say_so_in_the_plan_device() -> None:
    rocm = sorted(name for name, info in catalog.GPUS.items() if info.platform == "rocm")
    assert rocm == ["MI300X", "MI325X"]
    assert catalog.find_gpu("AMD Instinct MI300X")[1].platform == "rocm"  # type: ignore[index]
    assert catalog.find_gpu("H100")[1].platform == "cuda"  # type: ignore[index]
    facts = devices.from_catalog("MI300X", count=8)
    assert facts.count == 8 and facts.total_bytes == int(191.98 * GIB)
    assert any("ROCm" in note for note in facts.notes)
    assert not devices.from_catalog("H100").notes


def test_every_catalog_total_is_below_its_marketing_size() -> None:
    """PyTorch's total is a little under the size printed on the box (GB or GiB): a typo would show."""
    marketed_gb = {
        "RTX 3090": 24, "RTX 4090": 24, "RTX 5090": 32, "L4": 24, "A10": 24, "RTX A6000": 48, "L40": 48,
        "L40S": 48, "RTX 6000 Ada": 48, "A100 40GB": 40, "A100 80GB": 80, "H100 80GB": 80,
        "GH200 96GB": 96, "H200 141GB": 141, "B200": 180, "MI300X": 192, "MI325X": 256,
    }  # fmt: skip
    assert set(marketed_gb) == set(catalog.GPUS)
    for name, gb in marketed_gb.items():
        total = catalog.GPUS[name].total_gib
        assert 0.85 * gb * 1e9 / GIB < total < gb, name


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("RTX 4900", ["RTX 4090"]),
        ("H1000", ["H100 80GB"]),
        ("a100", ["A100 40GB", "A100 80GB"]),
        ("mi300", ["MI300X"]),
        ("xyz", []),
        ("", []),
    ],
)
def test_gpu_suggestions(typed: str, expected: list[str]) -> None:
    assert catalog.suggest_gpu(typed) == expected


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("DeepSeek-R1-Distill-Qwen-14b-instruct", ["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"]),
        ("deepseek/DeepSeek-R1-Distil-Qwen-14B", ["deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"]),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32", ["deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"]),
        ("deepseek-ai/DeepSeek-R1-Distil-Llama-8B", ["deepseek-ai/DeepSeek-R1-Distill-Llama-8B"]),
        ("Qwen/Qwen2.5-7B-Instruct", []),
        ("meta-llama/Llama-3.1-8B", []),
    ],
)
def test_model_suggestions(typed: str, expected: list[str]) -> None:
    assert catalog.suggest_model(typed) == expected


def test_unknown_model_error_names_the_close_catalog_entry(tmp_path) -> None:
    env = {"HOME": str(tmp_path)}  # an empty Hugging Face cache
    with pytest.raises(ConfigError) as err:
        modelinfo.locate_model_config("deepseek-ai/DeepSeek-R1-Distil-Qwen-14B", environ=env)
    assert "did you mean deepseek-ai/DeepSeek-R1-Distill-Qwen-14B?" in err.value.message
    with pytest.raises(ConfigError) as err:
        modelinfo.locate_model_config("Qwen/Qwen2.5-7B-Instruct", environ=env)
    assert "did you mean" not in err.value.message


def test_plan_with_a_mistyped_model_or_gpu_exits_2_with_a_suggestion(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    code = main(["plan", "--model", "DeepSeek-R1-Distill-Qwen-14b-instruct", "--gpu", "RTX 4090"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        err.startswith("r1sup: error: --model: ")
        and "did you mean deepseek-ai/DeepSeek-R1-Distill-Qwen-14B?" in err
    )
    assert err.count("\n") == 1
    code = main(["plan", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "--gpu", "RTX 4900"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown GPU 'RTX 4900'; did you mean RTX 4090?" in err


# --- names that only look like a catalog card are refused, with the way to plan for any card -------------


@pytest.mark.parametrize(
    ("typed", "close"),
    [
        ("H100 NVL", "H100 80GB"),  # 94 GB: another card, not the 80 GB one
        ("NVIDIA H100 NVL", "H100 80GB"),
        ("H200 NVL", "H200 141GB"),
        ("RTX 4090 D", "RTX 4090"),
        ("RTX 4900", "RTX 4090"),
    ],
)
def test_a_name_that_matches_only_loosely_is_refused_naming_the_close_cards(
    typed: str, close: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert catalog.find_gpu(typed) is None
    code = main(["plan", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "--gpu", typed])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"r1sup: error: --gpu: unknown GPU {typed!r}; did you mean {close}? ")
    assert "--gpu-memory-gib GIB" in err


def test_form_factor_words_still_name_the_same_card() -> None:
    for name in ("H100 PCIe", "NVIDIA H100 80GB HBM3", "H100 SXM5 80GB", "A100-SXM4-40GB"):
        found = catalog.find_gpu(name)
        assert found is not None and found[0] in ("H100 80GB", "A100 40GB"), name


def test_an_unknown_card_lists_the_catalog_and_points_at_gpu_memory_gib(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "--gpu", "GTX 9999"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert (
        "known: RTX 3090, " in err
        and "For a card not in the catalog give its memory: --gpu-memory-gib" in err
    )
    # and that way works: the name is a label, the memory the one given
    code = main(
        [
            "plan",
            "--model",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            "--gpu",
            "H100 NVL",
            "--gpu-memory-gib",
            "93",
        ]
    )
    out = capsys.readouterr().out
    assert code in (0, 7, 3)
    assert "device  H100 NVL (manual): 93.00 GiB each" in out and "compute capability unknown" in out


def test_the_catalog_figure_is_shown_beside_an_nvml_total_that_differs() -> None:
    from r1sup.cli import report

    h100 = catalog.GPUS["H100 80GB"].total_gib
    assert catalog.catalog_total_beside("NVIDIA H100 80GB HBM3", h100) == ""
    assert catalog.catalog_total_beside("NVIDIA H100 NVL", 93.1) == ""  # not a catalog card
    box = report.box_text({"gpus": [{"name": "NVIDIA H100 80GB HBM3", "total_gib": 79.65, "free_gib": 79.0}]})
    assert f"79.65 GiB each; the catalog's H100 80GB (plan --gpu): {h100:.2f} GiB" in box


def test_plan_on_a_probed_card_shows_the_catalog_figure_beside_nvml_and_the_catalog_says_cuda() -> None:
    from r1sup.cli.commands import plan as plan_cmd
    from r1sup.core import planner
    from r1sup.core.flags import EngineFlags
    from r1sup.core.hardware import DeviceFacts, GpuInfo

    arch, source = modelinfo.load_arch("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
    nvml = int(79.65 * GIB)  # NVML's total of an H100 80GB without the reserved part subtracted
    probed = DeviceFacts(
        "cuda", (GpuInfo(0, "NVIDIA H100 80GB HBM3", nvml, nvml - GIB, (9, 0)),), source="probe"
    )
    flags = EngineFlags(max_model_len=8192)
    text = plan_cmd.render(planner.plan(arch, probed, flags, version="0.32.0"), source, probed)
    line = next(x for x in text.splitlines() if x.startswith("device  "))
    assert "79.65 GiB each; the catalog's H100 80GB (plan --gpu): 79.11 GiB, 78.65 GiB free" in line
    listed = devices.from_catalog("H100 80GB")
    text = plan_cmd.render(planner.plan(arch, listed, flags, version="0.32.0"), source, listed)
    line = next(x for x in text.splitlines() if x.startswith("device  "))
    assert "H100 80GB (catalog): 79.11 GiB each (CUDA's total; tune and report show NVML's figure" in line
