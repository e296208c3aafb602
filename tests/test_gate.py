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
from r1sup.core.errors import EXIT_GATE_FAILED
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
    assert gate.capacity_of(probed) == C(4, 8192, 120.5)
    failed = {"probe": {"ok": False, "concurrency": 4}, "flags": {"max_model_len": 8192}}
    assert gate.capacity_of(failed) == C(None, 8192, None)
    recorded = {
        **probed,
        "capacity": {"requests": 12, "context_tokens": 16384, "output_tokens_per_second": 300.0},
    }
    assert gate.capacity_of(recorded) == C(12, 16384, 300.0)


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
    body = fake_body(tmp_path, ladder={"allow_weight_quantization": True})
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
    assert gate.capacity_of(better).requests == gate.capacity_of(new).requests + 4
    assert str(gate.capacity_of(better).requests) in report
    assert "requests at once" in "".join(proc.stderr)
    assert not (fleet / "profiles" / f"{new['key']}.json").exists()

    # the same capacity as before: published for the replicas of the new image
    same = previous_image(new)
    code, proc, fleet = gate_against(same)
    assert code == 0, proc.tail()
    assert "published profile" in proc.stdout_text()
    published = json.loads((fleet / "profiles" / f"{new['key']}.json").read_text(encoding="utf-8"))
    assert published["flags"] == new["flags"] and published["key"] == new["key"]
