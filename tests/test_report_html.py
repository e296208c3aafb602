"""The HTML report of a run record, rendered from plain data (fast; the page of a real tune, opened in a
browser, is in test_report.py): what it says about a daemon still serving, and the events it shows."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from r1sup.cli import report

FLAGS = {
    "max_model_len": 4096,
    "gpu_memory_utilization": 0.9,
    "kv_cache_dtype": "auto",
    "enforce_eager": False,
}


def record(command: str, *, finished: bool, final_state: str | None = None) -> dict[str, Any]:
    return {
        "id": f"20260101T000000Z-{command}-123",
        "command": command,
        "pid": 123,
        "started_at": "2026-01-01T00:00:00Z",
        "finished_at": "2026-01-01T01:00:00Z" if finished else None,
        "final_state": final_state,
        "model": "tiny",
        "served_name": "tiny",
        "attempts": [{"launch": 1, "outcome": "ok", "flags": FLAGS, "seconds": 40.0}],
        "result": {"ok": True, "exit_code": 0, "launches": 1, "flags": FLAGS, "command": ["python"]},
    }


class _Summary(HTMLParser):
    """The summary table's rows as {header: cell text}."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, str] = {}
        self.events: list[list[str]] = []
        self._cell: list[str] | None = None
        self._row: list[str] = []
        self._table = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
        elif tag == "tr":
            self._row = []
        elif tag in ("th", "td"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "td") and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._table == "summary" and len(self._row) == 2:
            self.rows[self._row[0]] = self._row[1]
        elif tag == "tr" and self._table == "events":
            self.events.append(self._row)

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(page: str) -> _Summary:
    p = _Summary()
    p.feed(page)
    return p


def test_a_running_daemon_shows_no_exit_code() -> None:
    rows = parse(report.render_html(record("run", finished=False))).rows
    assert rows["finished"] == "not yet (still running)"
    assert "exit code" not in rows and "final state" not in rows


def test_a_finished_run_shows_the_state_it_ended_in_and_a_tune_its_exit_code() -> None:
    rows = parse(report.render_html(record("run", finished=True, final_state="failed"))).rows
    assert rows["finished"] == "2026-01-01T01:00:00Z" and rows["final state"] == "failed"
    assert "exit code" not in rows
    rows = parse(report.render_html(record("tune", finished=True))).rows
    assert rows["exit code"] == "0"


def test_events_show_their_values_as_json_not_python() -> None:
    events = [
        {
            "ts": "2026-01-01T00:30:00Z",
            "event": "liveness",
            "probe": False,
            "metrics_error": None,
            "since_progress_s": 60.9,
            "flags": {"enforce_eager": True, "max_num_seqs": None},
            "argv": ["--max-model-len", "4096"],
            "reason": "work pending for 1s",
        }
    ]
    page = report.render_html(record("run", finished=False), {"recent_events": events})
    (row,) = parse(page).events
    assert row[:2] == ["2026-01-01T00:30:00Z", "liveness"]
    assert row[2] == (
        'probe=false, metrics_error=null, since_progress_s=60.9, flags={"enforce_eager": true, '
        '"max_num_seqs": null}, argv=["--max-model-len", "4096"], reason=work pending for 1s'
    )
    assert not re.search(r"\b(False|True|None)\b", row[2])


# --- issue 36: the page says what the text report says -------------------------------------------

PROBE = {
    "ok": True,
    "requests": 4,
    "succeeded": 4,
    "concurrency": 4,
    "concurrency_proven": 1,
    "prompt_tokens": 128441,
    "output_tokens": 8,
    "ttft_p50_s": 0.12,
    "ttft_p95_s": 0.15,
    "wave": {"sent": 16, "concurrency_proven": 12, "limit": 16, "prompt_tokens": 255, "ttft_p50_s": 0.06},
}
COST = "kv_cache_dtype fp8: KV cache in 8 bits, a small accuracy cost"
REASON = "max_model_len 36864 gives 28% of the 131,072 tokens asked; the ways out: --tensor-parallel-size 2"


def served(reduced: dict[str, Any] | None) -> dict[str, Any]:
    """A tune that found flags for a 7B on a 4090, its probe's long requests one at a time of 4 asked."""
    rec = record("tune", finished=True)
    rec["asked"] = {"requests": 4, "context": 131072, "concurrent": 16}
    rec["result"].update(
        probe=PROBE,
        observations={"kv_cache_tokens": 202928},
        costs=[COST],
        reduced=reduced,
        flags={**FLAGS, "max_model_len": 131072},
    )
    return rec


def verdict_class(page: str) -> str:
    found = re.search(r'<p class="verdict ([a-z]+)">', page)
    assert found, page[:500]
    return found.group(1)


def test_a_reduced_configuration_is_not_a_green_banner_and_the_page_says_what_the_text_says() -> None:
    rec = served({"reason": REASON, "context": 36864, "asked_context": 131072})
    page = report.render_html(rec)
    text = report.render_text(rec)
    assert verdict_class(page) == "reduced"
    assert "REDUCED" in re.search(r'<p class="verdict [a-z]+">([^<]*)</p>', page).group(1)  # type: ignore[union-attr]
    rows = parse(page).rows
    # the capacity line, the reduction and the costs: word for word the text report's
    capacity = next(line for line in text.splitlines() if line.startswith("capacity: "))
    assert rows["capacity"] == capacity.removeprefix("capacity: ")
    assert rows["REDUCED"] == REASON and REASON in text
    assert rows["costs"] == COST and f"  costs: {COST}" in text
    assert "1.55 such requests fit vLLM's 202,928-token KV cache" in rows["capacity"]


def test_the_capacitys_shortfall_alone_marks_the_page_reduced() -> None:
    page = report.render_html(served(None))
    assert verdict_class(page) == "reduced"
    assert parse(page).rows["REDUCED"] == "1 request(s) at once of 4 asked"


def test_a_configuration_that_serves_what_was_asked_stays_green() -> None:
    rec = served(None)
    rec["asked"] = {"requests": 1, "context": 131072, "concurrent": 16}
    page = report.render_html(rec)
    assert verdict_class(page) == "ok"
    rows = parse(page).rows
    assert "REDUCED" not in rows and "REDUCED" not in page and rows["costs"] == COST
