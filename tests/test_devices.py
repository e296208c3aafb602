"""Device probing: NVML when it answers (a fake pynvml here), the CPU backend's view otherwise."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from r1sup.adapters import devices
from r1sup.core import catalog
from r1sup.core.errors import ConfigError
from r1sup.core.hardware import GIB

# --- a fake pynvml -----------------------------------------------------------------------------


class FakeNVMLError(Exception):
    def __init__(self, value: int = 999) -> None:
        self.value = value
        super().__init__(f"NVML error {value}")


@dataclass
class FakeGpu:
    name: str
    total: int
    reserved: int
    free: int
    cc: tuple[int, int]
    uuid: str
    procs: list[tuple[int, int | None]]


@dataclass
class Mem:
    total: int
    free: int
    used: int
    reserved: int = 0
    version: int = 0


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - NVML's field name


def fake_pynvml(gpus: list[FakeGpu], fail_on: str | None = None, v2: bool = True) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    calls: list[str] = []

    def call(name: str) -> None:
        calls.append(name)
        if name == fail_on:
            raise FakeNVMLError(3)

    def init() -> None:
        call("init")

    def shutdown() -> None:
        call("shutdown")

    def count() -> int:
        call("count")
        return len(gpus)

    def handle(index: int) -> FakeGpu:
        call("handle")
        return gpus[index]

    def memory(h: FakeGpu, version: int | None = None) -> Mem:
        call("memory")
        if version:
            if not v2:
                raise FakeNVMLError(13)  # NVML_ERROR_FUNCTION_NOT_FOUND
            return Mem(h.total, h.free, h.total - h.free - h.reserved, h.reserved, version)
        return Mem(h.total, h.free, h.total - h.free)

    def processes(h: FakeGpu) -> list[Proc]:
        call("processes")
        return [Proc(pid, used) for pid, used in h.procs]

    def process_name(pid: int) -> bytes:
        call("process_name")
        return f"/usr/bin/proc{pid}".encode()

    nv.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    nv.nvmlMemory_v2 = 0x02000028  # type: ignore[attr-defined]
    nv.nvmlInit = init  # type: ignore[attr-defined]
    nv.nvmlShutdown = shutdown  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    nv.nvmlDeviceGetName = lambda h: h.name.encode()  # type: ignore[attr-defined]
    nv.nvmlDeviceGetUUID = lambda h: h.uuid  # type: ignore[attr-defined]
    nv.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: h.cc  # type: ignore[attr-defined]
    nv.nvmlDeviceGetComputeRunningProcesses = processes  # type: ignore[attr-defined]
    nv.nvmlSystemGetProcessName = process_name  # type: ignore[attr-defined]
    nv.nvmlSystemGetDriverVersion = lambda: "550.54.15"  # type: ignore[attr-defined]
    nv.calls = calls  # type: ignore[attr-defined]
    return nv


TWO_GPUS = [
    FakeGpu(
        "NVIDIA GeForce RTX 4090", 24 * GIB, GIB // 2, 20 * GIB, (8, 9), "GPU-aaaa-1111", [(4242, 3 * GIB)]
    ),
    FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, GIB // 2, 79 * GIB, (9, 0), "GPU-bbbb-2222", [(77, None)]),
]


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """pynvml imports but nvmlInit fails, as on a machine without the NVIDIA driver."""
    nv = fake_pynvml([], fail_on="init")
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


# --- probing without a driver --------------------------------------------------------------------


def test_probe_on_this_machine_never_raises() -> None:
    facts = devices.probe()
    assert facts.backend in ("cpu", "cuda")
    if facts.backend == "cpu":
        assert facts.gpus == () and facts.host_total_bytes > 0
        assert facts.notes and "CPU backend" in facts.notes[0]


def test_probe_falls_back_to_cpu_when_nvml_raises(no_driver: types.ModuleType) -> None:
    facts = devices.probe()
    assert facts.backend == "cpu"
    assert facts.gpus == ()
    assert facts.host_total_bytes > 0 and 0 < facts.host_available_bytes <= facts.host_total_bytes
    assert "NVML" in facts.notes[0]
    assert no_driver.calls == ["init"]  # type: ignore[attr-defined]


def test_probe_falls_back_when_pynvml_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    facts = devices.probe()
    assert facts.backend == "cpu" and "pynvml" in facts.notes[0]


@pytest.mark.parametrize(
    ("step", "backend"),
    [("count", "cpu"), ("handle", "cpu"), ("memory", "cpu"), ("processes", "cuda"), ("process_name", "cuda")],
)
def test_an_nvml_error_midway_still_gives_a_clean_answer(
    monkeypatch: pytest.MonkeyPatch, step: str, backend: str
) -> None:
    nv = fake_pynvml(TWO_GPUS, fail_on=step)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    facts = devices.probe(cuda_visible_devices="0")
    assert facts.backend == backend
    if backend == "cpu":
        assert "NVML" in facts.notes[0]
    else:
        assert facts.gpus[0].name == "NVIDIA GeForce RTX 4090"
    assert nv.calls[-1] == "shutdown"  # type: ignore[attr-defined]


def test_no_driver_helpers(no_driver: types.ModuleType) -> None:
    assert devices.gpu_processes() == []


# --- probing with NVML -------------------------------------------------------------------------


def test_probe_reads_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(TWO_GPUS))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts = devices.probe()
    assert facts.backend == "cuda" and facts.count == 2
    first, second = facts.gpus
    assert first.name == "NVIDIA GeForce RTX 4090"
    assert first.total_bytes == 24 * GIB - GIB // 2  # NVML v2: the driver's reserved part is not usable
    assert first.free_bytes == 20 * GIB
    assert first.compute_capability == (8, 9) and second.compute_capability == (9, 0)
    assert first.uuid == "GPU-aaaa-1111"
    assert facts.driver == "550.54.15"
    assert facts.compute_capability == (8, 9)  # the weakest card
    assert facts.free_bytes == 20 * GIB
    assert [(p.pid, p.name, p.used_bytes, p.gpu_index) for p in facts.processes] == [
        (4242, "/usr/bin/proc4242", 3 * GIB, 0),
        (77, "/usr/bin/proc77", 0, 1),
    ]
    assert catalog.find_gpu(first.name) is not None and catalog.find_gpu(second.name) is not None


def test_probe_without_memory_v2_uses_v1_total(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(TWO_GPUS, v2=False))
    facts = devices.probe(cuda_visible_devices="0")
    assert facts.gpus[0].total_bytes == 24 * GIB


@pytest.mark.parametrize(
    ("visible", "names"),
    [
        ("1", ["NVIDIA H100 80GB HBM3"]),
        ("1,0", ["NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"]),
        ("GPU-bbbb", ["NVIDIA H100 80GB HBM3"]),
        ("0,7,1", ["NVIDIA GeForce RTX 4090"]),  # CUDA stops at the first invalid entry
    ],
)
def test_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, visible: str, names: list[str]) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(TWO_GPUS))
    facts = devices.probe(cuda_visible_devices=visible)
    assert [g.name for g in facts.gpus] == names


def test_cuda_visible_devices_hiding_everything_means_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(TWO_GPUS))
    facts = devices.probe(cuda_visible_devices="")
    assert facts.backend == "cpu" and "hides every GPU" in facts.notes[0]


def test_gpu_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(TWO_GPUS))
    assert [p.pid for p in devices.gpu_processes()] == [4242, 77]


# --- host memory (the CPU backend's view) ------------------------------------------------------

NODE_MEMINFO = """Node 0 MemTotal:        9005272 kB
Node 0 MemFree:         4842592 kB
Node 0 MemUsed:         4162680 kB
Node 0 Active(file):    1313768 kB
Node 0 Inactive(file):   837420 kB
Node 0 SReclaimable:     269828 kB
"""


def test_parse_node_meminfo_like_vllm() -> None:
    total, available = devices.parse_node_meminfo(NODE_MEMINFO)
    assert total == 9005272 * 1024
    assert available == (4842592 + 1313768 + 837420 + 269828) * 1024


def test_parse_node_meminfo_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        devices.parse_node_meminfo("nothing here")


@pytest.mark.parametrize(
    ("limit", "usage", "expected_total", "expected_available"),
    [
        (None, None, 9005272 * 1024, (4842592 + 1313768 + 837420 + 269828) * 1024),
        (4 * GIB, GIB, 4 * GIB, 3 * GIB),  # cgroup limit below the node: clamp both
        (64 * GIB, GIB, 9005272 * 1024, (4842592 + 1313768 + 837420 + 269828) * 1024),
    ],
)
def test_host_memory_honours_the_cgroup_limit(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    limit: int | None,
    usage: int | None,
    expected_total: int,
    expected_available: int,
) -> None:
    node = tmp_path / "meminfo"
    node.write_text(NODE_MEMINFO)
    monkeypatch.setattr(devices, "NODE0_MEMINFO", node)
    cg_max, cg_cur = tmp_path / "memory.max", tmp_path / "memory.current"
    if limit is not None:
        cg_max.write_text(f"{limit}\n")
        cg_cur.write_text(f"{usage}\n")
    monkeypatch.setattr(devices, "CGROUP_V2_MAX", cg_max)
    monkeypatch.setattr(devices, "CGROUP_V2_CURRENT", cg_cur)
    monkeypatch.setattr(devices, "CGROUP_V1_LIMIT", tmp_path / "absent")
    assert devices.host_memory() == (expected_total, expected_available)


def test_host_memory_without_numa_uses_psutil(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(devices, "NODE0_MEMINFO", tmp_path / "absent")
    monkeypatch.setattr(devices, "CGROUP_V2_MAX", tmp_path / "absent")
    monkeypatch.setattr(devices, "CGROUP_V1_LIMIT", tmp_path / "absent")

    class VM:
        total = 16 * GIB
        available = 10 * GIB

    monkeypatch.setattr(devices.psutil, "virtual_memory", lambda: VM())
    assert devices.host_memory() == (16 * GIB, 10 * GIB)


# --- catalog and manual devices ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("rtx4090", "RTX 4090"),
        ("RTX 4090", "RTX 4090"),
        ("4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("h100", "H100 80GB"),
        ("H100 80", "H100 80GB"),
        ("NVIDIA H100 80GB HBM3", "H100 80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("a100 40", "A100 40GB"),
        ("A10G", "A10"),
        ("l40s", "L40S"),
        ("L4", "L4"),
        ("H200 141", "H200 141GB"),
        ("NVIDIA H200", "H200 141GB"),
    ],
)
def test_find_gpu(name: str, canonical: str) -> None:
    found = catalog.find_gpu(name)
    assert found is not None and found[0] == canonical


@pytest.mark.parametrize("name", ["a100", "xyz", "", "  ", "RTX 5080"])
def test_find_gpu_unknown_or_ambiguous(name: str) -> None:
    assert catalog.find_gpu(name) is None


def test_from_catalog() -> None:
    facts = devices.from_catalog("RTX 3090", count=2)
    assert facts.backend == "cuda" and facts.source == "catalog" and facts.count == 2
    assert facts.compute_capability == (8, 6)
    assert facts.total_bytes == int(23.56 * GIB) == facts.free_bytes


def test_from_catalog_unknown_names_the_input() -> None:
    with pytest.raises(ConfigError) as err:
        devices.from_catalog("GTX 9999")
    assert err.value.field == "--gpu" and "GTX 9999" in err.value.message


def test_from_memory() -> None:
    facts = devices.from_memory(24, count=4)
    assert facts.count == 4 and facts.total_bytes == 24 * GIB and facts.compute_capability is None
    assert facts.source == "manual"
    with pytest.raises(ConfigError):
        devices.from_memory(0)


def test_every_catalog_gpu_is_complete() -> None:
    for name, info in catalog.GPUS.items():
        assert 20 < info.total_gib < 300, name
        assert len(info.compute_capability) == 2 and all(isinstance(n, int) for n in info.compute_capability)
        assert info.platform in ("cuda", "rocm") and info.aliases, name
        assert catalog.find_gpu(name) is not None
