"""The upgrade gate (`r1sup profile gate`): a profile tuned on a new image is published to the fleet's
store only when it verifies at least the capacity of the store's profile for the previous image; else
exit 8 with both side by side. The decision is pure and table-driven; the command runs as the real CLI
after a real `r1sup tune` on the fake GPU engine."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from r1sup.core import gate
from r1sup.core.errors import EXIT_GATE_FAILED, ConfigError
from r1sup.state import profiles
from r1sup_proc import R1sup, kill_engine_processes, write_config
from test_tune_fake import fake_body, fake_env, fake_scenario

C = gate.Capacity


@pytest.mark.parametrize(
    ("old", "new", "ok", "lower"),
    [
        (C(8, 32768, 400.0), C(8, 32768, 400.0), True, []),
        (C(8, 32768, 400.0), C(16, 32768, 380.0), True, []),  # more at once, throughput within 10 %
        (C(8, 32768, 400.0), C(6, 32768, 500.0), False, ["requests at once"]),
        (C(8, 32768, 400.0), C(8, 16384, 400.0), False, ["context tokens"]),
        (C(8, 32768, 400.0), C(8, 32768, 300.0), False, ["output tokens/s"]),
        (C(8, 32768, 400.0), C(None, 32768, 400.0), False, ["requests at once"]),  # not verified now
        (C(None, 32768, None), C(4, 32768, 10.0), True, []),  # the old profile lacked the figures
        (None, C(4, 8192, 10.0), True, []),  # a first rollout
    ],
)
def test_the_new_capacity_must_be_at_least_the_old(
    old: gate.Capacity | None, new: gate.Capacity, ok: bool, lower: list[str]
):
    verdict = gate.decide(old, new)
    assert verdict.ok is ok
    assert [r.name for r in verdict.rows if not r.ok] == lower
    table = verdict.table("vLLM 0.31.0", "vLLM 0.33.0")
    assert "vLLM 0.31.0" in table.splitlines()[0] and "vLLM 0.33.0" in table.splitlines()[0]
    assert ("LOWER" in table) is (not ok)


def test_capacity_is_read_from_the_record_else_from_the_probe_and_the_flags():
    probed = {
        "probe": {"ok": True, "concurrency": 4, "output_tokens_per_s": 120.5},
        "flags": {"max_model_len": 8192},
    }
    assert gate.profile_capacity(probed) == C(4, 8192, 120.5)
    failed = {"probe": {"ok": False, "concurrency": 4}, "flags": {"max_model_len": 8192}}
    assert gate.profile_capacity(failed) == C(None, 8192, None)
    recorded = {
        **probed,
        "capacity": {"requests": 12, "context_tokens": 16384, "output_tokens_per_second": 300.0},
    }
    assert gate.profile_capacity(recorded) == C(12, 16384, 300.0)


def test_fingerprints_are_compared_without_what_the_image_changes():
    a = {"gpu": {"names": ["L4"]}, "versions": {"vllm": "0.31.0"}, "r1sup_major": 0, "target": {}}
    assert gate.same_but_image(a, {**a, "versions": {"vllm": "0.33.0"}, "r1sup_major": 1})
    assert not gate.same_but_image(a, {**a, "gpu": {"names": ["A10"]}})


# --- the command after a real tune ---------------------------------------------------------------------


def previous_image(profile: dict[str, Any], more_requests: int = 0) -> dict[str, Any]:
    """The same box's profile as the previous image (vLLM 0.31.0) would have left it in the store, having
    verified ``more_requests`` more requests at once (in its probe and in its capacity record)."""
    old = copy.deepcopy(profile)
    old["fingerprint"]["versions"]["vllm"] = "0.31.0"
    old["key"] = profiles.fingerprint_key(old["fingerprint"])
    old["probe"]["concurrency"] += more_requests
    if isinstance(old.get("capacity"), dict) and isinstance(old["capacity"].get("requests"), int):
        old["capacity"]["requests"] += more_requests
    old["created_at"] = old["updated_at"] = "2026-01-01T00:00:00+00:00"
    return old


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gate_publishes_a_profile_that_holds_and_refuses_one_that_verifies_less(tmp_path: Path):
    scenario = fake_scenario(tmp_path)
    env = fake_env(scenario)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "supervisor"), env["PYTHONPATH"]])  # this checkout's
    body = fake_body(tmp_path, search={"allow_weight_quantization": True})
    config = write_config(tmp_path / "r1sup.toml", body)
    tune = R1sup("tune", "--config", str(config), env=env)
    try:
        assert tune.wait(150) == 0, tune.tail()
    finally:
        tune.kill()
        kill_engine_processes(config)
    (saved,) = (tmp_path / "state" / "profiles").glob("*.json")
    new = json.loads(saved.read_text(encoding="utf-8"))
    assert new["probe"]["ok"] and new["fingerprint"]["versions"]["vllm"] == "0.32.0"

    def gate_against(old: dict[str, Any]) -> tuple[int, R1sup, Path]:
        fleet = tmp_path / f"fleet-{old['probe']['concurrency']}"
        (fleet / "profiles").mkdir(parents=True)
        (fleet / "profiles" / f"{old['key']}.json").write_text(json.dumps(old), encoding="utf-8")
        proc = R1sup("profile", "gate", "--config", str(config), "--store", str(fleet), env=env)
        try:
            code = proc.wait(120)
        finally:
            proc.kill()
        return code, proc, fleet

    # the previous image verified more requests at once: refused, both side by side, nothing published
    better = previous_image(new, more_requests=4)
    code, proc, fleet = gate_against(better)
    assert code == EXIT_GATE_FAILED, proc.tail()
    report = proc.stdout_text()
    assert "vLLM 0.31.0" in report and "vLLM 0.32.0" in report and "LOWER" in report
    assert gate.profile_capacity(better).requests == gate.profile_capacity(new).requests + 4
    assert str(gate.profile_capacity(better).requests) in report
    assert "requests at once" in "".join(proc.stderr)
    assert not (fleet / "profiles" / f"{new['key']}.json").exists()

    # the same capacity as before: published for the replicas of the new image
    same = previous_image(new)
    code, proc, fleet = gate_against(same)
    assert code == 0, proc.tail()
    assert "published profile" in proc.stdout_text()
    published = json.loads((fleet / "profiles" / f"{new['key']}.json").read_text(encoding="utf-8"))
    assert published["flags"] == new["flags"] and published["key"] == new["key"]


# --- the gate fails closed (issue 34) --------------------------------------------------------------------


def _box(vllm: str) -> dict[str, Any]:
    from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo

    gpu = GpuInfo(0, "NVIDIA L4", 24 * GIB, 23 * GIB, (8, 9))
    return profiles.fingerprint(
        model="org/model",
        model_config_hash="0123456789abcdef",
        device=DeviceFacts(backend="cuda", gpus=(gpu,), driver="550.54.14", host_total_bytes=64 * GIB),
        versions={"vllm": vllm, "torch": "2.9.0"},
        target={"concurrency": None, "context": None},
        tensor_parallel_size=1,
        r1sup_version="0.1.0",
    )


def _tuned(vllm: str, requests: int, updated_at: str = "2026-01-01T00:00:00+00:00") -> profiles.Profile:
    import dataclasses

    made = profiles.Profile.create(
        fingerprint=_box(vllm),
        model="org/model",
        served_name="m",
        flags={"max_model_len": 8192},
        command=["python", "-m", "vllm.entrypoints.openai.api_server"],
        probe={"ok": True, "concurrency": requests, "output_tokens_per_s": 400.0, "prompt_tokens": 900},
    )
    return dataclasses.replace(made, created_at=updated_at, updated_at=updated_at)


def _gate_with(tmp_path: Path, entries: dict[str, str]) -> tuple[int | None, Path, Exception | None]:
    """``r1sup profile gate`` of this box's profile (vLLM 0.33.0, 8 requests at once) against a store holding
    ``entries`` (file name -> content): its exit code (None: raised), the store, the error raised."""
    from r1sup.cli.commands import profile as command

    new = _tuned("0.33.0", 8)
    local = profiles.ProfileStore(tmp_path / "state")
    assert local.save(new) is not None
    fleet = tmp_path / "fleet"
    (fleet / "profiles").mkdir(parents=True)
    for name, content in entries.items():
        (fleet / "profiles" / name).write_text(content, encoding="utf-8")
    try:
        return command._gate(local, new.fingerprint, str(fleet)), fleet, None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return None, fleet, exc


def _entry(profile: profiles.Profile) -> tuple[str, str]:
    return f"{profile.key}.json", json.dumps(profile.to_dict())


def _published(fleet: Path) -> bool:
    return (fleet / "profiles" / f"{_tuned('0.33.0', 8).key}.json").exists()


def test_a_damaged_previous_image_entry_stops_the_gate_instead_of_reading_as_a_first_rollout(tmp_path: Path):
    old = _tuned("0.31.0", 16)  # verified twice the requests at once: the new image must be refused
    name, good = _entry(old)
    for damaged in (good[: len(good) // 2], good.replace('"max_model_len": 8192', '"max_model_len": 1')):
        code, fleet, error = _gate_with(tmp_path / str(len(damaged)), {name: damaged})
        assert code is None and isinstance(error, ConfigError), (code, error)
        assert error.field == "--store" and name in error.message and "\n" not in error.message
        assert not _published(fleet)
    # the same entry whole: the gate compares and refuses
    code, fleet, error = _gate_with(tmp_path / "whole", {name: good})
    assert code == EXIT_GATE_FAILED and not _published(fleet)


def test_an_entry_dated_in_the_future_is_not_taken_as_the_baseline(tmp_path: Path):
    real = _tuned("0.31.0", 16)
    forged = _tuned("0.30.0", 1, updated_at="9999-12-31T00:00:00+00:00")
    code, fleet, error = _gate_with(tmp_path, dict([_entry(real), _entry(forged)]))
    assert code is None and isinstance(error, ConfigError), (code, error)
    assert "9999-12-31" in error.message and "future" in error.message
    assert not _published(fleet)


def test_the_newest_baseline_is_chosen_by_time_not_by_the_text_of_its_stamp(tmp_path: Path):
    # the text "2026-03-01T01:00:00+05:00" sorts after "2026-02-28T21:00:00Z", the time is an hour before
    older = _tuned("0.31.0", 4, updated_at="2026-03-01T01:00:00+05:00")  # 2026-02-28T20:00Z
    newer = _tuned("0.30.0", 16, updated_at="2026-02-28T21:00:00Z")
    code, fleet, _ = _gate_with(tmp_path, dict([_entry(newer), _entry(older)]))
    assert code == EXIT_GATE_FAILED and not _published(fleet)


def test_a_file_in_the_store_that_is_not_a_profile_is_passed_over(tmp_path: Path, capsys: Any):
    code, fleet, error = _gate_with(tmp_path, dict([_entry(_tuned("0.31.0", 8)), ("notes.json", "{}")]))
    assert code == 0 and error is None and _published(fleet)
    assert "vLLM 0.31.0" in capsys.readouterr().out
