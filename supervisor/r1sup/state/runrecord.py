"""Run records: what one ``tune`` or ``run`` did, attempt by attempt, for ``r1sup report``.

A record is written to ``<state dir>/runs/<UTC stamp>-<command>-<pid>.json`` (0600, atomic) when the
search starts and again after each attempt, so a report can be made while a daemon still runs or
after a tune that found nothing (such a tune saves no profile). It holds the box as probed, the
target, every attempt (its flags, what changed and why, the outcome and root cause, the seconds of
each loading phase, and the memory per GPU predicted and measured) and the final result. Only the
newest :data:`KEEP` records are kept.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from r1sup import __version__
from r1sup.adapters.logs import get_logger, mask_value
from r1sup.adapters.statefiles import (
    SCHEMA_VERSION,
    atomic_write_json,
    ensure_state_dir,
    ensure_subdir,
    inspect_json,
    utc_name_stamp,
    utc_now_iso,
)
from r1sup.core import capacity
from r1sup.core import memchart as M
from r1sup.core.figures import Figures
from r1sup.core.hardware import GIB

RUNS_SUBDIR = "runs"
KEEP = 20
RETRY_S = 10.0  # after a failed save, the next one this much later tries again
_NAME_RE = re.compile(r"^(?P<id>\d{8}T\d{6}Z-(?:tune|run)-\d+)\.json$")
# profile fingerprint parts that must match for another profile's phase timings to predict this launch
TIMING_KEYS = ("backend", "gpu", "cpu", "versions", "model")


class RunLog:
    """The record of this process's search(es); rewritten after every attempt. Never raises: a state
    directory that cannot be written costs the report, not the run (logged once)."""

    def __init__(self, state_dir: str | os.PathLike[str], command: str, config: Any, device: Any) -> None:
        self.id = f"{utc_name_stamp()}-{command}-{os.getpid()}"
        self.state_dir = Path(state_dir)
        self.path: Path | None = None
        self._failed = False
        self._failed_at = 0.0  # monotonic: when the last save failed
        server = config.server
        self.data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "id": self.id,
            "command": command,
            "pid": os.getpid(),
            "started_at": utc_now_iso(),
            "updated_at": utc_now_iso(),
            "finished_at": None,
            "r1sup_version": __version__,
            "config": os.path.abspath(config.source) if getattr(config, "source", None) else None,
            "model": config.model.name,
            "served_name": config.served_name,
            "url": _url(server.host, server.port),
            "target": {"concurrency": config.target.concurrency, "context": config.target.context},
            "asked": capacity.asked(config).to_dict(),  # what the capacity the probe proves is held against
            "device": device_summary(device),
            "attempts": [],
            "result": None,
        }

    def attempt(self, attempt: Mapping[str, Any]) -> None:
        """Add one finished attempt (numbered across the searches of this process) and save."""
        attempts: list[dict[str, Any]] = self.data["attempts"]
        attempts.append({**attempt, "launch": len(attempts) + 1})
        self.save()

    def finish(self, result: Mapping[str, Any], *, final: bool = True) -> None:
        """The outcome of a search (``final``: the process is done with it)."""
        self.data["result"] = {k: v for k, v in result.items() if k != "attempts"}
        if final:
            self.data["finished_at"] = utc_now_iso()
        self.save()

    def stopped(self, state: str) -> None:
        """The process is done (a run stopped or failed)."""
        self.data["finished_at"] = utc_now_iso()
        self.data["final_state"] = state
        self.save()

    def device(self, device: Any) -> None:
        self.data["device"] = device_summary(device)

    def save(self) -> Path | None:
        """Write the record. A failure (a full disk) is logged once; the next save at least
        ``RETRY_S`` later tries again, so the record comes back when the disk does."""
        now = time.monotonic()
        if self._failed and now - self._failed_at < RETRY_S:
            return None
        self.data["updated_at"] = utc_now_iso()
        try:
            if self.path is None:
                runs = ensure_subdir(ensure_state_dir(self.state_dir), RUNS_SUBDIR)
                self.path = runs / f"{self.id}.json"
                prune(runs, keep=KEEP - 1)
            atomic_write_json(self.path, mask_value(self.data))  # secrets vLLM may have echoed
        except Exception as exc:  # noqa: BLE001 - a report is never worth a failed run (StateWriteError, OSError)
            if not self._failed:
                get_logger().warning("run_record_not_saved", error=f"{type(exc).__name__}: {exc}")
            self._failed, self._failed_at = True, now
            return None
        if self._failed:
            self._failed = False
            get_logger().info("run_record_saved_again", path=str(self.path))
        return self.path


# --- reading -------------------------------------------------------------------------------------


def run_files(state_dir: str | os.PathLike[str]) -> list[Path]:
    """The run records in a state directory, newest first ([] when there are none)."""
    directory = Path(state_dir) / RUNS_SUBDIR
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [directory / n for n in sorted((n for n in names if _NAME_RE.match(n)), reverse=True)]


def load(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """A record (read-only: an unusable file is reported, not moved), or None and why, in one line:
    the first field of a type or range r1sup never writes (:func:`problem`)."""
    data, problem = inspect_json(path, finite=True)
    if data is not None and not isinstance(data.get("attempts"), list):
        return None, "no attempts list"
    if data is not None:
        wrong = problem_of(data)
        if wrong is not None:
            return None, wrong
    return data, problem


# What a report reads of a record, by type: a value of another type (or out of range) sets the record
# aside with one line naming the field; fields not named here are shown as text, whatever they hold.
_NUMBER = (int, float)
_LIMIT = 2**53  # any count, size or second r1sup writes is far below it
_TOP: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "command": (str,),
    "model": (str,),
    "served_name": (str,),
    "finished_at": (str,),
    "final_state": (str,),
    "target": (dict,),
    "asked": (dict,),
    "device": (dict,),
    "result": (dict,),
}
_ATTEMPT: dict[str, tuple[type, ...]] = {
    "launch": (int,),
    "number": (int,),
    "outcome": (str,),
    "seconds": _NUMBER,
    "flags": (dict,),
    "phase_seconds": (dict,),
    "memory": (list,),
}
_RESULT: dict[str, tuple[type, ...]] = {
    "ok": (bool,),
    "launches": (int,),
    "flags": (dict,),
    "probe": (dict,),
    "observations": (dict,),
    "costs": (list,),
    "command": (list,),
    "suggestions": (list,),
    "reduced": (dict, bool),
}
_DEVICE: dict[str, tuple[type, ...]] = {"gpus": (list,), "processes": (list,)}
_GPU: dict[str, tuple[type, ...]] = {"total_gib": _NUMBER, "free_gib": _NUMBER}


def problem_of(record: Mapping[str, Any]) -> str | None:
    """Why ``record`` cannot be reported (``attempts[2].flags.max_num_seqs: a str, not int``), or None.
    Every field the report computes with is checked for its type, and a number for its range."""
    wrong = _fields("", record, _TOP)
    for i, attempt in enumerate(record.get("attempts") or []):
        wrong = wrong or _fields(f"attempts[{i}].", attempt, _ATTEMPT)
        if wrong is None and isinstance(attempt.get("flags"), dict):
            wrong = _flags(f"attempts[{i}].flags", attempt["flags"])
        if wrong is None:
            wrong = _items(f"attempts[{i}].memory", attempt.get("memory"), {})
    result, device = record.get("result"), record.get("device")
    if wrong is None and isinstance(result, dict):
        wrong = _fields("result.", result, _RESULT)
        if wrong is None and isinstance(result.get("flags"), dict):
            wrong = _flags("result.flags", result["flags"])
    if wrong is None and isinstance(device, dict):
        wrong = _fields("device.", device, _DEVICE)
        wrong = wrong or _items("device.gpus", device.get("gpus"), _GPU)
        wrong = wrong or _items("device.processes", device.get("processes"), {})
    return wrong


def _fields(prefix: str, obj: Any, types: Mapping[str, tuple[type, ...]]) -> str | None:
    if not isinstance(obj, dict):
        return f"{prefix.rstrip('.')}: {_kind(obj)}, not an object"
    for name, allowed in types.items():
        value = obj.get(name)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            return f"{prefix}{name}: {_kind(value)}, not {' or '.join(t.__name__ for t in allowed)}"
        if isinstance(value, _NUMBER) and not isinstance(value, bool) and not -_LIMIT < value < _LIMIT:
            return f"{prefix}{name}: {value:.3g} is out of range"
    return None


def _items(where: str, items: Any, types: Mapping[str, tuple[type, ...]]) -> str | None:
    for i, item in enumerate(items or []):
        wrong = _fields(f"{where}[{i}].", item, types)
        if wrong is not None:
            return wrong
    return None


def _flags(where: str, flags: dict[str, Any]) -> str | None:
    """Engine flags as :class:`EngineFlags` holds them: known names, each of its type and in range."""
    from r1sup.core.flags import EngineFlags

    hints = {f.name: str(f.type) for f in dataclasses.fields(EngineFlags)}
    for name, value in flags.items():
        if name not in hints:
            return f"{where}: unknown flag {name[:40]!r}"
        hint = hints[name]
        if value is None and "None" in hint:
            continue
        allowed: tuple[type, ...] = (
            (bool,) if "bool" in hint else _NUMBER if "float" in hint else (int,) if "int" in hint else (str,)
        )
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            return f"{where}.{name}: {_kind(value)}, not {hint.replace(' | None', '')}"
        if isinstance(value, _NUMBER) and not isinstance(value, bool) and not 0 <= value < _LIMIT:
            return f"{where}.{name}: {value:.3g} is out of range"
    return None


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def prune(directory: Path, keep: int) -> None:
    files = sorted((n for n in os.listdir(directory) if _NAME_RE.match(n)), reverse=True)
    for name in files[keep:]:
        try:
            os.unlink(directory / name)
        except OSError:
            continue


# --- what goes into a record ----------------------------------------------------------------------


def device_summary(device: Any) -> dict[str, Any] | None:
    """The box as probed: GPUs (name, total and free GiB), or the CPU backend's node; other processes."""
    if device is None:
        return None
    out: dict[str, Any] = {"backend": device.backend, "source": getattr(device, "source", None)}
    out["gpus"] = [
        {
            "index": g.index,
            "name": g.name,
            "total_gib": round(g.total_bytes / GIB, 2),
            "free_gib": round(g.free_bytes / GIB, 2),
        }
        for g in device.gpus
    ]
    if not device.gpus:
        out["cpu_model"] = device.cpu_model
        out["host_total_gib"] = round(device.host_total_bytes / GIB, 2)
        out["host_available_gib"] = round(device.host_available_bytes / GIB, 2)
    out["processes"] = [
        {"pid": p.pid, "name": p.name, "used_gib": round(p.used_bytes / GIB, 2), "gpu": p.gpu_index}
        for p in device.processes
    ]
    return out


