"""The log reader's figures as one typed value: nothing the reader gathers is lost on the way out, and
what profiles and run records store round-trips with the same keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r1sup.core.figures import FIELD_NAMES, Figures
from r1sup.core.logparse import LogReader, lines_from_chunks

LOGS = sorted((Path(__file__).parent / "fixtures" / "logs").rglob("*.log"))


@pytest.mark.parametrize("path", LOGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_figure_the_reader_gathers_is_a_field(path: Path) -> None:
    reader = LogReader()
    reader.feed_lines(lines_from_chunks([path.read_bytes()]))
    gathered = reader.collected().observations  # the reader's own record, before it is typed
    assert set(gathered) <= set(FIELD_NAMES), set(gathered) - set(FIELD_NAMES)
    assert reader.figures.to_dict() == dict(gathered)


def test_the_fixtures_print_figures() -> None:
    # the test above would pass on logs that print nothing: most of them do print
    printed = 0
    for path in LOGS:
        reader = LogReader()
        reader.feed_lines(lines_from_chunks([path.read_bytes()]))
        printed += bool(reader.figures)
    assert printed >= len(LOGS) // 2


def test_persisted_figures_round_trip_with_their_keys() -> None:
    stored = {
        "weights_gib": 14.19,
        "kv_cache_tokens": 101456,
        "kv_cache_gib": 5.42,
        "compile_cache_cold": 0.0,
    }
    figures = Figures.from_dict(json.loads(json.dumps(stored)))
    assert figures.kv_cache_tokens == 101456 and figures.compile_cache_cold == 0.0
    assert json.loads(json.dumps(figures.to_dict())) == stored


@pytest.mark.parametrize(
    ("stored", "kept"),
    [
        ({"weights_gib": True}, {}),  # a boolean is not a figure
        ({"weights_gib": "14"}, {}),
        ({"weights_gib": float("nan"), "kv_cache_gib": 1.5}, {"kv_cache_gib": 1.5}),
        ({"pad": 1.0, "kv_cache_gib": -0.5}, {"kv_cache_gib": -0.5}),  # unknown keys are left out
        (None, {}),
    ],
)
def test_only_finite_numbers_of_known_keys_are_read(stored: dict | None, kept: dict) -> None:
    assert Figures.from_dict(stored).to_dict() == kept


@pytest.mark.parametrize(
    ("figures", "gpus", "in_use"),
    [
        (Figures(weights_gib=14.0, kv_cache_gib=5.0), 1, 19.0),
        (Figures(weights_gib=14.0, kv_cache_gib=5.0, non_torch_gib=0.5, cudagraph_gib=0.5), 2, 40.0),
        # 0.27 on prints weights + non-torch as one figure
        (Figures(weights_gib=14.0, consumed_gib=14.5, kv_cache_gib=5.0), 1, 19.5),
        (Figures(weights_gib=14.0), 1, None),  # before the KV cache was sized
    ],
)
def test_memory_in_use(figures: Figures, gpus: int, in_use: float | None) -> None:
    assert figures.memory_in_use_gib(gpus) == in_use


def test_figures_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Figures().weights_gib = 1.0  # type: ignore[misc]
