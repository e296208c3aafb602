"""``r1sup report``: the report of a tune or run from its run record: text, JSON, or one HTML page.

Read-only and light: the run records under ``<state dir>/runs/`` (r1sup.state.runrecord) and, for a run,
the daemon's ``status.json`` for its recent events. No engine, device or planner is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from r1sup.adapters.statefiles import SCHEMA_VERSION, inspect_json
from r1sup.cli import report
from r1sup.cli.commands.status import STATUS_FILE, printable, resolve_state_dir
from r1sup.core.errors import ConfigError, InputError, R1supError
from r1sup.state import runrecord


class WriteError(R1supError):
    """The HTML file could not be written (exit 1)."""


def main(args: argparse.Namespace) -> int:
    state_dir = resolve_state_dir(args)
    files = runrecord.run_files(state_dir)
    if args.list:
        sys.stdout.write(_listing(state_dir, files))
        return 0
    path = _pick(state_dir, files, args.run)
    record, problem = runrecord.load(path)
    if record is None:
        raise InputError(f"{path}: unusable run record ({problem})")
    status = _status_of(state_dir, record)
    if args.html:
        page = report.render_html(record, status, source=str(path))
        if args.html == "-":
            sys.stdout.write(page)
            return 0
        _write(Path(args.html), page)
        sys.stdout.write(f"wrote {args.html} ({headline_short(record)})\n")
        return 0
    if args.json:
        sys.stdout.write(json.dumps({"record": record, "status": status}, indent=2, default=str) + "\n")
        return 0
    sys.stdout.write(printable(report.render_text(record)))
    return 0


def headline_short(record: dict[str, Any]) -> str:
    return f"{record.get('id')}: {report.headline(record)}"


def _pick(state_dir: Path, files: list[Path], wanted: str | None) -> Path:
    if not files:
        raise ConfigError(
            "--state-dir",
            f"no run records in {state_dir / runrecord.RUNS_SUBDIR} (r1sup tune or r1sup run makes one)",
        )
    if not wanted or wanted == "latest":
        return files[0]
    matches = [f for f in files if f.stem == wanted or f.stem.startswith(wanted)]
    if len(matches) != 1:
        known = ", ".join(f.stem for f in files[:5])
        what = "no run" if not matches else f"{len(matches)} runs"
        raise ConfigError("--run", f"{what} match {wanted!r}; the newest: {known}")
    return matches[0]


def _status_of(state_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The daemon's status.json when it belongs to this run (same pid), for its recent events."""
    if record.get("command") != "run":
        return None
    status, _ = inspect_json(state_dir / STATUS_FILE, expect_schema=SCHEMA_VERSION, finite=True)
    if status is None or status.get("pid") != record.get("pid"):
        return None
    return status


def _listing(state_dir: Path, files: list[Path]) -> str:
    if not files:
        return f"no run records in {state_dir / runrecord.RUNS_SUBDIR}\n"
    lines = []
    for f in files:
        record, problem = runrecord.load(f)
        if record is None:
            lines.append(f"{f.stem}  unusable: {problem}")
            continue
        result = record.get("result") or {}
        outcome = (
            "in progress" if not result else ("ok" if result.get("ok") else f"exit {result.get('exit_code')}")
        )
        lines.append(
            f"{f.stem}  {record.get('model')}  {len(record.get('attempts') or [])} attempt(s)  {outcome}"
        )
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from None