def attempt_memory(know: Any, flags: Any, config: Any, figures: Figures) -> list[dict[str, Any]]:
    """The memory of each device this attempt used: predicted (the planner, for these flags on the box
    as probed before the launch) and measured (what vLLM printed), as plain dicts for the record."""
    from r1sup.core.knowledge import plan_for

    device = know.device
    if device is None:
        return []
    predicted: M.Breakdown | None = None
    plan = plan_for(config, know, flags)
    if plan is not None:
        predicted = M.from_planner(plan.breakdown)
    charts: list[dict[str, Any]] = []
    if not device.gpus:
        total = device.host_total_bytes / GIB
        measured = M.from_figures(figures, total_gib=total)
        title = f"CPU backend, NUMA node 0 ({total:.2f} GiB)"
        charts.append(_chart(title, predicted, measured))
        return charts
    used = device.gpus[: max(1, getattr(flags, "tensor_parallel_size", 1) or 1)]
    for gpu in used:
        total, free = gpu.total_bytes / GIB, gpu.free_bytes / GIB
        mine = predicted
        if predicted is not None:
            mine = dataclasses.replace(predicted, total_gib=total, other_gib=max(0.0, total - free))
        measured = M.from_figures(figures, total_gib=total, free_gib=free)
        charts.append(_chart(f"GPU {gpu.index} ({gpu.name}, {total:.2f} GiB)", mine, measured))
    return charts


