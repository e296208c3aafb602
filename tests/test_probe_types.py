"""The probe's result and the verified capacity as typed values: what r1sup wrote when they were dicts
(``fixtures/probe/written-as-dicts.json``: probe records, the capacities, their lines and the report's
probe line, as the dict-reading code produced them) reads back and writes out the same, and no
string-keyed read of either comes back into the package."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from keyed_reads import mapping_reads
from r1sup.adapters.probe import parse_metrics, progress_while_waiting
from r1sup.cli.report import probe_text
from r1sup.core import capacity
from r1sup.core import failure as F
from r1sup.core.capacity import Asked, Capacity
from r1sup.core.figures import Figures
from r1sup.core.probing import ProbeResult, Wave, probe_failure

WRITTEN = json.loads((Path(__file__).parent / "fixtures" / "probe" / "written-as-dicts.json").read_text())
PROBES = WRITTEN["probes"]
OLD = WRITTEN["old_records"]


def _capacity(record: dict[str, Any], case: dict[str, Any]) -> Capacity | None:
    flags, figures = case["flags"] or {}, case["figures"]
    return capacity.verified(
        ProbeResult.from_dict(record),
        flags.get("max_model_len"),
        Figures.from_dict(figures) if figures is not None else None,
        Asked.from_dict(case["asked"]),
        reduced=bool(case["reduced"]),
    )


@pytest.mark.parametrize("name", sorted(PROBES))
def test_a_probe_record_round_trips_to_the_same_bytes(name: str) -> None:
    record = PROBES[name]["record"]
    again = ProbeResult.from_dict(json.loads(json.dumps(record)))
    assert json.dumps(again.to_dict()) == json.dumps(record)
    assert again.summary() == PROBES[name]["summary"]
    assert probe_text(again) == PROBES[name]["report"]


@pytest.mark.parametrize("name", sorted(PROBES) + sorted(OLD))
def test_the_capacity_is_the_record_written_before(name: str) -> None:
    written = {**PROBES, **OLD}[name]
    assert written["capacities"], "the fixture holds capacities to compare"
    for case in written["capacities"]:
        verified = _capacity(written["record"], case)
        if case["capacity"] is None:
            assert verified is None
            continue
        assert verified is not None
        assert json.dumps(verified.to_dict()) == json.dumps(case["capacity"])
        assert verified.text() == case["text"]
        assert Capacity.from_dict(json.loads(json.dumps(case["capacity"]))) == verified


def test_a_passed_probe_proves_a_capacity_in_the_fixtures() -> None:
    # the comparisons above would pass on fixtures where no probe passed
    assert sum(c["capacity"] is not None for p in PROBES.values() for c in p["capacities"]) >= 8
    assert any(c["capacity"]["reduced"] for p in PROBES.values() for c in p["capacities"] if c["capacity"])


def test_a_record_from_before_the_concurrency_figures_reads_as_none() -> None:
    record = OLD["before_concurrency"]["record"]
    probe = ProbeResult.from_dict(record)
    assert (
        probe.ok and probe.concurrency_proven is None and probe.wave is None and probe.tokenize_calls is None
    )
    assert probe_text(probe) == OLD["before_concurrency"]["report"]


def test_values_of_the_wrong_type_are_none_never_a_crash() -> None:
    odd = OLD["odd_values"]["record"]
    probe = ProbeResult.from_dict(odd)
    assert (probe.ok, probe.requests, probe.succeeded, probe.errors) == (True, None, None, ())
    assert (probe.wave, probe.internal, probe.sizing, probe.queued) == (None, None, None, False)
    assert probe_text(probe)  # the dict-reading report crashed on this record
    assert ProbeResult.from_dict(None) == ProbeResult() == ProbeResult.from_dict([1])  # type: ignore[arg-type]
    assert Capacity.from_dict({"requests": "4", "reduced": "no", "reduced_because": [1, "less"]}) == Capacity(
        reduced_because=("less",)
    )
    assert Capacity.from_dict(None) is None and Asked.from_dict({"requests": True}) == Asked()


def test_a_probe_that_gave_no_result_has_no_figures() -> None:
    # what the probe_failed event logs of it: no count of zero for requests never counted
    result = ProbeResult.unanswered("the probe did not return", timed_out=True)
    assert not result.ok and result.timed_out and result.first_error == "the probe did not return"
    assert (result.requests, result.succeeded, result.duration_s, result.streams_peak) == (None,) * 4
    # the record the dict it stands for read as (the runner's fallback was ``{"ok": false, ...}``)
    assert result == ProbeResult.from_dict({"ok": False, "errors": [result.first_error], "timed_out": True})


def test_a_skipped_wave_writes_only_what_it_knew() -> None:
    wave = Wave(requests=1, output_tokens=32, limit=1, skipped="one at once")
    assert wave.to_dict() == {"requests": 1, "output_tokens": 32, "limit": 1, "skipped": "one at once"}
    assert Wave.from_dict(wave.to_dict()) == wave
    assert list(Wave(requests=2, output_tokens=32, skipped="late").to_dict()) == [
        "requests",
        "output_tokens",
        "skipped",
    ]


def test_requests_sent_again_after_a_5xx_are_counted_beside_those_after_a_lost_connection() -> None:
    result = ProbeResult(ok=True, requests=4, succeeded=4, concurrency=1, retried=1, server_retried=2)
    record = result.to_dict()
    assert (record["retried"], record["server_retried"], record["server_errors"]) == (1, 2, 0)
    assert ProbeResult.from_dict(json.loads(json.dumps(record))) == result
    assert result.summary().endswith(
        "; 1 request retried after its connection failed; 2 requests retried after a 5xx answer"
    )
    failed = ProbeResult(ok=False, requests=4, error_count=1, errors=("request 0: 503",), server_retried=1)
    assert failed.summary() == "1/4 requests failed: request 0: 503; 1 request retried after a 5xx answer"


@pytest.mark.parametrize("wave_carried", [True, False])
def test_a_short_probe_with_short_prompts_reports_the_capacity_its_full_probe_measured(
    wave_carried: bool,
) -> None:
    # issue 36, one capacity figure: a run from a saved profile sends short prompts once vLLM allocated
    # the KV cache its full probe passed with. Its context requests (64 tokens) then say nothing of the
    # context; the capacity is what the profile's full probe measured, and the line says whose it is.
    full = ProbeResult.from_dict(PROBES["wave_proved_more"]["record"])
    assert full.wave is not None and full.prompt_tokens == 7990
    fresh_wave = replace(full.wave, concurrency_proven=9, ttft_p50_s=0.5)
    short = replace(
        full,
        requests=1,
        succeeded=1,
        prompt_tokens=64,
        concurrency_proven=1,
        sizing=None,
        wave=full.wave if wave_carried else fresh_wave,
    )
    figures, asked = Figures(max_model_len=8192, kv_cache_tokens=101456), Asked(requests=1, context=8192)
    before = capacity.verified(full, 8192, figures, asked)
    alone = capacity.verified(short, 8192, figures, asked)
    after = capacity.verified(short, 8192, figures, asked, stands_on=full)
    assert before is not None and alone is not None and after is not None
    assert alone.probe_tokens == 64 + full.output_tokens  # what the short prompts alone claim(ed)
    assert (after.context_requests, after.probe_tokens) == (before.context_requests, before.probe_tokens)
    assert after.context_from_profile and after.wave_from_profile is wave_carried
    if wave_carried:  # every figure the full probe's: one answer, the line naming where it comes from
        assert replace(after, context_from_profile=False, wave_from_profile=False) == before
        assert after.text() == before.text().replace("measured:", "measured (the profile's full probe):")
    else:  # a wave sent by this launch is this launch's
        assert after.requests == 9 and after.ttft_p50_s == 0.5
        assert after.text().startswith("measured: 9 request(s) at once of ~251 prompt tokens (812.2 ")
        assert "0.25s), 1 at once of ~8,054 tokens (the profile's full probe); computed" in after.text()
    # the marks are kept where the capacity is stored (status.json, a profile) and read back
    record = json.loads(json.dumps(after.to_dict()))
    assert record["context_from_profile"] is True and capacity.check(record) == record
    assert Capacity.from_dict(record) == after
    # a record without them (every one written before) keeps its keys
    assert "context_from_profile" not in before.to_dict() and "wave_from_profile" not in before.to_dict()
    with pytest.raises(ValueError, match="capacity.wave_from_profile must be true or false"):
        capacity.check({**record, "wave_from_profile": "yes"})
    # a full probe that did not pass stands for nothing
    failed = replace(full, ok=False)
    assert capacity.verified(short, 8192, figures, asked, stands_on=failed) == alone


def test_a_limit_that_did_not_run_is_said_to_be_vllms_figure_not_what_ran() -> None:
    # issue 36, one capacity line: the demo's wave sent 13 (what vLLM's KV figure allowed) and 12 ran
    # with none seen waiting; "measured: 12 ... (REDUCED: 13 request(s) at once ...)" gave two figures
    # for one question. The reduction names the 13 as vLLM's figure.
    full = ProbeResult.from_dict(PROBES["wave_proved_more"]["record"])
    assert full.wave is not None
    wave = replace(
        full.wave, requests=13, sent=13, succeeded=13, concurrency_proven=12, waiting_peak=0, limit=13
    )
    probe = replace(full, wave=wave)
    asked = Asked(requests=1, context=8192, concurrent=16)
    got = capacity.verified(probe, 8192, Figures(max_model_len=8192, kv_cache_tokens=3840), asked)
    assert got is not None and got.requests == 12 and got.concurrent_limit == 13
    assert got.reduced_because == (
        "vLLM's figures allow 13 request(s) at once of ~251 prompt tokens of 16 asked",
    )
    assert got.text().startswith("measured: 12 request(s) at once of ~251 prompt tokens")
    # requests that waited: the limit is what ran, the one figure
    ran = replace(wave, waiting_peak=1, limit=12)
    got = capacity.verified(replace(full, wave=ran), 8192, None, asked)
    assert got is not None and got.reduced_because == (
        "12 request(s) at once of ~251 prompt tokens of 16 asked",
    )


def test_the_asked_record_keeps_its_keys() -> None:
    asked = Asked(requests=4, context=8192, concurrent=16)
    assert asked.to_dict() == {"requests": 4, "context": 8192, "concurrent": 16}
    assert Asked.from_dict(asked.to_dict()) == asked
    assert Asked.from_dict({"requests": 2, "context": None}) == Asked(
        requests=2
    )  # a record before ``concurrent``


# --- no string-keyed reads of a probe result or a capacity come back -------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor" / "r1sup"
_NAMES = frozenset({"probe", "capacity"})


def _is_typed(node: ast.expr, bound: set[str]) -> bool:
    """``x.probe`` or ``x.capacity``, ``x.get("probe")``/``x["capacity"]`` (a record's), a call of
    ``verified`` or a ``*_capacity`` reader, or a name bound to one of these in the same function."""
    if isinstance(node, ast.Attribute):
        return node.attr in _NAMES
    if isinstance(node, ast.Name):
        return node.id in bound
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value in _NAMES
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("verified", "result_capacity", "record_capacity", "profile_capacity"):
            return True
        return (
            name == "get"
            and bool(node.args)
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in _NAMES
        )
    if isinstance(node, ast.BoolOp):
        return any(_is_typed(v, bound) for v in node.values)
    return False


def _reads_in(scope: ast.AST) -> list[int]:
    bound: set[str] = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and _is_typed(node.value, set()):
            bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return mapping_reads(scope, lambda node: _is_typed(node, bound))


def keyed_reads(source: str) -> list[int]:
    """The lines that read a probe result or a capacity as a mapping, in each function (where a name is
    bound) but the parsers of a record (``from_dict`` and other ``from_...``: the edge where the JSON
    is read)."""
    tree = ast.parse(source)
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("from_"):
            lines.update(_reads_in(node))
    top = ast.Module(
        body=[n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))], type_ignores=[]
    )
    lines.update(_reads_in(top))
    return sorted(lines)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('def f(result):\n    return result.probe.get("ok")', [2]),
        ('def f(d):\n    return self.capacity["requests"]', [2]),
        ('def f(d):\n    c = d.get("capacity")\n    return c.get("reduced")', [3]),
        ('def f(record):\n    p = record["probe"] or {}\n    return p["wave"]', [3]),
        ('def f(config, r):\n    c = result_capacity(config, r)\n    return c["requests"]', [3]),
        ("def f(launch):\n    return dict(launch.probe)", [2]),
        ('def f(d):\n    return d.get("capacity").items()', [2]),
        ("def f(launch):\n    p = launch.probe\n    return p.ok, p.wave.sent, launch.capacity.to_dict()", []),
        ('def from_dict(data):\n    c = data.get("capacity")\n    return c.get("requests")', []),  # the edge
        ('def f(p):\n    return p.get("ok")', []),  # a plain mapping parameter
    ],
)
def test_the_check_names_keyed_reads(source: str, expected: list[int]) -> None:
    assert keyed_reads(source) == expected


def test_the_package_reads_probe_results_and_capacities_by_attribute() -> None:
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in keyed_reads(path.read_text(encoding="utf-8"))
    }
    assert not found, f"read ProbeResult and Capacity by attribute, not by key: {sorted(found)}"


def test_the_probe_reads_vllms_token_counters_summed_over_engines() -> None:
    text = (
        "# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{engine="0"} 100.0\n'
        'vllm:prompt_tokens_total{engine="1"} 20.0\n'
        'vllm:prompt_tokens_created{engine="0"} 1.7e9\n'
        'vllm:generation_tokens_total{engine="0"} 7.0\n'
        'vllm:num_requests_running{engine="0"} 1.0\n'
    )
    assert parse_metrics(text) == {"tokens": 127.0, "running": 1.0}
    assert "tokens" not in parse_metrics('vllm:num_requests_running{engine="0"} 1.0\n')


@pytest.mark.parametrize(
    ("readings", "waits", "moved"),
    [
        # the counters moved by 40 during the one wait (readings outside it do not count)
        ([(0.0, 0.0), (1.0, 10.0), (2.0, 30.0), (3.0, 50.0), (9.0, 900.0)], [(0.5, 3.5)], 40),
        # two waits: the fewer tokens of the two
        ([(1.0, 0.0), (2.0, 5.0), (3.0, 5.0), (4.0, 9.0)], [(0.5, 2.5), (2.5, 4.5)], 4),
        # frozen while it waited: 0, a stall
        ([(1.0, 70.0), (2.0, 70.0), (3.0, 70.0)], [(0.5, 3.5)], 0),
        # a wait with one reading says nothing; the other decides
        ([(1.0, 0.0), (5.0, 8.0), (6.0, 9.0)], [(0.5, 1.5), (4.5, 6.5)], 1),
        # no wait with two readings (/metrics silent, or no vLLM figures): unknown
        ([(1.0, 0.0)], [(0.5, 1.5)], None),
        ([], [(0.0, 10.0)], None),
        # a counter that went back (an engine restarted its counters) is no progress
        ([(1.0, 50.0), (2.0, 3.0)], [(0.0, 3.0)], 0),
    ],
)
def test_progress_while_timed_out_requests_waited(
    readings: list[tuple[float, float]], waits: list[tuple[float, float]], moved: int | None
) -> None:
    assert progress_while_waiting(readings, waits) == moved


def _timed_out(**fields: Any) -> ProbeResult:
    """A failed probe of 4 requests, 1 of which got no answer in time (``fields`` change it)."""
    base: dict[str, Any] = {
        "ok": False,
        "requests": 4,
        "succeeded": 3,
        "error_count": 1,
        "errors": ("request 2: no answer within probe.request_timeout_s (30s): APITimeoutError",),
        "request_timeouts": 1,
        "health_ok": True,
        "timeout_progress_tokens": 812,
    }
    return ProbeResult(**{**base, **fields})


@pytest.mark.parametrize(
    ("result", "cls", "said"),
    [
        # /health answers and vLLM processed tokens while the request waited: busy, not dead
        (_timed_out(), F.PROBE_TIMEOUT, "vLLM processed at least 812 tokens while each waited"),
        # progress unknown (/metrics gave no two readings): never taken for a stall
        (_timed_out(timeout_progress_tokens=None), F.PROBE_TIMEOUT, "gave no progress figures"),
        # a connection lost beside it changes nothing: still no evidence of death
        (
            _timed_out(error_count=2, connection_errors=1, requests=4, succeeded=2),
            F.PROBE_TIMEOUT,
            "1 request got no answer within probe.request_timeout_s (30s)",
        ),
        # frozen counters while it waited, /health answering: the core is stuck
        (_timed_out(timeout_progress_tokens=0), F.HANG, "did not move while they waited"),
        # /health failing: the engine's own evidence
        (_timed_out(health_ok=False), F.ENGINE_DEAD, "and vLLM's /health failed"),
        # a request answered with vLLM's engine-dead reply beside the timeout: the engine's word
        (_timed_out(error_count=2, succeeded=2), F.ENGINE_DEAD, "probe requests failed"),
        # a deadline of the probe's passed while vLLM processed tokens, /health answering: busy too
        (
            _timed_out(timed_out=True),
            F.PROBE_TIMEOUT,
            "the probe timed out (its requests within probe.timeout_s, 90s; the concurrency wave's within "
            "probe.request_timeout_s, 30s); vLLM processed at least 812 tokens",
        ),
        # ... with nothing moving, or progress unknown: a hang, as before
        (_timed_out(timed_out=True, timeout_progress_tokens=0), F.HANG, "did not move while its requests"),
        (_timed_out(timed_out=True, timeout_progress_tokens=None), F.HANG, "the probe timed out"),
        (_timed_out(timed_out=True, health_ok=None), F.HANG, "the probe timed out"),
        # ... with /health failing: the engine's own evidence
        (_timed_out(timed_out=True, health_ok=False), F.ENGINE_DEAD, "and vLLM's /health failed"),
    ],
)
def test_a_timed_out_probe_request_is_judged_by_the_engines_evidence(
    result: ProbeResult, cls: str, said: str
) -> None:
    failure = probe_failure(result, 30.0, 90.0)
    assert failure.cls == cls
    assert said in failure.detail and failure.phase == F.PHASE_SERVING
    assert failure.evidence == result.first_error


def test_the_probe_faults_without_timeouts_keep_their_classes() -> None:
    lost = ProbeResult(ok=False, requests=2, error_count=1, connection_errors=1, health_ok=True)
    assert probe_failure(lost, 30.0, 90.0).cls == F.PROBE_CONNECTION
    answered = ProbeResult(ok=False, requests=2, error_count=1, server_errors=1, health_ok=True)
    assert probe_failure(answered, 30.0, 90.0).cls == F.PROBE_SERVER_ERROR
    assert probe_failure(replace(answered, health_ok=False), 30.0, 90.0).cls == F.ENGINE_DEAD
    rejected = ProbeResult(ok=False, requests=2, error_count=1, rejected=1, request_timeouts=0)
    assert probe_failure(rejected, 30.0, 90.0).cls == F.PROBE_REJECTED


def test_a_timed_out_request_and_the_progress_beside_it_round_trip() -> None:
    result = _timed_out()
    record = result.to_dict()
    assert (record["request_timeouts"], record["timeout_progress_tokens"]) == (1, 812)
    assert ProbeResult.from_dict(json.loads(json.dumps(record))) == result
    assert "timeout_progress_tokens" not in ProbeResult(ok=True).to_dict()  # not measured: not written
