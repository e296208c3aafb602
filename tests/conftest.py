"""Shared test helpers: bounded waiting, free ports, the tiny model, the real engine's availability."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # helpers such as the fake engine live with the tests


def wait_until(
    predicate: Callable[[], object], timeout: float, interval: float = 0.05, what: str = ""
) -> object:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` seconds pass (then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_available() -> bool:
    """True where the real CPU engine can be imported (make test installs it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def planning_without_a_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Deterministic planning: no NVIDIA driver (pynvml's init fails as without one), an empty HF cache,
    no R1SUP_* settings from the caller."""
    import types

    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init() -> None:
        raise NVMLError("NVML Shared Library Not Found")

    nv.NVMLError = NVMLError  # type: ignore[attr-defined]
    nv.nvmlInit = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-empty"))
    for key in list(os.environ):
        if key.startswith("R1SUP_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _fresh_structlog():
    """cli.main() configures structlog for the process; each test starts from the defaults. A command
    that did not log leaves its configuration pending (``logs.configure`` defers structlog's import until
    the first logger), and the next ``get_logger`` would apply it: to an output captured by an earlier
    test, closed since. That is dropped too."""
    import structlog

    from r1sup.adapters import logs

    logs._active.pop("pending", None)
    structlog.reset_defaults()
    yield
    logs._active.pop("pending", None)
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _engine_core_of_this_worker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist, the real engines of each lane run their model on a core of their own. vLLM's
    CPU build binds its model worker to one core ("auto": the same core for every engine), so two engines
    started side by side (``make test`` runs the real-engine tests in two lanes) would share it while the
    other core idles. Lane ``engine-a``'s engines get the first core this process may use, ``engine-b``'s
    the last (by the lane, not the worker: with more workers than lanes, either lane may land on any
    worker); an explicit VLLM_CPU_OMP_THREADS_BIND wins."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if request.node.get_closest_marker("engine") is None or not worker.startswith("gw"):
        return
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[0] if engine_lane(request.node) == "engine-a" else cores[-1]
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(core))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from r1sup.adapters.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def pytest_sessionstart(session: pytest.Session) -> None:
    """``make test-wheel`` (R1SUP_TEST_INSTALLED=1): the tests and the r1sup processes they start must
    use the installed wheel, in an environment without vLLM, or the job proves nothing."""
    if os.environ.get("R1SUP_TEST_INSTALLED") != "1":
        return
    import subprocess

    probe = "import importlib.util, r1sup; print(r1sup.__file__, importlib.util.find_spec('vllm') is None)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    import r1sup

    for where in (r1sup.__file__, out[0]):
        if Path(where).resolve().is_relative_to(ROOT / "supervisor"):
            pytest.exit(f"r1sup is imported from the source tree ({where}), not from the wheel", returncode=3)
    if out[1] != "True" or engine_available():
        pytest.exit("vLLM is importable: the installed-wheel job must run without it", returncode=3)


# make test's parallel run (``-n 2 --dist loadgroup``, TEST_WORKERS): the real-engine tests in two
# lanes, two xdist groups, so that two engines start side by side, each on a core of its own
# (_engine_core_of_this_worker), while the fake-engine tests fill the workers around them. xdist hands
# the largest groups out first, one to each worker, then every other test one at a time to whichever
# worker runs low. Balance the lanes by the seconds `--durations` records (a quiet 2-core machine,
# TEST_WORKERS=3: the one-slot flood 155 s, the probe 155 s, the daemon's serve-recover-stop 135 s, the KV
# budget's two launches 121 s, the compiled start under the system-call filter 109 s, the planner's
# auto-fit 57 s): lane a, the flood, the KV budget and the filter; lane b, the rest. A real-engine test
# not named here joins lane b. The `serial` ones run after, alone, in make test's second run.
ENGINE_LANE_A = {
    (
        "test_daemon_engine.py",
        "test_a_flood_through_one_sequence_slot_is_served_without_a_restart",
    ),
    ("test_tune_engine.py", "test_context_larger_than_the_kv_budget_recovers_in_two_launches"),
    ("test_systemd.py", "test_vllm_serves_under_the_units_system_call_filter"),
}


def engine_lane(item: pytest.Item) -> str:
    """The xdist group of a real-engine test: ``engine-a`` or ``engine-b``."""
    name = item.originalname if isinstance(item, pytest.Function) else item.name
    return "engine-a" if (item.path.name, name) in ENGINE_LANE_A else "engine-b"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "engine" in item.keywords and "serial" not in item.keywords:
            item.add_marker(pytest.mark.xdist_group(engine_lane(item)))
    if engine_available() or os.environ.get("R1SUP_REQUIRE_ENGINE") == "1":
        return
    skip = pytest.mark.skip(reason="the vLLM CPU engine is not installed (run make test)")
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)
