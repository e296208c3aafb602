"""``r1sup status``: like ``ollama ps``, one line per served model (model, URL, context, requests at
once and output tokens/s as the load probe proved them, memory in use, uptime, state or loading
progress; ``--verbose`` adds the KV cache's size and usage, TTFT, launches and the profile's source),
then the details and recent events of each daemon, then the saved profiles. A configuration that
serves less than its config asked (fewer requests at once, a shorter context) reads ``REDUCED`` with
how. ``--watch`` redraws it every few seconds.

Read-only: unusable files are reported, not moved aside. Kept light to start fast: no openai, torch,
vLLM, device probing or planner; psutil only when a status file names a pid; the KV usage (vLLM's
``/metrics``) and the memory in use (NVML, else the process tree's RSS) only for a live daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import unicodedata
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from r1sup.adapters.statefiles import SCHEMA_VERSION, inspect_json, parse_iso, pid_alive, utc_now_iso
from r1sup.core.capacity import Capacity
from r1sup.core.flags import EngineFlags
from r1sup.state.profiles import Profile, ProfileStore

DEFAULT_STATE_DIR = "/var/lib/r1sup"
STATUS_FILE = "status.json"
# a process created this much later than the status file was last written cannot have written it
_PID_REUSE_SLACK = timedelta(seconds=2)
_EVENTS_SHOWN = 10
_LIVE_TIMEOUT_S = 1.0  # vLLM's /metrics, asked for the KV cache usage of a serving daemon
_DONE_STATES = ("stopped", "failed")
# --watch: at least 0.1 s between redraws (watch(1)'s floor: a smaller one floods the terminal and the
# CPU), at most a day (time.sleep cannot wait for inf or 1e300)
WATCH_MIN_S = 0.1
WATCH_MAX_S = 86400.0


def main(args: argparse.Namespace) -> int:
    state_dir = resolve_state_dir(args)
    interval = getattr(args, "watch", None)
    verbose = bool(getattr(args, "verbose", False))
    if interval is None:
        _show(state_dir, args.json, verbose)
        return 0
    if not WATCH_MIN_S <= interval <= WATCH_MAX_S:
        from r1sup.core.errors import ConfigError

        raise ConfigError(
            "--watch",
            f"must be a positive number of seconds from {WATCH_MIN_S:g} to {WATCH_MAX_S:g}, got {interval}",
        )
    tty = sys.stdout.isatty()
    try:
        while True:
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: the same screen redrawn
            else:
                stamp = utc_now_iso()
                sys.stdout.write(f"--- {stamp}\n")
            _show(state_dir, args.json, verbose)
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends
        return 0


def _show(state_dir: Path, as_json: bool, verbose: bool = False) -> None:
    report = collect(state_dir)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(printable(render(report, verbose)))


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters other than the newline (an escape sequence
    written into a status file or a profile), lone surrogates (which no encoding can write) and the
    other characters Python does not print (format and line separators, spaces aside) are shown as
    Python escapes (``\\x1b``, ``\\ud800``), never sent raw."""
    if text.replace("\n", "").isprintable():
        return text
    return "".join(ch if _shown(ch) else _escape(ch) for ch in text)


def _shown(ch: str) -> bool:
    return ch == "\n" or ch.isprintable() or unicodedata.category(ch) == "Zs"


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def resolve_state_dir(args: argparse.Namespace) -> Path:
    """--state-dir, else the config's state.dir, else /var/lib/r1sup."""
    if getattr(args, "state_dir", None):
        return Path(args.state_dir)
    if getattr(args, "config", None):
        from r1sup.cli.app import load_config

        return Path(load_config(args).state.dir)
    return Path(DEFAULT_STATE_DIR)


