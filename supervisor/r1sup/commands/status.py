"""``r1sup status``: the profiles known and, when a daemon runs, its live state and recent events.

Read-only: unusable files are reported, not moved aside. Kept light to start fast: no openai, torch,
vLLM, device probing or planner; psutil only when a status file names a pid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from r1sup.flags import EngineFlags
from r1sup.profiles import Profile, ProfileStore
from r1sup.statefiles import SCHEMA_VERSION, inspect_json, parse_iso, pid_alive

DEFAULT_STATE_DIR = "/var/lib/r1sup"
STATUS_FILE = "status.json"
# a process created this much later than the status file was last written cannot have written it
_PID_REUSE_SLACK = timedelta(seconds=2)
_EVENTS_SHOWN = 10


def main(args: argparse.Namespace) -> int:
    state_dir = resolve_state_dir(args)
    report = collect(state_dir)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render(report))
    return 0


def resolve_state_dir(args: argparse.Namespace) -> Path:
    """--state-dir, else the config's state.dir, else /var/lib/r1sup."""
    if getattr(args, "state_dir", None):
        return Path(args.state_dir)
    if getattr(args, "config", None):
        from r1sup.cli import load_config

        return Path(load_config(args).state.dir)
    return Path(DEFAULT_STATE_DIR)


def collect(state_dir: Path) -> dict[str, Any]:
    """Everything ``status`` shows, as the ``--json`` object."""
    exists = state_dir.is_dir()
    profiles: list[Profile] = []
    problems: list[tuple[Path, str]] = []
    if exists:
        profiles, problems = ProfileStore(state_dir, repair=False).scan()
    return {
        "state_dir": str(state_dir),
        "exists": exists,
        "profiles": [p.to_dict() for p in profiles],
        "unusable_files": [{"path": str(p), "reason": r} for p, r in problems],
        "daemon": daemon_state(state_dir) if exists else None,
    }


def daemon_state(state_dir: Path) -> dict[str, Any] | None:
    """status.json with ``alive``/``stale`` added; None when there is no status file."""
    path = state_dir / STATUS_FILE
    data, problem = inspect_json(path, expect_schema=SCHEMA_VERSION)
    if data is None and problem is None:
        return None
    if data is None:
        return {
            "status_file": str(path),
            "problem": problem,
            "alive": False,
            "stale": True,
            "liveness": problem,
        }
    out = dict(data)
    alive, liveness = daemon_alive(data.get("pid"), data.get("updated_at"))
    out.update(status_file=str(path), alive=alive, stale=not alive, liveness=liveness)
    child = data.get("child_pid")
    out["child_alive"] = bool(alive and isinstance(child, int) and _is_pid(child) and pid_alive(child))
    return out


def daemon_alive(pid: Any, updated_at: Any) -> tuple[bool, str]:
    """Whether ``pid`` is a live r1sup process that can have written a status at ``updated_at``."""
    if not _is_pid(pid):
        return False, "no pid in the status file"
    if pid == os.getpid():
        return False, f"pid {pid} is this status command (reused)"
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False, f"pid {pid} has exited (zombie)"
        cmdline = proc.cmdline()
        created = proc.create_time()
    except psutil.ZombieProcess:
        return False, f"pid {pid} has exited (zombie)"
    except psutil.NoSuchProcess:
        return False, f"pid {pid} does not exist"
    except psutil.AccessDenied:
        return True, f"pid {pid} exists (its command line is not readable)"
    if not is_r1sup_cmdline(cmdline):
        return False, f"pid {pid} is not an r1sup process ({' '.join(cmdline)[:80] or '?'})"
    if isinstance(updated_at, str):
        try:
            written = parse_iso(updated_at)
        except ValueError:
            written = None
        if written is not None and written.timestamp() + _PID_REUSE_SLACK.total_seconds() < created:
            return False, f"pid {pid} was started after the status was written (reused)"
    return True, "running"


def is_r1sup_cmdline(argv: list[str]) -> bool:
    """``r1sup ...``, ``python [opts] /path/bin/r1sup ...`` or ``python [opts] -m r1sup[.module] ...``."""
    if not argv:
        return False
    if os.path.basename(argv[0]) == "r1sup":
        return True
    if not os.path.basename(argv[0]).startswith("python"):
        return False
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-W", "-X"):
            next(args, None)  # the option's value
            continue
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = next(args, "") if arg == "-m" else arg[2:]
            return module == "r1sup" or module.startswith("r1sup.")
        if arg == "-c" or arg == "-":
            return False
        if not arg.startswith("-"):
            return os.path.basename(arg) == "r1sup"  # the script python runs
    return False


