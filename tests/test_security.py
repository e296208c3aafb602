"""Secrets, exposure and hostile input: the API key never leaks, bad config bytes never crash r1sup."""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, free_port, wait_until
from r1sup import apikey, logs
from r1sup import config as cfg
from r1sup.cli import main
from r1sup.errors import ConfigError
from r1sup.health import Endpoint
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config

# the source tree first, so that the r1sup processes run this checkout's code
FAKE_ENV = {"PYTHONPATH": f"{ROOT / 'supervisor'}:{ROOT / 'tests' / 'fakenvml'}:{ROOT / 'tests'}"}


def fake_config(tmp_path: Path, port: int, **extra: dict) -> Path:
    body = {
        "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "served_name": "r1-7b"},
        "server": {
            "port": port,
            "launch": ["-m", "fakevllm"],
            "startup_timeout_s": 60,
            "stall_timeout_s": 30,
        },
        "start": {"max_model_len": 16384},
        "probe": {"requests": 3, "output_tokens": 4},
        "daemon": {"health_interval_s": 0.5, "liveness_interval_s": 1.0},
        "state": {"dir": str(tmp_path / "state")},
    }
    for section, values in extra.items():
        body.setdefault(section, {}).update(values)
    return write_config(tmp_path / "c.toml", body)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_api_key_reaches_vllm_and_appears_in_no_output(tmp_path: Path):
    key = "sk-r1sup-" + secrets.token_hex(12)
    key_file = tmp_path / "api.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o640)  # group-readable: r1sup must warn, naming the file and its mode
    port = free_port()
    config = fake_config(tmp_path, port, server={"api_key_file": str(key_file)})
    scenario = json.dumps({"gpu": "RTX 4090", "time_scale": 0.002})
    env = {**FAKE_ENV, "FAKE_VLLM_SCENARIO": scenario}
    outputs: list[str] = []
    try:
        tune = R1sup("tune", "--config", str(config), "--json", env=env)
        assert tune.wait(120) == 0, tune.tail()
        outputs += tune.lines + tune.stderr
        result = json.loads("".join(tune.lines))
        assert result["ok"] and result["probe"]["ok"]  # the probe used the key (the server demands it)
        warning = [e for e in tune.events if e.get("event") == "file_permissions"]
        assert warning and warning[0]["file"] == str(key_file) and warning[0]["mode"] == "0o640"

        run = R1sup("run", "--config", str(config), env=env)
        try:
            run.wait_event("serving", 60)
            status = json.loads((tmp_path / "state" / "status.json").read_text())
            child = status["child_pid"]
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode()
            assert key not in cmdline  # never on the command line (the process table)
            child_env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            assert f"VLLM_API_KEY={key}".encode() in child_env  # through the environment
            assert Endpoint("127.0.0.1", port).request("/v1/models")[0] == 401  # the server requires it
            assert Endpoint("127.0.0.1", port, key).request("/v1/models")[0] == 200
            run.wait_event("vllm", 10)
            run.signal(signal.SIGTERM)
            assert run.wait(60) == 0
        finally:
            run.kill()
        outputs += run.lines + run.stderr
        for path in (tmp_path / "state").rglob("*"):
            if path.is_file():
                outputs.append(path.read_text(errors="replace"))
        text = "".join(outputs)
        assert "r1sup-" in text or "r1-7b" in text  # we did look at real output
        assert key not in text
    finally:
        kill_engine_processes(config)
    assert not engine_processes(config)


def test_relayed_lines_and_errors_are_masked():
    key = "sk-" + secrets.token_hex(8)
    out = io.StringIO()
    logs.configure(fmt="json", stream=out, secrets=[key])
    logs.get_logger().info("vllm", source="vllm", text=f"echo {key} back", nested={"k": [key]})
    assert key not in out.getvalue() and "***" in out.getvalue()
    assert logs.mask(f"error mentioning {key}") == "error mentioning ***"


def test_key_file_errors_name_the_field(tmp_path: Path):
    base = {"model": {"name": "m"}}
    missing = cfg.build({**base, "server": {"api_key_file": str(tmp_path / "nope")}}, env={})
    with pytest.raises(ConfigError) as info:
        apikey.load_api_key(missing, environ={})
    assert info.value.field == "server.api_key_file"
    two = tmp_path / "two"
    two.write_text("a b\n")
    with pytest.raises(ConfigError):
        apikey.load_api_key(cfg.build({**base, "server": {"api_key_file": str(two)}}, env={}), environ={})
    assert apikey.load_api_key(cfg.build(base, env={}), environ={"VLLM_API_KEY": "k1"}) == "k1"


def test_secret_looking_env_in_a_readable_config_warns(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "m"\n[server.env]\nHF_TOKEN = "hf_abcdef"\n')
    path.chmod(0o644)
    warnings = apikey.permission_warnings(cfg.load(path, environ={}))
    assert warnings and "HF_TOKEN" in warnings[0]["why"] and warnings[0]["mode"] == "0o644"
    path.chmod(0o600)
    assert apikey.permission_warnings(cfg.load(path, environ={})) == []
    config = cfg.load(path, environ={})
    assert "hf_abcdef" in apikey.secret_values(config, None)  # masked in logs like the key


def test_exposure_defaults_are_loopback():
    c = cfg.build({"model": {"name": "m"}}, env={})
    assert c.server.host == "127.0.0.1" and c.daemon.metrics_host == "127.0.0.1"
    assert cfg.is_loopback("::1") and cfg.is_loopback("localhost") and not cfg.is_loopback("10.0.0.5")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=400), st.text(max_size=400).map(lambda t: t.encode("utf-8", "surrogatepass"))
    )
)
def test_config_loader_survives_any_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    code = main(["check", "--config", str(path)])
    out, err = capsys.readouterr()
    assert code in (0, 2)
    assert "Traceback" not in err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("r1sup: error: ")


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["model", "server", "start", "ladder", "target", "probe", "daemon", "state", "x"]),
        st.dictionaries(
            st.text(min_size=1, max_size=25),
            st.one_of(
                st.integers(),
                st.floats(allow_nan=True),
                st.booleans(),
                st.text(max_size=20),
                st.lists(st.text(max_size=5), max_size=3),
                st.none(),
            ),
            max_size=4,
        ),
        max_size=5,
    )
)
def test_config_build_survives_any_structure(data: dict):
    try:
        cfg.build(data, env={})
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)


