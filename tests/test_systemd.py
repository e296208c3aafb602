"""The systemd units pass `systemd-analyze verify` and carry the settings the daemon relies on."""

from __future__ import annotations

import configparser
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from r1sup.core.config import ServerSection

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "systemd"
R1SUP = Path(sys.executable).with_name("r1sup")


def need_systemd() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("R1SUP_REQUIRE_SYSTEMD") == "1":
            pytest.fail("systemd-analyze is required here (R1SUP_REQUIRE_SYSTEMD=1)")
        pytest.skip("systemd-analyze is not installed")
    return tool


@pytest.mark.parametrize(
    ("unit", "as_name"), [("r1sup.service", "r1sup.service"), ("r1sup@.service", "r1sup@demo.service")]
)
def test_unit_verifies_cleanly(tmp_path: Path, unit: str, as_name: str):
    tool = need_systemd()
    assert R1SUP.exists(), "r1sup's console script sits next to the test interpreter"
    text = (UNITS / unit).read_text().replace("/opt/r1sup/bin/r1sup", str(R1SUP))
    (tmp_path / as_name).write_text(text)
    proc = subprocess.run(
        [tool, "verify", f"./{as_name}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 even for some parse warnings: any output is a finding
    findings = [
        line for line in (proc.stdout + proc.stderr).splitlines() if as_name in line or "Unknown" in line
    ]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert findings == [], findings


def test_verify_catches_a_broken_unit(tmp_path: Path):
    tool = need_systemd()
    text = (UNITS / "r1sup.service").read_text().replace("/opt/r1sup/bin/r1sup", str(R1SUP))
    (tmp_path / "r1sup.service").write_text(text.replace("KillMode=mixed", "KillMode=bogus"))
    proc = subprocess.run(
        [tool, "verify", "./r1sup.service"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "kill mode" in (proc.stdout + proc.stderr).lower()  # the check above would see it


@pytest.mark.parametrize("unit", ["r1sup.service", "r1sup@.service"])
def test_unit_settings(unit: str):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / unit).read_text())
    service = parser["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure" and service["KillMode"] == "mixed"
    # TimeoutStopSec above r1sup's whole stop: the drain (at most server.stop_timeout_s), the stop's
    # grace (server.stop_timeout_s) and memory_release_timeout_s, with the defaults
    server = ServerSection()
    assert int(service["TimeoutStopSec"]) > 2 * server.stop_timeout_s + server.memory_release_timeout_s
    assert int(service["TimeoutStartSec"]) >= 1800
    assert service["User"] == "r1sup" and service["StateDirectory"].startswith("r1sup")
    for key in ("NoNewPrivileges", "PrivateTmp"):
        assert service[key] == "yes"
    assert service["ProtectSystem"] == "strict" and service["ProtectHome"] == "yes"
    assert "ExecReload" in service and "-HUP" in service["ExecReload"]
    unit_text = (UNITS / unit).read_text()
    assert (
        "DeviceAllow=char-nvidia-frontend rw" in unit_text and "DeviceAllow=char-nvidia-uvm rw" in unit_text
    )
    assert "ReadWritePaths=" in unit_text and "WatchdogSec=" in unit_text
    assert "StartLimitBurst=" in unit_text and "RestartSec=" in unit_text
    # permanent failures stay failed: a config error and "no working configuration" would only repeat
    from r1sup.core.errors import EXIT_CONFIG, EXIT_NO_WORKING_CONFIG

    prevented = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert prevented == {EXIT_CONFIG, EXIT_NO_WORKING_CONFIG}
    assert service["CapabilityBoundingSet"] == "" and service["AmbientCapabilities"] == ""
    assert service["SystemCallErrorNumber"] == "EPERM" and service["RestrictNamespaces"] == "yes"
    assert service["ProtectProc"] == "invisible" and "ProcSubset" not in service  # CUDA reads /proc/driver
    assert "MemoryDenyWriteExecute" not in service  # torch.compile, Triton and CUDA generate code


@pytest.mark.parametrize(
    ("unit", "as_name"), [("r1sup.service", "r1sup.service"), ("r1sup@.service", "r1sup@demo.service")]
)
def test_the_units_exposure_stays_low(tmp_path: Path, unit: str, as_name: str):
    """`systemd-analyze security` rates the hardening; 6.2 before the system call filter, the empty
    capability set, RestrictNamespaces, ProtectProc, PrivateMounts and RemoveIPC; 1.6 with them. What
    is left is what vLLM needs (see the unit's comments)."""
    tool = need_systemd()
    text = (UNITS / unit).read_text().replace("/opt/r1sup/bin/r1sup", str(R1SUP))
    (tmp_path / as_name).write_text(text)
    proc = subprocess.run(
        [tool, "security", "--offline=true", f"./{as_name}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert found, proc.stdout + proc.stderr
    assert float(found.group(1)) <= 2.0, proc.stdout


def service_section(unit: str, instance: str | None = None) -> dict[str, list[str]]:
    """[Service] of a unit, with ``%i`` replaced by ``instance``: key -> every value (Environment repeats)."""
    text = (UNITS / unit).read_text()
    if instance is not None:
        text = text.replace("%i", instance)
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize(("unit", "instance"), [("r1sup.service", None), ("r1sup@.service", "qwen-14b")])
def test_a_hand_run_finds_the_state_directory_the_unit_uses(unit: str, instance: str | None):
    from r1sup.core import config as cfg

    service = service_section(unit, instance)
    argv = service["ExecStart"][0].split()
    assert "--state-dir" not in argv  # one source of truth: the config's name
    config_path = argv[argv.index("--config") + 1]
    state = "/var/lib/" + service["StateDirectory"][0]
    assert cfg.default_state_dir(config_path) == state
    loaded = cfg.build({"model": {"name": "org/m"}}, env={}, source=config_path)
    assert loaded.state.dir == state


@pytest.mark.parametrize(("unit", "instance"), [("r1sup.service", None), ("r1sup@.service", "demo")])
def test_home_and_caches_are_inside_the_writable_state_directory(unit: str, instance: str | None):
    service = service_section(unit, instance)
    env = dict(item.split("=", 1) for item in service["Environment"])
    state = "/var/lib/" + service["StateDirectory"][0]
    for name in ("HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert env[name] == state or env[name].startswith(state + "/"), (name, env[name])
    # the model cache is shared by the instances, in the writable cache directory
    assert service["CacheDirectory"] == ["r1sup"]
    assert env["HF_HOME"].startswith("/var/cache/r1sup/")


def test_the_cache_variables_are_the_ones_the_engine_reads():
    """vLLM reads VLLM_CACHE_ROOT (default: XDG_CACHE_HOME/vllm); checked against the installed vLLM."""
    from conftest import engine_available

    if not engine_available():
        pytest.skip("vLLM is not installed here")
    # vllm/envs.py itself, loaded from its file: it needs only the standard library, where importing it
    # as vllm.envs runs vllm/__init__.py first (torch and the rest: seconds)
    code = (
        "import os, importlib.util as u; os.environ.update(XDG_CACHE_HOME='/x/cache', HOME='/x'); "
        "os.environ.pop('VLLM_CACHE_ROOT', None); "
        "path = os.path.join(u.find_spec('vllm').submodule_search_locations[0], 'envs.py'); "
        "spec = u.spec_from_file_location('vllm_envs', path); e = u.module_from_spec(spec); "
        "spec.loader.exec_module(e); print(e.VLLM_CACHE_ROOT, e.VLLM_CONFIG_ROOT)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out == ["/x/cache/vllm", "/x/.config/vllm"]


# --- vLLM under the unit's system call filter --------------------------------------------------------

SECCOMP_RUN = ROOT / "tests" / "procs" / "seccomp_run.py"
# what systemd.exec(5) says SystemCallFilter= always allows
IMPLICIT = {"execve", "exit", "exit_group", "getrlimit", "rt_sigreturn", "sigreturn"}
IMPLICIT |= {"clock_gettime", "clock_getres", "gettimeofday", "time", "nanosleep", "clock_nanosleep"}


def expand(tool: str, item: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of ``@group`` (nested groups expanded) as systemd-analyze lists them."""
    if not item.startswith("@"):
        return {item}
    seen = set() if seen is None else seen
    out = subprocess.run(
        [tool, "syscall-filter", item], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        if not line.startswith("    "):
            break
        entry = line.strip()
        if not entry or entry.startswith("#") or entry in seen:
            continue
        seen.add(entry)
        names |= expand(tool, entry, seen)
    return names


def unit_syscalls(tool: str, unit: str) -> set[str]:
    """The calls a unit's SystemCallFilter= lines allow: the first list, less every ~list after it."""
    allowed: set[str] | None = None
    for value in service_section(unit)["SystemCallFilter"]:
        deny = value.startswith("~")
        names = set().union(*(expand(tool, item) for item in value.lstrip("~").split()))
        if deny:
            assert allowed is not None, "an allow list comes first"
            allowed -= names
        else:
            allowed = names if allowed is None else allowed | names
    assert allowed
    return allowed | IMPLICIT


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_vllm_serves_under_the_units_system_call_filter(tmp_path: Path, tiny_model: Path):
    """r1sup and the real vLLM CPU engine under the allow list of the unit (SystemCallFilter=, EPERM for
    the rest, inherited by every child): start-up, the load probe, a completion and a clean stop. The
    CUDA driver's calls are not covered: no GPU here."""
    import json
    import signal
    import urllib.request

    from conftest import engine_available, free_port, wait_until
    from r1sup_proc import kill_engine_processes, tiny_engine_config, write_config

    tool = need_systemd()
    if not engine_available():
        pytest.skip("vLLM is not installed here")
    allowed = tmp_path / "allowed.txt"
    allowed.write_text("\n".join(sorted(unit_syscalls(tool, "r1sup.service"))), encoding="utf-8")

    # the filter bites: setuid (of @privileged) is refused even to root
    code = "import os\ntry:\n    os.setuid(os.getuid())\nexcept PermissionError:\n    raise SystemExit(7)"
    probe = subprocess.run(
        [sys.executable, str(SECCOMP_RUN), str(allowed), "-c", code], timeout=60, check=False
    )
    assert probe.returncode == 7

    port = free_port()
    # compiled, as in production: the compile warm-up's system calls (Inductor runs the C++ compiler)
    body = tiny_engine_config(tmp_path, tiny_model, port, compiled=True, daemon={"health_interval_s": 1.0})
    config = write_config(tmp_path / "r1sup.toml", body)
    log = (tmp_path / "r1sup.log").open("w")
    argv = [sys.executable, str(SECCOMP_RUN), str(allowed), "r1sup.cli.app", "--log-format", "json"]
    proc = subprocess.Popen(
        [*argv, "run", "--config", str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
    )
    state = tmp_path / "state" / "status.json"

    def status() -> dict[str, object]:
        try:
            return dict(json.loads(state.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return {}

    def tail() -> str:
        return (tmp_path / "r1sup.log").read_text(encoding="utf-8")[-3000:]

    try:
        wait_until(lambda: status().get("state") == "serving" or proc.poll() is not None, 600, interval=1.0)
        assert status().get("state") == "serving", tail()
        # the compiled start-up's loading phases (dummy weights: no shards, the compile warm-up in
        # "profiling"), in order, once (moved from test_tune_engine.py's KV budget test, now eager)
        events = []
        for line in (tmp_path / "r1sup.log").read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        progress = [e for e in events if isinstance(e, dict) and e.get("event") == "engine_progress"]
        phases = [e["phase"] for e in progress if e["launch"] == 1]
        assert phases == ["weights", "profiling", "kv_cache", "api"], phases
        ready = [e["phase"] for e in events if isinstance(e, dict) and e.get("event") == "engine_ready"]
        assert ready == ["probe"], ready
        child = int(str(status()["child_pid"]))
        with open(f"/proc/{child}/status", encoding="utf-8") as f:
            assert "Seccomp:\t2" in f.read()  # vLLM runs filtered
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 0, tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
        kill_engine_processes(config)