def _is_pid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# --- human output ------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    lines = [f"state directory: {report['state_dir']}"]
    if not report["exists"]:
        if os.path.lexists(report["state_dir"]):
            lines.append("  is not a directory: no profiles or daemon state can be there")
        else:
            lines.append("  does not exist: no profiles saved and no daemon has run with it")
        return "\n".join(lines) + "\n"
    profiles = report["profiles"]
    lines.append(f"profiles: {len(profiles) or 'none'}")
    for p in profiles:
        lines.append(f"  {p['key']}  {p['model']} (served as {p['served_name']})  updated {p['updated_at']}")
        lines.append(f"    flags: {flags_summary(p['flags'])}")
        lines.append(f"    probe: {scalars(p['probe']) or 'no results recorded'}")
        lines.append(f"    box: {box_summary(p['fingerprint'])}")
        if p.get("imported"):
            lines.append(f"    imported from {p['imported'].get('from')} with differences")
    for item in report["unusable_files"]:
        lines.append(f"  unusable: {item['path']}: {item['reason']}")
    lines += _render_daemon(report["daemon"])
    return "\n".join(lines) + "\n"


def _render_daemon(d: dict[str, Any] | None) -> list[str]:
    if d is None:
        return ["daemon: no status file (not running, or never run with this state directory)"]
    if "problem" in d:
        return [f"daemon: status file unusable: {d['problem']}"]
    state = d.get("state", "?")
    if d["alive"]:
        head = f"daemon: {state}, pid {d.get('pid')} running"
    else:
        head = f"daemon: not running (stale status: last state {state}; {d['liveness']})"
    lines = [head]
    child = d.get("child_pid")
    parts = []
    if child is not None:
        parts.append(f"child pid {child}" + (" running" if d.get("child_alive") else " not running"))
    for label, name in (
        ("launches", "launches"),
        ("since", "since"),
        ("profile", "profile_source"),
        ("model", "served_model"),
        ("port", "port"),
        ("updated", "updated_at"),
    ):
        if d.get(name) is not None:
            parts.append(f"{label} {d[name]}")
    if parts:
        lines.append("  " + ", ".join(parts))
    if isinstance(d.get("flags"), dict):
        lines.append(f"  flags: {flags_summary(d['flags'])}")
    failure = d.get("last_failure")
    if failure:
        lines.append(f"  last failure: {scalars(failure) if isinstance(failure, dict) else failure}")
    events = d.get("recent_events")
    if isinstance(events, list) and events:
        lines.append("  recent events:")
        for ev in events[-_EVENTS_SHOWN:]:
            if isinstance(ev, dict):
                rest = {k: v for k, v in ev.items() if k not in ("ts", "event")}
                lines.append(f"    {ev.get('ts', '?')} {ev.get('event', '?')} {scalars(rest)}".rstrip())
    return lines


def flags_summary(flags: dict[str, Any]) -> str:
    """The flags that matter: context and utilization always, the rest where not vLLM's default."""
    defaults = EngineFlags().to_dict()
    shown = {
        k: v
        for k, v in flags.items()
        if k in ("max_model_len", "gpu_memory_utilization") or defaults.get(k, object()) != v
    }
    return scalars(shown) or "defaults"


def box_summary(fp: dict[str, Any]) -> str:
    parts = []
    gpu, cpu = fp.get("gpu"), fp.get("cpu")
    if isinstance(gpu, dict):
        names = gpu.get("names") or []
        parts.append(f"{gpu.get('count', len(names))}x {', '.join(sorted(set(map(str, names))))}")
    elif isinstance(cpu, dict):
        parts.append(f"CPU {cpu.get('model') or '?'}, {cpu.get('memory_gib')} GiB")
    versions = fp.get("versions")
    if isinstance(versions, dict):
        parts.append(f"vllm {versions.get('vllm')}, torch {versions.get('torch')}")
    return "; ".join(parts) or "?"


def scalars(d: dict[str, Any], limit: int = 12) -> str:
    """``k=v`` pairs of a dict; nested values as compact JSON."""
    out = []
    for k, v in list(d.items())[:limit]:
        if v is None:
            continue
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), default=str)
        out.append(f"{k}={text if len(text) <= 80 else text[:77] + '...'}")
    return " ".join(out)