def test_state_dir_and_files_are_private(tmp_path: Path):
    from r1sup import statefiles

    d = statefiles.ensure_state_dir(tmp_path / "state")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    statefiles.atomic_write_json(d / "x.json", {"schema_version": 1})
    assert stat.S_IMODE(os.stat(d / "x.json").st_mode) == 0o600
    wait_until(lambda: (d / "x.json").exists(), 1)


# --- one r1sup per config and per state directory (issue 26) ---------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_second_r1sup_on_a_served_config_leaves_the_first_ones_vllm_alone(tmp_path: Path):
    """``r1sup run`` serving, then ``r1sup tune`` and a second ``run`` of the same config: each exits 2 at
    once with one line naming the daemon's pid and what to do; the daemon's vLLM is never touched."""
    port = free_port()
    config = fake_config(tmp_path, port)
    env = {**FAKE_ENV, "FAKE_VLLM_SCENARIO": json.dumps({"gpu": "RTX 4090", "time_scale": 0.002})}
    run = R1sup("run", "--config", str(config), env=env)
    try:
        run.wait_event("serving", 90)
        status = json.loads((tmp_path / "state" / "status.json").read_text())
        child = status["child_pid"]
        for command in ("tune", "run"):
            second = R1sup(command, "--config", str(config), env=env)
            assert second.wait(30) == 2, second.tail()
            err = [line for line in second.stderr if line.startswith("r1sup: error:")]
            assert len(err) == 1 and f"pid {run.proc.pid}" in err[0] and "r1sup run" in err[0], second.tail()
            assert "state.dir" in err[0] and "stop that one" in err[0]
            assert not second.named("leftovers_killed") and not second.named("launch_started")
        assert psutil_alive(child)
        assert not run.named("serving_failed") and len(run.named("launch_started")) == 1
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0
    finally:
        run.kill()
        kill_engine_processes(config)
    assert not engine_processes(config)


def psutil_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_the_state_dir_lock_names_its_holder_and_dies_with_it(tmp_path: Path):
    import subprocess
    import sys

    from r1sup import statefiles

    first = statefiles.lock_state_dir(tmp_path / "state", "r1sup run --config a.toml")
    try:
        with pytest.raises(statefiles.StateDirBusy) as info:
            statefiles.lock_state_dir(tmp_path / "state", "r1sup tune --config a.toml")
        assert info.value.exit_code == 2 and info.value.field == "state.dir"
        assert f"pid {os.getpid()} (r1sup run --config a.toml)" in str(info.value)
    finally:
        first.release()
    statefiles.lock_state_dir(tmp_path / "state", "again").release()  # released: free again
    # a holder killed with SIGKILL holds nothing: the kernel drops the lock with the process
    code = (
        "import sys, time; from r1sup import statefiles; "
        f"statefiles.lock_state_dir({str(tmp_path / 'state')!r}, 'holder'); print('held', flush=True); "
        "time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "supervisor")},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(statefiles.StateDirBusy, match=f"pid {holder.pid} "):
            statefiles.lock_state_dir(tmp_path / "state", "second")
        holder.kill()
        holder.wait(timeout=10)
        statefiles.lock_state_dir(tmp_path / "state", "after the kill").release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)


def test_leftovers_are_only_those_whose_r1sup_is_gone(tmp_path: Path):
    """The ``ours`` test asks whether the owning r1sup is alive: a vLLM of a running r1sup is never a
    leftover of another one, even with the same instance mark."""
    import subprocess
    import sys

    from r1sup import launcher

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = None
    try:
        env = {
            **os.environ,
            launcher.CHILD_MARK_VAR: "inst-26",
            launcher.OWNER_VAR: launcher.owner_mark(owner.pid),
        }
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        assert launcher.kill_leftovers("inst-26", timeout=5) == []
        assert child.poll() is None and not launcher.is_ours(child.pid, "inst-26")
        assert [p.pid for p in launcher.marked("inst-26")] == [child.pid]
        owner.kill()
        owner.wait(timeout=10)
        assert launcher.is_ours(child.pid, "inst-26")
        assert launcher.kill_leftovers("inst-26", timeout=5) == [child.pid]
        child.wait(timeout=10)
    finally:
        for p in (owner, child):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_an_owner_pid_reused_by_another_process_does_not_keep_a_leftover():
    from r1sup import launcher

    me = os.getppid()  # alive, but started at another time than the mark says
    assert launcher.owner_alive(launcher.owner_mark(me))
    assert not launcher.owner_alive(f"{me}:12345.00")
    for bad in (None, "", "x", "0:0", "-1:5", f"{os.getpid()}:1", "99999999:1.0"):
        assert not launcher.owner_alive(bad)
