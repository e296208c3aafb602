"""A failure's numbers as one typed value: every number the log reader or the liveness judgement
produces has a field, and the serialised object (run records, ``diagnose --json``, events) round-trips
with the same keys and the same values."""

from __future__ import annotations

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from keyed_reads import mapping_reads
from r1sup.core import failure as F
from r1sup.core import liveness
from r1sup.core.failure import MESSAGE_NAMES, NO_NUMBERS, NUMBER_NAMES, Failure, Numbers
from r1sup.core.figures import Figures
from r1sup.core.logparse import LogReader, families, lines_from_chunks

LOGS = sorted((Path(__file__).parent / "fixtures" / "logs").rglob("*.log"))


def _read(path: Path) -> LogReader:
    reader = LogReader()
    reader.feed_lines(lines_from_chunks([path.read_bytes()]))
    return reader


def test_every_figure_a_failure_message_carries_is_a_field() -> None:
    # the reader's patterns name their figures by group; a group without a field would be dropped
    groups = {
        name
        for patterns in families._NUMBERS_BY_CLASS.values()
        for rx in patterns
        for name in rx.groupindex
        if not name.endswith("_unit")
    }
    groups |= {"port", "shortfall_gib"}  # the port clash's alternatives, the free-memory shortfall
    assert groups <= set(NUMBER_NAMES), groups - set(NUMBER_NAMES)


def test_every_figure_a_hung_verdict_rests_on_is_a_field() -> None:
    track = liveness.Track(
        started_at=0.0,
        last_progress_at=10.0,
        figures=liveness.Figures(running=2, waiting=1, prompt_tokens=5, generation_tokens=7, finished=3),
        figures_at=50.0,
        stats=liveness.StatsLine(prompt_tps=0.0, generation_tps=0.0, running=2, waiting=1),
        stats_at=50.0,
        pending_since=20.0,
        own_pending_since=30.0,
    )
    policy = liveness.Policy(interval_s=10.0, progress_timeout_s=60.0, health_failures=3)
    verdict = liveness.decide(track, 400.0, policy)
    numeric = {k for k, v in verdict.figures.items() if isinstance(v, (int, float)) and v is not None}
    assert "stalled_s" in numeric and "stats_running" in numeric  # the verdict this test needs
    assert numeric <= set(NUMBER_NAMES), numeric - set(NUMBER_NAMES)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_a_logs_numbers_round_trip_through_json(path: Path) -> None:
    failure = _read(path).verdict()
    text = json.dumps(failure.to_dict())
    again = Failure.from_dict(json.loads(text))
    assert again == failure
    assert json.dumps(again.to_dict()) == text  # ints stay ints, floats stay floats, same key order


@pytest.mark.parametrize("path", LOGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_a_failure_keeps_the_figures_the_reader_gathered(path: Path) -> None:
    reader = _read(path)
    numbers = reader.verdict().numbers
    # a failure message's own figure (the context of a failed check) may stand over the launch's
    gathered = reader.collected().observations
    assert set(gathered) <= set(numbers.figures.to_dict())


def test_the_fixtures_fail_with_message_numbers() -> None:
    # the round trips above would pass on logs whose failures carry only the launch's figures
    verdicts = [_read(path).verdict().numbers for path in LOGS]
    carried = {name for numbers in verdicts for name in MESSAGE_NAMES if getattr(numbers, name)}
    assert {"tried_to_allocate_mib", "estimated_max_model_len", "kv_available_gib"} <= carried


def test_flat_keys_split_into_the_figures_and_the_messages_own() -> None:
    numbers = Numbers.from_dict(
        {"max_model_len": 32768, "kv_available_gib": -0.25, "weights_gib": 14.19, "device_index": 0}
    )
    assert numbers.figures == Figures(max_model_len=32768, weights_gib=14.19)
    assert (numbers.kv_available_gib, numbers.device_index) == (-0.25, 0)
    assert numbers.to_dict() == {
        "weights_gib": 14.19,
        "max_model_len": 32768,
        "kv_available_gib": -0.25,
        "device_index": 0,
    }


def test_the_serialised_keys_keep_the_order_they_were_read_in() -> None:
    # the log's order, not the fields': a record written now is the bytes one written before the type
    read = {"tried_to_allocate_mib": 20.0, "kv_cache_gib": 1.5, "device_free_mib": 3.0, "weights_gib": 14.0}
    numbers = Numbers.from_dict(read)
    assert list(numbers.to_dict()) == list(read)
    more = replace(numbers, kv_capacity_tokens=4096)  # set later: after the keys read
    assert list(more.to_dict()) == [*read, "kv_capacity_tokens"]
    assert numbers == Numbers.from_dict(dict(reversed(read.items())))  # the order is not part of the value


@pytest.mark.parametrize(
    "stored",
    [
        None,
        {},
        {"a_gib": 1.5},
        {"tried_to_allocate_mib": True},
        {"tried_to_allocate_mib": float("nan")},
        {"device_free_mib": "12"},
    ],
)
def test_unknown_keys_and_values_that_are_not_numbers_are_left_out(stored: dict | None) -> None:
    assert Numbers.from_dict(stored) is NO_NUMBERS
    assert not Numbers.from_dict(stored)


def test_a_failure_without_numbers_writes_an_empty_object() -> None:
    assert Failure(F.HANG).to_dict()["numbers"] == {}
    assert Numbers(kv_capacity_tokens=0)  # a zero was printed: not "no numbers"


# --- no string-keyed reads of a failure's numbers come back ----------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "supervisor" / "r1sup"


def _is_numbers(node: ast.expr, bound: set[str]) -> bool:
    """``x.numbers``, or a name bound to one (``n = failure.numbers``)."""
    return (isinstance(node, ast.Attribute) and node.attr == "numbers") or (
        isinstance(node, ast.Name) and node.id in bound
    )


def keyed_reads(source: str) -> list[int]:
    """The lines that read ``.numbers`` as a mapping: subscripted, ``.get`` and the like, ``dict(...)``."""
    tree = ast.parse(source)
    bound = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "numbers"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return sorted(mapping_reads(tree, lambda node: _is_numbers(node, bound)))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('x = failure.numbers.get("free_gib")', [1]),
        ('x = failure.numbers["free_gib"]', [1]),
        ("x = dict(failure.numbers)", [1]),
        ('n = failure.numbers\nfree = n.get("free_gib")\ntotal = n["total_gib"]', [2, 3]),
        ("for k, v in outcome.failure.numbers.items():\n    pass", [1]),
        ("n = failure.numbers\nx = n.figures.free_gib\ny = n.tried_to_allocate_mib", []),
        ("d = failure.numbers.to_dict()", []),
        ('percent = numbers.get("weights_percent")', []),  # a plain mapping parameter, not a failure's
    ],
)
def test_the_check_names_keyed_reads(source: str, expected: list[int]) -> None:
    assert keyed_reads(source) == expected


def test_the_package_reads_a_failures_numbers_by_attribute() -> None:
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in keyed_reads(path.read_text(encoding="utf-8"))
    }
    assert not found, f"read Failure.numbers by attribute (Numbers), not by key: {sorted(found)}"
