"""Config validation: every rule gives exit 2 and one stderr line naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from r1sup.cli.app import main
from r1sup.core import config as cfg
from r1sup.core.errors import ConfigError

MINIMAL = '[model]\nname = "org/model"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text, encoding="utf-8")
    return path


def run_check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ("[start]\nmax_model_length = 4096\n", "start.max_model_length", "did you mean start.max_model_len"),
        ("[strat]\nx = 1\n", "strat", "unknown section"),
        ("[start]\ngpu_memory_utilization = 0\n", "start.gpu_memory_utilization", "must be > 0"),
        ("[start]\ngpu_memory_utilization = 1.2\n", "start.gpu_memory_utilization", "must be <= 1"),
        ('[start]\ngpu_memory_utilization = "high"\n', "start.gpu_memory_utilization", "expected a number"),
        ('[start]\nkv_cache_dtype = "int4"\n', "start.kv_cache_dtype", "must be one of"),
        ("[start]\nmax_model_len = 4096.5\n", "start.max_model_len", "expected an integer"),
        ("[start]\nmax_model_len = 0\n", "start.max_model_len", "must be >= 1"),
        ("[start]\nenforce_eager = 1\n", "start.enforce_eager", "expected true or false"),
        ('[start]\nquantization = "int3"\n', "start.quantization", "must be one of"),
        ("[start]\ntensor_parallel_size = 0\n", "start.tensor_parallel_size", "must be >= 1"),
        ("[server]\nport = 0\n", "server.port", "must be >= 1"),
        ("[server]\nport = 70000\n", "server.port", "must be <= 65535"),
        ("[server]\nport = true\n", "server.port", "expected an integer"),
        ('[server]\nextra_args = "--foo"\n', "server.extra_args", "expected a list of strings"),
        ('[server]\nextra_args = ["--max-model-len", "4"]\n', "server.extra_args", "managed by r1sup"),
        ('[server]\nextra_args = ["--port=9"]\n', "server.extra_args", "--port is managed"),
        ('[server]\nextra_args = ["--api-key", "x"]\n', "server.extra_args", "--api-key is managed"),
        ('[server]\nenv = { VLLM_API_KEY = "k" }\n', "server.env", "api_key_file"),
        ("[server]\nenv = { A = 1 }\n", "server.env", "expected a table of strings"),
        ('[server]\nhost = "0.0.0.0"\n', "server.host", "not a loopback address"),
        ('[search]\nstrategy = "random"\n', "search.strategy", "must be one of smart, naive"),
        (
            "[search]\nmin_gpu_memory_utilization = 0.9\nmax_gpu_memory_utilization = 0.8\n",
            "search.min_gpu_memory_utilization",
            "must be <=",
        ),
        ("[search]\nmax_attempts = 0\n", "search.max_attempts", "must be >= 1"),
        ("[target]\nconcurrency = -1\n", "target.concurrency", "must be >= 1"),
        (
            "[start]\nmax_model_len = 1024\n[target]\nconcurrency = 1\ncontext = 4096\n",
            "target.context",
            "longer than",
        ),
        (
            "[start]\nmax_model_len = 1024\n",
            "start.max_model_len",
            "(1024) is shorter than search.min_max_model_len (2048)",
        ),
        (
            "[start]\nmax_model_len = 4096\n[search]\nmin_max_model_len = 8192\n",
            "start.max_model_len",
            "shorter than search.min_max_model_len (8192)",
        ),
        (
            "[start]\nmax_model_len = 4096\n[probe]\nprompt_tokens = 4090\noutput_tokens = 16\n",
            "probe.prompt_tokens",
            "do not fit in start.max_model_len (4096)",
        ),
        ("[target]\nconcurrency = 4\n", "target.context", "set both target.concurrency and target.context"),
        ("[target]\ncontext = 4096\n", "target.concurrency", "set both"),
        ("[probe]\ntimeout_s = 0\n", "probe.timeout_s", "must be > 0"),
        ("[daemon]\nmetrics_port = 8000\n", "daemon.metrics_port", "same as server.port"),
        ("[daemon]\nbackoff_initial_s = 10\nbackoff_max_s = 1\n", "daemon.backoff_initial_s", "must be <="),
        ("[state]\ndir = 5\n", "state.dir", "expected a string"),
        ("model = 5\n", "model", "must be a table"),
    ],
)
def test_rule_names_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, field: str, fragment: str
):
    path = write(tmp_path, (MINIMAL + body) if not body.startswith("model =") else body)
    code, out, err = run_check(capsys, "--config", str(path))
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"r1sup: error: {field}: ")
    assert fragment in lines[0]
    assert "Traceback" not in err


def test_missing_model_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, _, err = run_check(capsys, "--config", str(write(tmp_path, "[start]\nmax_model_len = 4\n")))
    assert code == 2
    assert "model.name: required but not set" in err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    code, _, err = run_check(capsys, "--config", str(tmp_path / "nope.toml"))
    assert code == 2
    assert err.strip() == f"r1sup: error: config file not found: {tmp_path / 'nope.toml'}"


def test_syntax_error_reports_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = write(tmp_path, MINIMAL + "[start]\nmax_model_len = = 3\n")
    code, _, err = run_check(capsys, "--config", str(path))
    assert code == 2
    assert "TOML syntax error" in err and "line 4" in err


def test_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "c.toml"
    path.write_bytes(b'[model]\nname = "\xff"\n')
    code, _, err = run_check(capsys, "--config", str(path))
    assert code == 2 and "not UTF-8" in err


def test_precedence_defaults_file_env_cli(tmp_path: Path):
    path = write(tmp_path, MINIMAL + "[server]\nport = 8100\n[start]\nmax_model_len = 8192\n")
    env = {"R1SUP_SERVER_PORT": "8200", "R1SUP_START_MAX_MODEL_LEN": "4096"}
    c = cfg.load(path, environ=env, overrides={"server.port": "8300"})
    assert c.server.port == 8300  # command line beats environment
    assert c.start.max_model_len == 4096  # environment beats file
    assert c.start.gpu_memory_utilization == 0.9  # default
    assert cfg.load(path, environ={}).server.port == 8100  # file beats default


def test_env_unknown_key_is_error(tmp_path: Path):
    with pytest.raises(ConfigError) as info:
        cfg.load(write(tmp_path, MINIMAL), environ={"R1SUP_START_MAX_MODEL_LENGTH": "5"})
    assert info.value.field == "start.max_model_length"
    assert "environment" in str(info.value)


def test_env_bad_value_names_field(tmp_path: Path):
    with pytest.raises(ConfigError) as info:
        cfg.load(write(tmp_path, MINIMAL), environ={"R1SUP_SERVER_PORT": "eighty"})
    assert info.value.field == "server.port"


def test_env_ignores_non_settings(tmp_path: Path):
    c = cfg.load(write(tmp_path, MINIMAL), environ={"R1SUP_LOG_LEVEL": "debug", "R1SUP_CONFIG": "x"})
    assert c.model.name == "org/model"


def test_env_list_and_bool(tmp_path: Path):
    env = {"R1SUP_SERVER_EXTRA_ARGS": '["--seed", "1"]', "R1SUP_START_ENFORCE_EAGER": "true"}
    c = cfg.load(write(tmp_path, MINIMAL), environ=env)
    assert c.server.extra_args == ["--seed", "1"]
    assert c.start.enforce_eager is True


def test_cli_set_and_bad_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = write(tmp_path, MINIMAL)
    code, out, _ = run_check(capsys, "--config", str(path), "--set", "start.max_model_len=4321")
    assert code == 0 and '"start.max_model_len"' not in out and "4321" in out
    code, _, err = run_check(capsys, "--config", str(path), "--set", "nonsense")
    assert code == 2 and "--set: expected section.key=value" in err
    code, _, err = run_check(capsys, "--config", str(path), "--set", "start.max_model_len=abc")
    assert code == 2 and "start.max_model_len: expected an integer" in err


def test_public_bind_needs_key_or_opt_in(tmp_path: Path):
    body = MINIMAL + '[server]\nhost = "0.0.0.0"\n'
    with pytest.raises(ConfigError):
        cfg.load(write(tmp_path, body), environ={})
    assert cfg.load(write(tmp_path, body), environ={"VLLM_API_KEY": "k"}).server.host == "0.0.0.0"
    opt_in = body.replace('"0.0.0.0"\n', '"0.0.0.0"\nallow_public_bind = true\n')
    assert cfg.load(write(tmp_path, opt_in), environ={}).server.allow_public_bind


def test_check_json_and_configs_dir_are_valid(capsys: pytest.CaptureFixture[str]):
    root = Path(__file__).resolve().parent.parent
    files = sorted((root / "configs").glob("*.toml"))
    assert files, "configs/ holds example configs"
    for path in files:
        code, out, err = run_check(capsys, "--config", str(path), "--json", "--no-preflight")
        assert code == 0, (path, err)
        assert '"model"' in out


def test_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]):
    code = main(["tune"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "--config" in err


@pytest.mark.parametrize("argv", [["--help"], ["status", "--state-dir", "{tmp}"], ["check", "--help"]])
def test_light_commands_import_nothing_heavy(tmp_path: Path, argv: list[str]):
    import subprocess
    import sys

    code = (
        "import sys; from r1sup.cli.app import main; main(sys.argv[1:]); "
        "heavy = [m for m in ('openai', 'torch', 'vllm', 'httpx', 'r1sup.core.planner', "
        "'r1sup.adapters.probe') if m in sys.modules]; "
        "print('HEAVY', heavy)"
    )
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    assert "HEAVY []" in out, out


def test_env_error_names_the_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch):
    path = write(tmp_path, MINIMAL)
    cases = {
        "R1SUP_SERVER_PORT=abc": "server.port: expected an integer, got 'abc' (from the environment "
        "variable R1SUP_SERVER_PORT)",
        "R1SUP_SERVER_PORT=70000": "server.port: must be <= 65535; got 70000 (from the environment "
        "variable R1SUP_SERVER_PORT)",
        "R1SUP_START_MAX_MODEL_LEN=1000": "(from the environment variable R1SUP_START_MAX_MODEL_LEN)",
        "R1SUP_START_MAX_MODEL_LENGTH=5": "start.max_model_length: unknown setting; did you mean "
        "start.max_model_len? (from the environment variable R1SUP_START_MAX_MODEL_LENGTH)",
    }
    for assignment, expected in cases.items():
        name, _, value = assignment.partition("=")
        monkeypatch.setenv(name, value)
        code, out, err = run_check(capsys, "--config", str(path), "--no-preflight")
        monkeypatch.delenv(name)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and expected in err, (assignment, err)
    # the same value in the file is the file's: no variable is named
    code, _, err = run_check(capsys, "--config", str(write(tmp_path, MINIMAL + "[server]\nport = 0\n")))
    assert code == 2 and "environment" not in err


def test_a_config_larger_than_1_mib_is_refused_without_reading_it_all(tmp_path: Path):
    import subprocess
    import sys

    big = tmp_path / "big.toml"
    big.write_text(MINIMAL + "# " + "x" * (1024 * 1024) + "\n", encoding="utf-8")
    for path in (str(big), "/dev/zero"):
        proc = subprocess.run(
            [sys.executable, "-m", "r1sup.cli.app", "check", "--config", path, "--no-preflight"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        if path == "/dev/zero":  # a device is refused before anything is read from it
            assert proc.stderr == f"r1sup: error: config path is not a regular file (a device): {path}\n"
        else:
            assert proc.stderr == f"r1sup: error: {path}: larger than 1024 KiB; not a config file\n"
    just_under = tmp_path / "fits.toml"
    just_under.write_text(MINIMAL + "# " + "x" * (1024 * 1024 - len(MINIMAL) - 3) + "\n", encoding="utf-8")
    assert just_under.stat().st_size == cfg.MAX_CONFIG_BYTES
    assert cfg.load(just_under, environ={}).model.name == "org/model"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("/etc/r1sup/qwen14.toml", "/var/lib/r1sup/qwen14"),  # r1sup@qwen14
        ("/etc/r1sup/r1sup.toml", "/var/lib/r1sup"),  # r1sup.service
        ("configs/demo.toml", "/var/lib/r1sup/demo"),
        ("/etc/r1sup/...toml", "/var/lib/r1sup"),
        (None, "/var/lib/r1sup"),
    ],
)
def test_default_state_dir_follows_the_config_name(source: str | None, expected: str):
    assert cfg.default_state_dir(source) == expected


def test_state_dir_default_and_explicit(tmp_path: Path):
    path = tmp_path / "qwen14.toml"
    path.write_text(MINIMAL, encoding="utf-8")
    assert cfg.load(path, environ={}).state.dir == "/var/lib/r1sup/qwen14"
    assert cfg.load(path, environ={}, overrides={"state.dir": "/srv/x"}).state.dir == "/srv/x"
    path.write_text(MINIMAL + '[state]\ndir = "/srv/y"\n', encoding="utf-8")
    assert cfg.load(path, environ={}).state.dir == "/srv/y"


# --- a config that is not a regular file never blocks r1sup (issue 26) --------------------------------


def _cli(*args: str, timeout: float = 30) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "R1SUP_CONFIG": ""},
    )
    return out.returncode, out.stderr


@pytest.mark.parametrize("command", ["check", "tune", "run", "status"])
def test_a_fifo_as_config_is_refused_at_once(tmp_path: Path, command: str):
    import os

    fifo = tmp_path / "r1sup.toml"
    os.mkfifo(fifo)
    code, err = _cli(command, "--config", str(fifo))  # on a blocking open this never returns
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("r1sup: error:")]
    assert len(lines) == 1 and "not a regular file (a FIFO)" in lines[0] and str(fifo) in lines[0], err


def test_a_device_as_config_is_refused():
    with pytest.raises(ConfigError, match=r"not a regular file \(a device\): /dev/zero"):
        cfg.read_toml("/dev/zero")
    with pytest.raises(ConfigError, match="is a directory"):
        cfg.read_toml("/")


def test_a_reload_read_is_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import threading
    import time

    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "m"\n')
    assert cfg.load_bounded(path, timeout_s=5).model.name == "m"
    stuck = threading.Event()
    monkeypatch.setattr(cfg, "read_toml", lambda p: stuck.wait(30) or {})  # a file system that hangs
    start = time.monotonic()
    with pytest.raises(ConfigError, match="not read within 0.3 s"):
        cfg.load_bounded(path, timeout_s=0.3)
    assert time.monotonic() - start < 2
    stuck.set()
    monkeypatch.undo()
    path.write_text("[model\n")
    with pytest.raises(ConfigError):  # the worker's own error reaches the caller
        cfg.load_bounded(path, timeout_s=5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fifo_swapped_in_before_sighup_does_not_wedge_the_daemon(tmp_path: Path):
    import json
    import os
    import signal
    import time

    from conftest import ROOT, free_port
    from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config

    port = free_port()
    body = {
        "model": {"name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "served_name": "r1-7b"},
        "server": {"port": port, "launch": ["-m", "fakevllm"], "startup_timeout_s": 60},
        "start": {"max_model_len": 16384},
        "probe": {"requests": 3, "output_tokens": 4},
        "daemon": {"health_interval_s": 0.5, "liveness_interval_s": 1.0},
        "state": {"dir": str(tmp_path / "state")},
    }
    config = write_config(tmp_path / "c.toml", body)
    saved = tmp_path / "saved.toml"
    saved.write_bytes(config.read_bytes())
    env = {
        "PYTHONPATH": f"{ROOT / 'tests' / 'fakenvml'}:{ROOT / 'tests'}",
        "FAKE_VLLM_SCENARIO": json.dumps({"gpu": "RTX 4090", "time_scale": 0.002}),
    }
    daemon = R1sup("run", "--config", str(config), env=env)
    try:
        daemon.wait_event("serving", 90)
        config.unlink()
        os.mkfifo(config)
        daemon.signal(signal.SIGHUP)
        failed = daemon.wait_event("reload_failed", 10)
        assert "not a regular file (a FIFO)" in failed["error"]
        # a reload cannot move the daemon to another state directory: the lock stays where it was taken
        config.unlink()
        write_config(config, {**body, "state": {"dir": str(tmp_path / "other")}})
        daemon.signal(signal.SIGHUP)
        moved = daemon.wait_event("reload_failed", 10, count=2)
        assert moved["error"].startswith("state.dir:"), moved
        assert not (tmp_path / "other").exists()
        asked = time.monotonic()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, daemon.tail()
        assert time.monotonic() - asked < 30
    finally:
        daemon.kill()
        config.unlink()
        config.write_bytes(saved.read_bytes())
        kill_engine_processes(config)
    assert not engine_processes(config)


# --- upper bounds: every duration and size (issue 34) ----------------------------------------------


def _numeric_settings() -> list[tuple[str, Any]]:
    out = []
    for dotted, f, tp in cfg.declarations():
        base, _ = cfg._unwrap_optional(tp)
        if base in (int, float):
            out.append((dotted, f))
    return out


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("R1SUP_DAEMON_HEALTH_TIMEOUT_S", "1e10", "daemon.health_timeout_s"),
        ("R1SUP_PROBE_TIMEOUT_S", "1e10", "probe.timeout_s"),
        ("R1SUP_START_CPU_OFFLOAD_GB", "1e300", "start.cpu_offload_gb"),
        ("R1SUP_START_MAX_MODEL_LEN", str(10**300), "start.max_model_len"),
        ("R1SUP_STATE_PROFILE_WAIT_S", "1e12", "state.profile_wait_s"),
        ("R1SUP_SERVER_EXTRA_ARGS", "[" * 3000 + "]" * 3000, "server.extra_args"),
    ],
)
def test_a_value_past_its_bound_is_exit_2_naming_the_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
    field: str,
):
    """`r1sup check` used to pass these, then the daemon died of an OverflowError (or a RecursionError)."""
    path = write(tmp_path, MINIMAL)
    monkeypatch.setenv(variable, value)
    code, out, err = run_check(capsys, "--config", str(path), "--no-preflight")
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"r1sup: error: {field}: ") and variable in line
    assert len(line) < 300


def test_every_number_setting_has_an_upper_bound_that_its_timers_accept():
    """A duration at its bound is one a lock, a socket and a sleep take (1e10 s overflowed them)."""
    import socket
    import threading

    settings = _numeric_settings()
    assert len(settings) > 30
    for dotted, f in settings:
        assert "maximum" in f.metadata, f"{dotted} has no upper bound"
        if dotted.endswith("_s"):
            bound = f.metadata["maximum"]
            assert threading.Lock().acquire(timeout=bound), dotted
            with socket.socket() as sock:
                sock.settimeout(bound)
            assert threading.Event().wait(0) is False


@pytest.mark.parametrize(("dotted", "f"), _numeric_settings(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_value_at_the_bound_loads_and_one_past_it_is_refused(dotted: str, f: Any):
    section, _, key = dotted.partition(".")
    bound = f.metadata["maximum"]
    past = bound + 1 if isinstance(bound, int) else bound * 2
    data: dict[str, Any] = {"model": {"name": "org/model"}, section: {key: bound}}
    relaxed = {  # what must hold beside it for the other cross-checks
        "start.max_model_len": {"search": {"min_max_model_len": 16}},
        "search.min_gpu_memory_utilization": {"search": {"max_gpu_memory_utilization": bound}},
        "target.concurrency": {"target": {"concurrency": bound, "context": 4096}},
        "target.context": {"target": {"concurrency": 1, "context": bound}},
        "daemon.backoff_initial_s": {"daemon": {"backoff_initial_s": bound, "backoff_max_s": bound}},
        "multinode.node_rank": {"multinode": {"node_rank": bound, "nnodes": bound + 1}},
        "multinode.nnodes": {"multinode": {"nnodes": bound, "master_addr": "10.0.0.1"}},
    }.get(dotted, {})
    for name, body in relaxed.items():
        data.setdefault(name, {}).update(body)
    if dotted == "multinode.node_rank":
        data["multinode"]["nnodes"] = bound + 1  # past its own bound: only node_rank's check is asked
        with pytest.raises(ConfigError) as info:
            cfg.build(data, env={})
        assert info.value.field == "multinode.nnodes"
        return
    cfg.build(data, env={})
    data[section][key] = past
    with pytest.raises(ConfigError) as info:
        cfg.build(data, env={})
    assert info.value.field == dotted and f"must be <= {bound}" in info.value.message


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NUMERIC_NAMES = [dotted for dotted, _ in _numeric_settings()]
_TEXT_VALUES = st.one_of(
    st.sampled_from(["1e10", "1e300", "-1", "0", "nan", "inf", "9" * 400, "1_000", "[" * 5000, "{a=1}", ""]),
    st.floats(allow_nan=True).map(repr),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(
    env=st.dictionaries(
        st.sampled_from([*_NUMERIC_NAMES, "server.extra_args", "server.env", "server.launch"]),
        _TEXT_VALUES,
        max_size=4,
    )
)
def test_fuzzed_environment_is_used_within_the_bounds_or_refused_with_one_line(env: dict[str, str]):
    import threading

    variables = {"R1SUP_" + dotted.replace(".", "_").upper(): value for dotted, value in env.items()}
    try:
        config = cfg.build({"model": {"name": "org/model"}}, env=variables)
    except ConfigError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 400
        return
    for dotted, f in _numeric_settings():
        section, _, key = dotted.partition(".")
        value = getattr(getattr(config, section), key)
        if value is not None:
            assert value <= f.metadata["maximum"], dotted
            if dotted.endswith("_s"):
                assert threading.Lock().acquire(timeout=value)


# --- [ladder], the old name of [search], read for one release -----------------------------------------

OLD_SEARCH = '[ladder]\nstrategy = "naive"\nmax_attempts = 3\nallow_weight_quantization = true\n'


def test_the_old_section_name_loads_as_search_with_one_warning_naming_the_new_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = write(tmp_path, MINIMAL + OLD_SEARCH)
    old = cfg.load(path, environ={})
    code, old_out, err = run_check(capsys, "--config", str(path), "--json", "--no-preflight")
    path.write_text(MINIMAL + OLD_SEARCH.replace("[ladder]", "[search]"), encoding="utf-8")
    new = cfg.load(path, environ={})
    assert old == new and new.search.strategy == "naive" and new.search.max_attempts == 3
    assert old.renamed == (cfg.Renamed("[ladder]", "[search]", str(path)),) and new.renamed == ()
    assert code == 0 and run_check(capsys, "--config", str(path), "--json", "--no-preflight")[1] == old_out
    warned = [json.loads(line) for line in err.splitlines() if "config_renamed" in line]
    assert len(err.strip().splitlines()) == 1 and len(warned) == 1, err
    assert warned[0]["level"] == "warning"
    assert warned[0]["message"] == f"{path}: [ladder] is now [search]; [ladder] is read for this release"


def test_both_the_old_and_the_new_section_is_a_one_line_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = write(tmp_path, MINIMAL + OLD_SEARCH + "[search]\nmax_attempts = 4\n")
    code, out, err = run_check(capsys, "--config", str(path), "--no-preflight")
    assert code == 2 and out == ""
    assert err == (
        "r1sup: error: [ladder]: [search] is given too; [ladder] is the old name of [search]: "
        "keep [search] only\n"
    )


def test_a_key_under_the_old_section_is_named_by_its_new_name(tmp_path: Path):
    with pytest.raises(ConfigError) as info:
        cfg.load(write(tmp_path, MINIMAL + "[ladder]\nmax_attempt = 3\n"), environ={})
    assert str(info.value) == "search.max_attempt: unknown setting; did you mean search.max_attempts?"


def test_old_names_in_the_environment_and_on_the_command_line_are_read_with_a_warning(tmp_path: Path):
    path = write(tmp_path, MINIMAL)
    env = {"R1SUP_LADDER_MAX_ATTEMPTS": "3"}
    c = cfg.load(path, environ=env, overrides={"ladder.strategy": "naive"})
    assert c.search.max_attempts == 3 and c.search.strategy == "naive"
    assert c.renamed == (
        cfg.Renamed(
            "ladder.max_attempts", "search.max_attempts", "the environment variable R1SUP_LADDER_MAX_ATTEMPTS"
        ),
        cfg.Renamed("ladder.strategy", "search.strategy", "the command line"),
    )
    with pytest.raises(ConfigError) as info:  # a bad value names the new key and where it came from
        cfg.load(path, environ={"R1SUP_LADDER_MAX_ATTEMPTS": "0"})
    assert str(info.value) == (
        "search.max_attempts: must be >= 1; got 0 (from the environment variable R1SUP_LADDER_MAX_ATTEMPTS)"
    )
    with pytest.raises(ConfigError) as info:  # both names in one layer
        cfg.load(path, environ={**env, "R1SUP_SEARCH_MAX_ATTEMPTS": "4"})
    assert str(info.value) == (
        "ladder.max_attempts: search.max_attempts is given too (from the environment variable "
        "R1SUP_SEARCH_MAX_ATTEMPTS); keep search.max_attempts only"
    )