def collect(state_dir: Path) -> dict[str, Any]:
    """Everything ``status`` shows, as the ``--json`` object: this directory's daemon, and those of
    its subdirectories (``/var/lib/r1sup/NAME`` of the systemd template) as ``instances``."""
    exists = state_dir.is_dir()
    profiles: list[Profile] = []
    problems: list[tuple[Path, str]] = []
    if exists:
        profiles, problems = ProfileStore(state_dir, repair=False).scan()
    daemon = daemon_state(state_dir) if exists else None
    instances: list[tuple[Path, dict[str, Any] | None]] = []
    if exists:
        instances = [(sub, daemon_state(sub)) for sub in _subdirs_with_status(state_dir)]
    served = [
        served_row(d) for d in (daemon, *(d for _, d in instances)) if d is not None and "problem" not in d
    ]
    out: dict[str, Any] = {
        "state_dir": str(state_dir),
        "exists": exists,
        "profiles": [p.to_dict() for p in profiles],
        "unusable_files": [{"path": str(p), "reason": r} for p, r in problems],
        "daemon": daemon,
    }
    if instances:
        out["instances"] = [{"state_dir": str(sub), "daemon": d} for sub, d in instances]
    if served:
        out["served"] = served
    return out


def _subdirs_with_status(state_dir: Path) -> list[Path]:
    try:
        entries = sorted(os.scandir(state_dir), key=lambda e: e.name)
    except OSError:
        return []
    return [
        Path(e.path)
        for e in entries
        if e.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(e.path, STATUS_FILE))
    ]


def daemon_state(state_dir: Path) -> dict[str, Any] | None:
    """status.json with ``alive``/``stale`` added; None when there is no status file."""
    path = state_dir / STATUS_FILE
    data, problem = inspect_json(path, expect_schema=SCHEMA_VERSION, finite=True)
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
    # a daemon that wrote "stopped" (or "failed") on its way out ended; only one that vanished in
    # another state left a stale status behind
    ended = not alive and data.get("state") in _DONE_STATES
    out.update(status_file=str(path), alive=alive, stale=not alive and not ended, liveness=liveness)
    child = data.get("child_pid")
    out["child_alive"] = bool(alive and isinstance(child, int) and _is_pid(child) and pid_alive(child))
    return out


# --- the ollama-ps line -------------------------------------------------------------------------


def served_row(d: dict[str, Any]) -> dict[str, Any]:
    """One served model: what ``status`` prints on its line (and ``--json`` as ``served``)."""
    raw = d.get("flags")
    flags: dict[str, Any] = raw if isinstance(raw, dict) else {}
    port = d.get("port")
    url = d.get("url") or (f"http://127.0.0.1:{port}/v1" if port else None)
    state = str(d.get("state", "?"))
    alive = bool(d.get("alive"))
    capacity = Capacity.from_dict(d.get("capacity")) or Capacity()
    row: dict[str, Any] = {
        "model": d.get("served_model"),
        "url": url,
        "context": d.get("max_model_len") or flags.get("max_model_len"),
        # what the load probe proved for the flags being served (r1sup.core.capacity)
        "requests": capacity.requests,
        "output_tokens_per_second": capacity.output_tokens_per_second,
        "ttft_p50_s": capacity.ttft_p50_s,
        "ttft_p95_s": capacity.ttft_p95_s,
        "reduced": capacity.reduced,
        "reduced_because": list(capacity.reduced_because),
        "kv_cache_tokens": d.get("kv_cache_tokens"),
        "kv_cache_usage": None,
        "memory_gib": None,
        "memory_kind": None,
        "uptime_s": None,
        "launches": d.get("launches"),
        "profile_source": d.get("profile_source"),
        "state": state if alive or state in _DONE_STATES else "stale",
        "progress": None,
    }
    if alive and state == "serving":
        since = _when(d.get("since"))
        if since is not None:
            row["uptime_s"] = max(0.0, (datetime.now(timezone.utc) - since).total_seconds())
        if url:
            row["kv_cache_usage"] = kv_usage(url)
    row["memory_gib"], row["memory_kind"] = serving_memory(d, alive)
    progress = d.get("progress")
    if alive and state in ("launching", "probing") and isinstance(progress, dict):
        row["progress"] = live_progress(progress, d.get("attempt"))
    return row


