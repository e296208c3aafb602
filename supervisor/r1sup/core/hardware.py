"""Facts about the machine vLLM runs on, as plain values (the probing code lives in devices.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int] | None = None
    uuid: str | None = None

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def free_gib(self) -> float:
        return self.free_bytes / GIB


@dataclass(frozen=True)
class ProcessUse:
    """A process holding device memory (from NVML), for messages and leftover clean-up."""

    pid: int
    name: str
    used_bytes: int
    gpu_index: int


@dataclass(frozen=True)
class DeviceFacts:
    """What the planner, the search and the fingerprint need to know about the box.

    ``backend`` is ``"cuda"`` when NVML answered, else ``"cpu"`` (vLLM's CPU backend: memory means
    host memory of the NUMA node, utilization a fraction of it).
    """

    backend: str
    gpus: tuple[GpuInfo, ...] = ()
    driver: str | None = None
    cpu_model: str | None = None
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    processes: tuple[ProcessUse, ...] = ()
    source: str = "probe"  # probe (NVML/psutil), catalog (--gpu NAME), manual (--gpu-memory-gib)
    notes: tuple[str, ...] = field(default_factory=tuple)
    cpu_flags: frozenset[str] | None = None  # /proc/cpuinfo flags on the CPU backend; None: unknown
    machine_memory_bytes: int = 0  # the machine's RAM (stable), for fingerprints; host_* is NUMA node 0

    @property
    def fp8_kv_supported(self) -> bool | None:
        """Whether vLLM can keep the KV cache in fp8 here (None: unknown, assume yes).

        CUDA: from compute capability 8.0 (e4m3 from 8.9, e5m2 below). vLLM's CPU backend needs x86
        with AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py: "FP8 KV cache on CPU requires
        x86 with AVX-512 or AMX").
        """
        if self.backend == "cpu":
            if self.cpu_flags is None:
                return None
            return bool({"avx512f", "amx_tile"} & self.cpu_flags)
        cc = self.compute_capability
        return None if cc is None else cc >= (8, 0)

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def total_bytes(self) -> int:
        """Memory of one device: the first GPU's, or the host's on the CPU backend."""
        return self.gpus[0].total_bytes if self.gpus else self.host_total_bytes

    @property
    def free_bytes(self) -> int:
        """Free memory of the most loaded device (the one that limits a launch)."""
        if self.gpus:
            return min(g.free_bytes for g in self.gpus)
        return self.host_available_bytes

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        caps = [g.compute_capability for g in self.gpus if g.compute_capability]
        return min(caps) if caps else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "total_bytes": g.total_bytes,
                    "free_bytes": g.free_bytes,
                    "compute_capability": list(g.compute_capability) if g.compute_capability else None,
                }
                for g in self.gpus
            ],
            "driver": self.driver,
            "cpu_model": self.cpu_model,
            "host_total_bytes": self.host_total_bytes,
            "host_available_bytes": self.host_available_bytes,
            "processes": [vars(p) for p in self.processes],
            "source": self.source,
        }


@dataclass(frozen=True)
class Conditions:
    """What the box looked like when a profile was found or checked (:func:`r1sup.core.search.conditions`):
    free and total memory of the most loaded GPU and the memory other processes held on it (GiB, 2
    decimals), and who those were. ``degraded``: why a profile found under these conditions is worse than
    what the box gives without the other processes ("" when it is not); such a profile is kept beside the
    best one, and the daemon watches for the memory to come back.

    A profile keeps them as its ``conditions`` object (:meth:`to_dict`); nothing reads that object back
    into r1sup's decisions, so there is no ``from_dict``."""

    free_gib: float
    total_gib: float
    others_gib: float
    holders: tuple[str, ...] = ()
    degraded: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The profile's ``conditions`` and the fields of ``profile_does_not_fit_now``: ``degraded`` is
        written as ``degraded: true`` with its ``reason``, as profiles have always held it."""
        out: dict[str, Any] = {
            "free_gib": self.free_gib,
            "total_gib": self.total_gib,
            "others_gib": self.others_gib,
            "holders": list(self.holders),
        }
        if self.degraded:
            out.update(degraded=True, reason=self.degraded)
        return out
