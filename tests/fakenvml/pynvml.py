"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) that reports the fake engine's simulated GPUs.

Put ``tests/fakenvml`` first on ``PYTHONPATH`` of an r1sup process and set ``FAKE_VLLM_SCENARIO`` (or
``FAKE_VLLM_SCENARIO_FILE``) the way the fake engine reads it: r1sup's device probe then sees the
scenario's GPUs (name, total memory, compute capability, count), the memory other processes hold,
and the memory live fake engines record in the scenario's ``gpu_lock_dir``. Only the calls r1sup
makes are implemented. It lives with the tests, never in the installed package.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for fakevllm

from fakevllm.scenario import scenario_from_env  # noqa: E402

GIB = 1024**3
OTHER_PID = 1  # the "other process" of a busy-GPU scenario, reported under a name of its own
nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    pass


_state: dict[str, Any] = {}


def _scenario() -> Any:
    return scenario_from_env(os.environ)


def nvmlInit() -> None:
    _state["scenario"] = _scenario()


def nvmlShutdown() -> None:
    _state.pop("scenario", None)


def _sc() -> Any:
    if "scenario" not in _state:
        raise NVMLError("NVML not initialized")
    return _state["scenario"]


def nvmlSystemGetDriverVersion() -> str:
    return "999.99-fake"


def nvmlDeviceGetCount() -> int:
    return int(_sc().gpu.count)


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if not 0 <= index < nvmlDeviceGetCount():
        raise NVMLError(f"invalid index {index}")
    return index


def nvmlDeviceGetName(handle: int) -> str:
    return str(_sc().gpu.name)


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-fake-{handle:04d}"


def nvmlDeviceGetCudaComputeCapability(handle: int) -> tuple[int, int]:
    major, minor = _sc().gpu.compute_capability
    return int(major), int(minor)


def _others(handle: int) -> float:
    values = tuple(_sc().gpu.other_process_gib)
    return float(values[handle] if handle < len(values) else values[-1])


def _recorded(handle: int) -> list[tuple[int, float]]:
    """(pid, GiB) of live fake engines holding memory on this GPU."""
    lock_dir = _sc().gpu_lock_dir
    out: list[tuple[int, float]] = []
    if not lock_dir or not os.path.isdir(lock_dir):
        return out
    for name in sorted(os.listdir(lock_dir)):
        if not name.endswith(".json"):
            continue
        try:
            rec = json.loads(Path(lock_dir, name).read_text(encoding="utf-8"))
            pid = int(rec["pid"])
            os.kill(pid, 0)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if handle in [int(g) for g in rec.get("gpus", [])]:
            out.append((pid, float(rec.get("gib", 0.0))))
    return out


def nvmlDeviceGetMemoryInfo(handle: int, version: int | None = None) -> Any:
    total = int(_sc().gpu.total_gib * GIB)
    used = int((_others(handle) + sum(g for _, g in _recorded(handle))) * GIB)
    return SimpleNamespace(total=total, free=max(0, total - used), used=used, reserved=0)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[Any]:
    procs = [SimpleNamespace(pid=pid, usedGpuMemory=int(g * GIB)) for pid, g in _recorded(handle)]
    if _others(handle) > 0:
        procs.append(SimpleNamespace(pid=OTHER_PID, usedGpuMemory=int(_others(handle) * GIB)))
    return procs


def nvmlSystemGetProcessName(pid: int) -> str:
    if pid == OTHER_PID:
        return "other-gpu-job"
    raise NVMLError("not found")
