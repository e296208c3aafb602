"""Probe the machine: NVML (``pynvml`` from nvidia-ml-py) when a driver answers, else the CPU backend's view.

Never raises for a missing or broken driver: :func:`probe` then returns ``backend="cpu"`` with the
memory vLLM's CPU backend sizes against (NUMA node 0 from ``/sys/devices/system/node/node0/meminfo``,
clamped to the cgroup limit, as vllm/utils/cpu_resource_utils.py does), or psutil's host memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil

from r1sup.core import catalog
from r1sup.core.errors import ConfigError
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo, ProcessUse

NODE0_MEMINFO = Path("/sys/devices/system/node/node0/meminfo")
CGROUP_V2_MAX = Path("/sys/fs/cgroup/memory.max")
CGROUP_V2_CURRENT = Path("/sys/fs/cgroup/memory.current")
CGROUP_V1_LIMIT = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
CGROUP_V1_USAGE = Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")


class _NoDriver(Exception):
    """NVML is not usable here (library missing, no driver, no device)."""


# --- NVML --------------------------------------------------------------------------------------


@contextmanager
def _nvml() -> Iterator[Any]:
    try:
        import pynvml
    except ImportError as exc:
        raise _NoDriver(f"pynvml is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise _NoDriver(f"NVML: {exc}") from None
    try:
        yield pynvml
    finally:
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _visible_indices(nv: Any, count: int, cuda_visible_devices: str | None) -> list[int]:
    """Physical indices named by CUDA_VISIBLE_DEVICES (indices or GPU-UUIDs); all when unset."""
    if cuda_visible_devices is None:
        return list(range(count))
    wanted = [item.strip() for item in cuda_visible_devices.split(",") if item.strip()]
    indices: list[int] = []
    for item in wanted:
        if item.lstrip("-").isdigit():
            index = int(item)
            if index < 0 or index >= count:
                break  # CUDA stops at the first invalid entry
            indices.append(index)
            continue
        match = None
        for index in range(count):
            uuid = _text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(index)))
            if uuid == item or uuid.startswith(item):
                match = index
                break
        if match is None:
            break
        indices.append(match)
    return indices


def _memory(nv: Any, handle: Any) -> tuple[int, int]:
    """(total, free) bytes; total without the driver's reserved part when NVML v2 reports it.

    CUDA's total (what vLLM multiplies by the utilization) excludes that reserved memory.
    """
    try:
        info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
        total = int(info.total) - int(getattr(info, "reserved", 0) or 0)
        return total, int(info.free)
    except (nv.NVMLError, AttributeError, TypeError):
        info = nv.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.free)


def _processes(nv: Any, handle: Any, gpu_index: int) -> list[ProcessUse]:
    try:
        running = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except nv.NVMLError:
        return []
    out: list[ProcessUse] = []
    for proc in running:
        pid = int(proc.pid)
        used = getattr(proc, "usedGpuMemory", None)
        name = _process_name(nv, pid)
        out.append(ProcessUse(pid=pid, name=name, used_bytes=int(used or 0), gpu_index=gpu_index))
    return out


def _process_name(nv: Any, pid: int) -> str:
    try:
        return _text(nv.nvmlSystemGetProcessName(pid))
    except nv.NVMLError:
        pass
    try:
        return str(psutil.Process(pid).name())
    except psutil.Error:
        return f"pid {pid}"


def _probe_nvml(cuda_visible_devices: str | None) -> DeviceFacts:
    with _nvml() as nv:
        try:
            count = int(nv.nvmlDeviceGetCount())
            if count == 0:
                raise _NoDriver("NVML found no GPU")
            driver = _text(nv.nvmlSystemGetDriverVersion())
            gpus: list[GpuInfo] = []
            processes: list[ProcessUse] = []
            for index in _visible_indices(nv, count, cuda_visible_devices):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                total, free = _memory(nv, handle)
                try:
                    major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
                    cc: tuple[int, int] | None = (int(major), int(minor))
                except nv.NVMLError:
                    cc = None
                try:
                    uuid: str | None = _text(nv.nvmlDeviceGetUUID(handle))
                except nv.NVMLError:
                    uuid = None
                gpus.append(GpuInfo(index, _text(nv.nvmlDeviceGetName(handle)), total, free, cc, uuid))
                processes += _processes(nv, handle, index)
        except nv.NVMLError as exc:
            raise _NoDriver(f"NVML: {exc}") from None
    if not gpus:
        raise _NoDriver(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU")
    total, available = host_memory()
    return DeviceFacts(
        backend="cuda",
        gpus=tuple(gpus),
        machine_memory_bytes=int(psutil.virtual_memory().total),
        driver=driver,
        cpu_model=cpu_model(),
        host_total_bytes=total,
        host_available_bytes=available,
        processes=tuple(processes),
        source="probe",
    )


# --- host memory (the CPU backend's view) ------------------------------------------------------


def parse_node_meminfo(text: str) -> tuple[int, int]:
    """(total, available) bytes from a NUMA node's meminfo, the way vLLM's CPU backend reads it:
    available = MemFree + Active(file) + Inactive(file) + SReclaimable."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        # "Node 0 MemTotal:  9005272 kB"
        if len(parts) >= 4 and parts[0] == "Node":
            try:
                values[parts[2].rstrip(":")] = int(parts[3]) * 1024
            except ValueError:
                continue
    if "MemTotal" not in values:
        raise ValueError("no MemTotal line")
    available = sum(values.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
    return values["MemTotal"], available


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_limit_and_usage() -> tuple[int | None, int | None]:
    limit = _read_int(CGROUP_V2_MAX)
    if limit is not None:
        return limit, _read_int(CGROUP_V2_CURRENT)
    limit = _read_int(CGROUP_V1_LIMIT)
    if limit is not None and limit < (1 << 62):
        return limit, _read_int(CGROUP_V1_USAGE)
    return None, None


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of NUMA node 0 (cgroup-clamped), or psutil's host figures."""
    try:
        total, available = parse_node_meminfo(NODE0_MEMINFO.read_text())
    except (OSError, ValueError):
        vm = psutil.virtual_memory()
        total, available = int(vm.total), int(vm.available)
    limit, usage = _cgroup_limit_and_usage()
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (usage or 0)))
    return total, available


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU feature flags of the first processor (``avx512f``, ``amx_tile``...), None if unreadable."""
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def _probe_cpu(reason: str) -> DeviceFacts:
    total, available = host_memory()
    return DeviceFacts(
        backend="cpu",
        cpu_flags=cpu_flags(),
        machine_memory_bytes=int(psutil.virtual_memory().total),
        cpu_model=cpu_model(),
        host_total_bytes=total,
        host_available_bytes=available,
        source="probe",
        notes=(
            f"no NVIDIA GPU ({reason}); the CPU backend's view: NUMA node 0 has "
            f"{available / GIB:.2f}/{total / GIB:.2f} GiB available",
        ),
    )


# --- public API --------------------------------------------------------------------------------


def probe(cuda_visible_devices: str | None = None) -> DeviceFacts:
    """The GPUs NVML sees (honouring CUDA_VISIBLE_DEVICES), else the CPU backend's view. Never raises
    for a missing driver. ``cuda_visible_devices`` None: take it from the environment."""
    visible = cuda_visible_devices
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        return _probe_nvml(visible)
    except _NoDriver as exc:
        return _probe_cpu(str(exc))


def from_catalog(name: str, count: int = 1) -> DeviceFacts:
    """A device from the GPU catalog (``--gpu NAME``); unknown names are a ConfigError."""
    found = catalog.find_gpu(name)
    if found is None:
        raise ConfigError("--gpu", catalog.unknown_gpu_message(name))
    canonical, info = found
    total = int(info.total_gib * GIB)
    gpus = tuple(GpuInfo(i, canonical, total, total, info.compute_capability) for i in range(count))
    notes: tuple[str, ...] = ()
    if info.platform == "rocm":
        notes = (
            f"{canonical} is an AMD GPU: vLLM's ROCm build, whose memory accounting (through torch's HIP "
            "backend) is the one planned here",
        )
    return DeviceFacts(backend="cuda", gpus=gpus, source="catalog", notes=notes)


def from_memory(gib: float, count: int = 1, name: str = "custom") -> DeviceFacts:
    """A device of ``gib`` GiB per GPU (``--gpu-memory-gib``), compute capability unknown."""
    if not gib > 0:
        raise ConfigError("--gpu-memory-gib", f"must be a positive number of GiB, got {gib}")
    total = int(gib * GIB)
    gpus = tuple(GpuInfo(i, name, total, total, None) for i in range(count))
    return DeviceFacts(backend="cuda", gpus=gpus, source="manual")


def gpu_processes() -> list[ProcessUse]:
    """Processes holding GPU memory ([] without a driver)."""
    try:
        with _nvml() as nv:
            try:
                out: list[ProcessUse] = []
                for index in range(int(nv.nvmlDeviceGetCount())):
                    out += _processes(nv, nv.nvmlDeviceGetHandleByIndex(index), index)
                return out
            except nv.NVMLError:
                return []
    except _NoDriver:
        return []
