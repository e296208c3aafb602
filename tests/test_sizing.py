"""The sizing arithmetic beside the memory model: one "what is free allows" for the plan, the search
and its blind branch (with the CUDA context where it is known, without where it is not)."""

from __future__ import annotations

import pytest

from r1sup.core import memmodel as M
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo


@pytest.mark.parametrize(
    ("free_gib", "total_gib", "context_gib", "expected"),
    [
        (7.5, 25.0, 0.0, 0.29),  # 7.25 / 25 is 0.29 exactly; 0.29 x 100 is 28.999... in binary
        (20.25, 40.0, 0.0, 0.5),
        (20.25, 40.0, 0.5, 0.48),  # 19.5 / 40 = 0.4875, rounded down
        (0.1, 24.0, 0.0, -0.01),  # nothing is free: below zero, for the blind branch's message
    ],
)
def test_free_allows(free_gib: float, total_gib: float, context_gib: float, expected: float) -> None:
    assert M.free_allows(free_gib * GIB, total_gib * GIB, context_gib * GIB) == expected


def test_startable_utilization_is_never_below_zero() -> None:
    full = DeviceFacts(backend="cuda", gpus=(GpuInfo(0, "test", int(24 * GIB), int(0.1 * GIB)),))
    assert M.free_allows(0.1 * GIB, 24 * GIB) < 0
    assert M.startable_utilization(full, 1) == 0.0
    assert M.startable_utilization(DeviceFacts(backend="cuda"), 1) == 0.0