def live_progress(p: dict[str, Any], attempt: Any) -> dict[str, Any]:
    """The daemon's last progress, with elapsed time and ETA counted on to now."""
    now = datetime.now(timezone.utc)
    out = dict(p)
    started, eta_at = _when(p.get("launch_started_at")), _when(p.get("eta_at"))
    if started is not None:
        out["elapsed_s"] = round((now - started).total_seconds(), 1)
    if eta_at is not None:
        out["eta_s"] = round(max(0.0, (eta_at - now).total_seconds()), 1)
    out["attempt"] = attempt
    return out


def progress_text(p: dict[str, Any]) -> str:
    from r1sup.core.progress import clock

    text = str(p.get("label") or p.get("phase"))
    if isinstance(p.get("percent"), (int, float)):
        text += f" {p['percent']:.0f}%"
    if isinstance(p.get("elapsed_s"), (int, float)):
        text += f", {clock(p['elapsed_s'])} elapsed"
    if isinstance(p.get("eta_s"), (int, float)):
        text += f", ETA {clock(p['eta_s'])}" if p["eta_s"] >= 1 else ", ETA any moment"
    if p.get("attempt"):
        text += f" (attempt {p['attempt']})"
    return text


def kv_usage(url: str) -> float | None:
    """vLLM's KV cache usage (0..1) from its Prometheus ``/metrics``; None when it does not answer."""
    from urllib.parse import urlsplit

    from r1sup.adapters import health

    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        return None
    status, body = health.Endpoint(parts.hostname, parts.port).request("/metrics", timeout=_LIVE_TIMEOUT_S)
    if status != 200:
        return None
    usage: float | None = None
    for line in body.decode("utf-8", "replace").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            usage = value if usage is None else max(usage, value)
    return usage


def serving_memory(d: dict[str, Any], alive: bool) -> tuple[float | None, str | None]:
    """GiB a live daemon's vLLM holds and how it was counted: on the GPUs by NVML; else vLLM's own
    account (status.json's ``memory_gib``: weights, KV cache, graphs), which a GPU engine reports even
    where this command cannot see its processes on the GPU (another PID namespace, no driver); only
    without either, the process tree's resident host memory (a GPU engine's host RSS is not its size)."""
    if not alive:
        return None, None
    child = d.get("child_pid")
    tree = _tree(child) if d.get("child_alive") and isinstance(child, int) else []
    gpu = _nvml_used({p.pid for p in tree}) if tree else 0
    if gpu:
        return round(gpu / 1024**3, 2), "GPU"
    if isinstance(d.get("memory_gib"), (int, float)) and not isinstance(d.get("memory_gib"), bool):
        return float(d["memory_gib"]), "vLLM's account"
    return _host_rss(tree) if tree else (None, None)


