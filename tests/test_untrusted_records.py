"""status.json and run records are untrusted input (issue 34): fuzzed with hypothesis, r1sup either
uses what it reads or sets the file aside with one line; it never raises, never hangs.

The run record is a real one (``tests/fixtures/runrecord``: a ``tune`` on the fake GPU engine, its paths
replaced), with one value anywhere in it replaced by a value of any JSON type."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r1sup.cli import report
from r1sup.cli.commands import status
from r1sup.state import runrecord

FIXTURE = Path(__file__).parent / "fixtures" / "runrecord" / "20261205T090658Z-tune-28171.json"
RECORD: dict[str, Any] = json.loads(FIXTURE.read_text())


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*path, i))
    return out


PATHS = _paths(RECORD)[1:]
# any JSON value r1sup could read: NaN and Infinity written as such or as 1e400, huge integers,
# lone surrogates and control characters in strings, nested containers
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(codec=None), max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _write(path: Path, obj: Any) -> None:
    """``obj`` as JSON the way a hand or another program may write it (NaN, lone surrogates included)."""
    path.write_text(json.dumps(obj), encoding="utf-8")


def _mutated(where: tuple[Any, ...], value: Any) -> dict[str, Any]:
    record = copy.deepcopy(RECORD)
    node: Any = record
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    return record


def test_the_fixture_is_reported_as_it_is(tmp_path: Path) -> None:
    """The unchanged record passes the checks and is reported (the fuzz below has something to break)."""
    (tmp_path / "r.json").write_text(FIXTURE.read_text())
    record, problem = runrecord.load(tmp_path / "r.json")
    assert problem is None and record == RECORD
    text = report.render_text(record)
    assert "found a working configuration" in text and "attempt 2  ok" in text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PATHS), value=values)
def test_a_run_record_is_reported_or_set_aside(tmp_path: Path, where: tuple[Any, ...], value: Any) -> None:
    path = tmp_path / "20261205T090658Z-tune-1.json"
    _write(path, _mutated(where, value))
    record, problem = runrecord.load(path)
    if record is None:
        assert problem and "\n" not in problem
        return
    report.render_text(record)
    report.render_html(record, None, source=str(path))
    json.dumps(record)


@pytest.mark.parametrize(
    ("where", "value", "said"),
    [
        (("result", "flags", "kv_cache_dtype"), 8, "result.flags.kv_cache_dtype: a int, not str"),
        (("attempts", 0), "x", "attempts[0]: a str, not an object"),
        (("attempts", 1, "flags"), [], "attempts[1].flags: a list, not dict"),
        (("device", "gpus", 0, "total_gib"), "80", "device.gpus[0].total_gib: a str, not int or float"),
        (
            ("result", "flags", "gpu_memory_utilization"),
            10**30,
            "result.flags.gpu_memory_utilization: 1e+30 is out of range",
        ),
        (("result",), ["ok"], "result: a list, not dict"),
    ],
)
def test_report_names_the_wrong_field_in_one_line(
    tmp_path: Path, where: tuple[Any, ...], value: Any, said: str
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    _write(runs / FIXTURE.name, _mutated(where, value))
    done = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "report", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "unusable run record" in done.stderr and said in done.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "report", "--state-dir", str(tmp_path), "--list"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert listing.returncode == 0 and f"  unusable: {said}" in listing.stdout


STATUS: dict[str, Any] = {
    "schema_version": 1,
    "updated_at": "2026-01-01T00:00:00Z",
    "state": "serving",
    "pid": 999_999_99,
    "child_pid": None,
    "launches": 2,
    "max_model_len": 4096,
    "since": "2026-01-01T00:00:00Z",
    "flags": {"max_model_len": 4096, "gpu_memory_utilization": 0.9},
    "capacity": {"requests": 4, "context_tokens": 4096, "output_tokens_per_second": 12.5},
    "progress": {"phase": "weights", "percent": 40},
    "last_failure": {"class": "oom_weights"},
    "recent_events": [{"ts": "2026-01-01T00:00:00Z", "event": "launch_started", "attempt": 1}],
    "served_model": "qwen",
    "port": 8000,
    "kv_cache_tokens": 10_000,
    "memory_gib": 3.5,
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(STATUS)), value=values)
def test_a_status_file_is_shown_or_set_aside(tmp_path: Path, key: str, value: Any) -> None:
    _write(tmp_path / "status.json", {**STATUS, key: value})
    found = status.collect(tmp_path)
    for as_json in (False, True):
        text = json.dumps(found, default=str) if as_json else status.printable(status.render(found, True))
        text.encode("utf-8")  # what stdout writes: no lone surrogate
        if not as_json:  # no control character reaches the terminal
            assert not any(ch != "\n" and unicodedata.category(ch) in ("Cc", "Cs") for ch in text)
    daemon = found["daemon"]
    if "problem" in daemon:
        assert "\n" not in daemon["problem"]
    assert os.listdir(tmp_path) == ["status.json"]  # read-only