def charts_of(attempt: Mapping[str, Any]) -> list[M.GpuChart]:
    """An attempt record's memory as charts (what a report draws)."""
    out: list[M.GpuChart] = []
    for item in attempt.get("memory") or []:
        if not isinstance(item, Mapping):
            continue
        pred = item.get("predicted")
        meas = item.get("measured")
        out.append(
            M.GpuChart(
                title=str(item.get("title", "")),
                predicted=M.Breakdown.from_dict(pred) if isinstance(pred, Mapping) else None,
                measured=M.Breakdown.from_dict(meas) if isinstance(meas, Mapping) else None,
            )
        )
    return out


def _chart(title: str, predicted: M.Breakdown | None, measured: M.Breakdown | None) -> dict[str, Any]:
    return {
        "title": title,
        "predicted": predicted.to_dict() if predicted else None,
        "measured": measured.to_dict() if measured else None,
    }


def expected_phases(store: Any, fingerprint: Mapping[str, Any]) -> dict[str, float]:
    """Seconds per loading phase from the profile of this box and config, else from the newest profile
    of the same model on the same box and engine versions: what an ETA is computed from."""
    from r1sup.core.progress import expected_timings
    from r1sup.state.profiles import fingerprint_key

    lists: list[list[dict[str, Any]]] = []
    try:
        exact = store.load(fingerprint_key(dict(fingerprint)))
        if exact is not None:
            lists.append(exact.attempts)
        for profile, _ in store.near_misses(dict(fingerprint)):
            if all(profile.fingerprint.get(k) == fingerprint.get(k) for k in TIMING_KEYS):
                lists.append(profile.attempts)
    except Exception:  # noqa: BLE001 - no ETA is better than no launch
        return {}
    return expected_timings(lists)


def _url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"