def _tree(child_pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(child_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _host_rss(tree: list[Any]) -> tuple[float | None, str | None]:
    import psutil

    rss = 0
    for proc in tree:
        try:
            rss += proc.memory_info().rss
        except psutil.Error:
            continue
    return (round(rss / 1024**3, 2), "host RSS") if rss else (None, None)


def _nvml_used(pids: set[int]) -> int:
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no GPU memory to count
        return 0
    used = 0
    try:
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if int(proc.pid) in pids:
                    used += int(getattr(proc, "usedGpuMemory", 0) or 0)
    except Exception:  # noqa: BLE001 - a half-answering driver counts as none
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return used


def _when(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return parse_iso(text)
    except ValueError:
        return None


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


def render(report: dict[str, Any], verbose: bool = False) -> str:
    lines: list[str] = []
    served = report.get("served") or []
    if served:
        lines += table(served, verbose)
        lines.append("")
    lines.append(f"state directory: {report['state_dir']}")
    if not report["exists"]:
        if os.path.lexists(report["state_dir"]):
            lines.append("  is not a directory: no profiles or daemon state can be there")
        else:
            lines.append("  does not exist: no profiles saved and no daemon has run with it")
        return "\n".join(lines) + "\n"
    lines += _render_daemon(report["daemon"])
    for instance in report.get("instances") or []:
        lines.append(f"instance {instance['state_dir']}:")
        lines += ["  " + line for line in _render_daemon(instance["daemon"])]
    profiles = report["profiles"]
    lines.append(f"profiles: {len(profiles) or 'none'}")
    for p in profiles:
        lines.append(f"  {p['key']}  {p['model']} (served as {p['served_name']})  updated {p['updated_at']}")
        lines.append(f"    flags: {flags_summary(p['flags'])}")
        lines.append(f"    probe: {probe_line(p['probe'], speed=not p.get('capacity'))}")
        if p.get("capacity"):
            lines.append(f"    capacity: {capacity_text(p['capacity'])}")
        lines.append(f"    box: {box_summary(p['fingerprint'])}")
        if p.get("imported"):
            lines.append(f"    imported from {p['imported'].get('from')} with differences")
    for item in report["unusable_files"]:
        lines.append(f"  unusable: {item['path']}: {item['reason']}")
    return "\n".join(lines) + "\n"


COLUMNS = ("MODEL", "URL", "CONTEXT", "REQUESTS", "TOKENS/S", "MEMORY", "UPTIME", "STATE")
# --verbose: these too, before UPTIME
VERBOSE_COLUMNS = ("KV TOKENS", "KV USE", "TTFT P50/P95", "LAUNCHES", "PROFILE")


def table(rows: list[dict[str, Any]], verbose: bool = False) -> list[str]:
    """The ``ollama ps``-like lines: a header and one line per served model. REQUESTS and TOKENS/S are
    what the load probe proved for the flags being served (requests that ran at once, output tokens
    per second at that concurrency)."""
    from r1sup.core.progress import clock

    head = list(COLUMNS)
    if verbose:
        head[6:6] = VERBOSE_COLUMNS
    cells: list[tuple[str, ...]] = [tuple(head)]
    for r in rows:
        memory = "-"
        if isinstance(r.get("memory_gib"), (int, float)):
            kind = r.get("memory_kind")
            gib = float(r["memory_gib"])
            memory = f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"
            memory += f" ({kind})" if kind and kind != "GPU" else ""
        state = str(r.get("state"))
        if r.get("progress"):
            state = f"{state}: {progress_text(r['progress'])}"
        elif r.get("reduced") and state == "serving":
            state += ", REDUCED: " + ("; ".join(r.get("reduced_because") or []) or "less than asked")
        tps = r.get("output_tokens_per_second")
        line = [
            str(r.get("model") or "?"),
            str(r.get("url") or "-"),
            _int(r.get("context")),
            _int(r.get("requests")),
            "-" if not isinstance(tps, (int, float)) else f"{tps:.1f}",
            memory,
            "-" if r.get("uptime_s") is None else clock(r["uptime_s"]),
            state,
        ]
        if verbose:
            line[6:6] = [
                _int(r.get("kv_cache_tokens"), grouped=True),
                "-" if r.get("kv_cache_usage") is None else f"{r['kv_cache_usage']:.0%}",
                _ttft(r.get("ttft_p50_s"), r.get("ttft_p95_s")),
                _int(r.get("launches")),
                str(r.get("profile_source") or "-"),
            ]
        cells.append(tuple(line))
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in cells
    ]


def _ttft(p50: Any, p95: Any) -> str:
    if not isinstance(p50, (int, float)):
        return "-"
    return f"{p50:.2f}/{p95:.2f}s" if isinstance(p95, (int, float)) else f"{p50:.2f}s"


def capacity_text(c: Any) -> str:
    """A stored capacity (a profile's, ``status.json``'s) as one line; anything else as it is."""
    capacity = Capacity.from_dict(c)
    return capacity.text() if capacity is not None else str(c)


def _int(value: Any, grouped: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{int(value):,}" if grouped else str(int(value))


def _render_daemon(d: dict[str, Any] | None) -> list[str]:
    if d is None:
        return ["daemon: no status file (not running, or never run with this state directory)"]
    if "problem" in d:
        return [f"daemon: status file unusable: {d['problem']}"]
    state = d.get("state", "?")
    if d["alive"]:
        head = f"daemon: {state}, pid {d.get('pid')} running"
    elif state == "stopped":
        head = f"daemon: stopped at {d.get('updated_at')} (pid {d.get('pid')} has exited)"
    elif state == "failed":
        head = f"daemon: failed at {d.get('updated_at')} (pid {d.get('pid')} has exited)"
    else:
        head = f"daemon: not running (stale status: last state {state}; {d['liveness']})"
    lines = [head]
    if d.get("status"):
        lines.append(f"  status: {d['status']}")
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
        ("config", "config"),
        ("updated", "updated_at"),
    ):
        if d.get(name) is not None:
            parts.append(f"{label} {d[name]}")
    if parts:
        lines.append("  " + ", ".join(parts))
    if isinstance(d.get("flags"), dict):
        lines.append(f"  flags: {flags_summary(d['flags'])}")
    if isinstance(d.get("capacity"), dict):
        lines.append(f"  capacity: {capacity_text(d['capacity'])}")
    failure = d.get("last_failure")
    if failure:
        lines.append(f"  last failure: {scalars(failure) if isinstance(failure, dict) else failure}")
    events = d.get("recent_events")
    if isinstance(events, list) and events:
        lines.append("  recent events:")
        for ev in events[-_EVENTS_SHOWN:]:
            if isinstance(ev, dict):
                if ev.get("event") == "state_changed" and ev.get("old") == ev.get("new"):
                    continue  # a status file written before such events were left out: no change
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
        known = [f"{name} {versions[name]}" for name in ("vllm", "torch") if versions.get(name)]
        unknown = [name for name in ("vllm", "torch") if not versions.get(name)]
        if unknown:
            known.append(f"{' and '.join(unknown)} version unknown")
        parts.append(", ".join(known))
    return "; ".join(parts) or "?"


# the probe's own bookkeeping (how its prompts were sized), kept in records for the next probe: no
# figure a reader of ``status`` asks for
_INTERNALS = ("sizing", "sizing_reused", "tokenize_calls", "prompt_tokens_estimated", "internal")


def probe_line(probe: Any, speed: bool = True) -> str:
    """A stored probe (a profile's) in words: ``4/4 ok at concurrency 4 (only 1 ran at once, 1 waited),
    prompts of 128,441 tokens, peak KV usage 63%, preemptions 0``; its TTFT and tokens/s (``speed``)
    only where no capacity line follows to give them. A record of another form: its fields, less
    the probe's internals."""
    if not isinstance(probe, dict) or not probe:
        return "no results recorded"
    if "ok" not in probe:  # a record from before the probe's result was typed
        return scalars(probe) or "no results recorded"
    from r1sup.core.probing import ProbeResult

    p = ProbeResult.from_dict(probe)
    if not p.ok:
        return f"failed: {p.error_count}/{p.requests} requests failed: {p.first_error or 'no detail'}"
    parts = [f"{p.succeeded}/{p.requests} ok at concurrency {p.concurrency}{p.queued_text()}"]
    if p.prompt_tokens:
        parts.append(f"prompts of {p.prompt_tokens:,} tokens")
    if speed and p.ttft_p50_s is not None:
        parts.append(f"TTFT p50 {p.ttft_p50_s:.2f}s" + (f" p95 {p.ttft_p95_s:.2f}s" if p.ttft_p95_s else ""))
    if speed and p.output_tokens_per_s is not None:
        parts.append(f"{p.output_tokens_per_s:.1f} output tok/s")
    if p.peak_kv_usage is not None:
        parts.append(f"peak KV usage {p.peak_kv_usage:.0%}")
    if p.preemptions is not None:
        parts.append(f"preemptions {p.preemptions}")
    if p.wave is not None and p.wave.skipped:
        parts.append(f"no concurrency wave ({p.wave.skipped})")
    elif p.wave is not None and p.wave.concurrency_proven is not None:
        parts.append(f"wave: {p.wave.concurrency_proven} of {p.wave.sent} ran at once")
    return ", ".join(parts)


def scalars(d: dict[str, Any], limit: int = 12) -> str:
    """``k=v`` pairs of a dict, less the probe's internals; nested values as compact JSON."""
    out = []
    for k, v in [(k, v) for k, v in d.items() if k not in _INTERNALS][:limit]:
        if v is None:
            continue
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"), default=str)
        out.append(f"{k}={text if len(text) <= 80 else text[:77] + '...'}")
    return " ".join(out)
