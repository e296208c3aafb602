"""The preflight: interpreter, vLLM, model and port are checked before any model load, once.

Unit tests call :mod:`r1sup.adapters.preflight` on real files and real interpreters (no mocks); the end-to-end
tests run the real CLI against the fake engine and check what a user sees: one line naming the field,
the documented exit code, nothing launched, nothing left running, and a status that says failed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from conftest import engine_available, free_port
from r1sup.adapters import preflight
from r1sup.core import config as cfg
from r1sup.core import events as E
from r1sup.core.errors import PreflightError
from r1sup.core.hardware import DeviceFacts
from r1sup.state import profiles
from r1sup_proc import ROOT, R1sup, engine_processes, kill_engine_processes, write_config
from test_tune_fake import QWEN_7B, engine_records, fake_body, fake_env, fake_scenario

FAKE_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}


def no_site_python(tmp_path: Path) -> Path:
    """A working interpreter without vLLM: this one with ``-S`` (no site-packages at all)."""
    path = tmp_path / "bare-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    path.chmod(0o755)
    return path


def build(**sections: dict[str, object]) -> cfg.Config:
    body: dict[str, dict[str, object]] = {"model": {"name": "org/model"}}
    for name, values in sections.items():
        body.setdefault(name, {}).update(values)
    return cfg.build(body, env={})


def refused(fn: object, *args: object, **kwargs: object) -> PreflightError:
    with pytest.raises(PreflightError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    assert "\n" not in str(info.value)
    return info.value


# --- the launch command ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("launch", "module"),
    [
        (["-m", "vllm.entrypoints.openai.api_server"], "vllm.entrypoints.openai.api_server"),
        (["-X", "importtime", "-m", "fakevllm"], "fakevllm"),
        (["-mvllm.entrypoints.cli.main", "serve"], "vllm.entrypoints.cli.main"),
        (["-u", "-m", "vllm.entrypoints.openai.api_server"], "vllm.entrypoints.openai.api_server"),
        (["-c", "print(1)"], None),
        (["/opt/serve.py", "-m", "x"], None),
        (["-m"], None),
    ],
)
def test_launch_module(launch: list[str], module: str | None) -> None:
    assert preflight.launch_module(launch) == module


# --- server.python and the engine package ---------------------------------------------------------


def test_interpreter_that_is_not_there_or_not_runnable_is_a_config_error(tmp_path: Path) -> None:
    plain = tmp_path / "plain-file"
    plain.write_text("not a program\n")
    cases = {
        str(tmp_path / "missing"): f"{tmp_path / 'missing'}: no such file",
        str(tmp_path): f"{tmp_path} is a directory",
        str(plain): f"{plain} is not executable",
    }
    for python, message in cases.items():
        err = refused(preflight.check_engine, build(server={"python": python}), FAKE_ENV)
        assert err.field == "server.python" and err.exit_code == 2 and message in err.message
    plain.chmod(0o755)  # executable, but not an interpreter: the kernel refuses to run it
    err = refused(preflight.check_engine, build(server={"python": str(plain)}), FAKE_ENV)
    assert err.exit_code == 2 and "not a working Python interpreter" in err.message
    err = refused(preflight.check_engine, build(server={"python": "/bin/false"}), FAKE_ENV)
    assert err.exit_code == 2 and "exit code 1" in err.message


def test_interpreter_without_vllm_is_fatal_and_says_so(tmp_path: Path) -> None:
    python = str(no_site_python(tmp_path))
    err = refused(preflight.check_engine, build(server={"python": python}), FAKE_ENV)
    assert err.field == "server.python" and err.exit_code == 4
    assert err.message.startswith(f"{python} cannot import vllm: ModuleNotFoundError: No module named 'vllm'")


def test_launch_module_that_does_not_exist_names_server_launch() -> None:
    config = build(server={"launch": ["-m", "fakevllm.no_such_module"]})
    err = refused(preflight.check_engine, config, FAKE_ENV)
    assert err.field == "server.launch" and err.exit_code == 2
    assert f"fakevllm 0.32.0 in {sys.executable} has no module fakevllm.no_such_module" == err.message


def test_an_import_that_never_ends_is_bounded(tmp_path: Path) -> None:
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    err = refused(preflight.check_engine, build(server={"python": str(slow)}), FAKE_ENV, timeout=1.0)
    assert err.exit_code == 4 and "did not import vllm within 1s" in err.message


def test_versions_come_from_the_package_the_launch_runs() -> None:
    engine = preflight.check_engine(build(server={"launch": ["-m", "fakevllm"]}), FAKE_ENV)
    assert (engine.package, engine.module, engine.version) == ("fakevllm", "fakevllm", "0.32.0")
    assert engine.python == sys.executable and engine.python_version == sys.version.split()[0]


@pytest.mark.skipif(not engine_available(), reason="vLLM is not installed here")
def test_vllm_version_is_vllm_dunder_version_even_for_the_cpu_build() -> None:
    import importlib.metadata

    import vllm

    engine = preflight.check_engine(build(), dict(os.environ))
    assert engine.package == "vllm" and engine.version == vllm.__version__
    assert engine.torch_version == importlib.metadata.version("torch")


def test_engine_versions_for_the_fingerprint_are_none_when_the_interpreter_fails(tmp_path: Path) -> None:
    config = build(server={"python": str(tmp_path / "missing")})
    with pytest.raises(PreflightError) as refused_versions:
        preflight.engine_versions(config)
    assert refused_versions.value.field == "server.python"
    with capture_logs() as logs:
        fp = profiles.current_fingerprint(config, device=DeviceFacts(backend="cpu", cpu_model="any"))
    assert fp["versions"] == {"vllm": None, "torch": None}
    assert [e["field"] for e in logs if e["event"] == "engine_versions_failed"] == ["server.python"]


# --- the engine check remembered in the state directory -------------------------------------------


def fake_vllm(site: Path, version: str, imports: Path) -> None:
    """A package named ``vllm`` in ``site`` with the default launch module; importing it appends a line
    to ``imports``, so a test sees whether the preflight imported it or used what it remembered."""
    package = site / "vllm"
    (package / "entrypoints" / "openai").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f"with open({str(imports)!r}, 'a') as f:\n    f.write('imported\\n')\n__version__ = {version!r}\n"
    )
    (package / "entrypoints" / "__init__.py").write_text("")
    (package / "entrypoints" / "openai" / "__init__.py").write_text("")
    (package / "entrypoints" / "openai" / "api_server.py").write_text("")


def imported(imports: Path) -> int:
    return len(imports.read_text().splitlines()) if imports.exists() else 0


def test_an_unchanged_install_is_not_imported_again_and_a_changed_one_is(tmp_path: Path) -> None:
    site, imports = tmp_path / "site", tmp_path / "imports"
    fake_vllm(site, "0.1.0", imports)
    config = build(state={"dir": str(tmp_path / "state")})
    env = {**os.environ, "PYTHONPATH": str(site)}

    def engine(environ: dict[str, str] = env) -> tuple[str | None, str | None, bool, int]:
        found = preflight.check_engine_cached(config, environ)
        assert found.python == sys.executable and found.module == "vllm.entrypoints.openai.api_server"
        return found.version, found.torch_version, found.cached, imported(imports)

    torch = preflight.check_engine(config, env).torch_version  # a full check, remembered nowhere
    assert imported(imports) == 1 and not (tmp_path / "state").exists()
    assert engine() == ("0.1.0", torch, False, 2)  # nothing remembered yet: imported
    assert engine() == ("0.1.0", torch, True, 2)  # same install: remembered, not imported
    fake_vllm(site, "0.2.0", imports)  # upgraded in place
    assert engine() == ("0.2.0", torch, False, 3)
    assert engine() == ("0.2.0", torch, True, 3)
    other = tmp_path / "other"  # another vllm ahead of it on PYTHONPATH
    fake_vllm(other, "0.3.0", imports)
    shadowed = {**env, "PYTHONPATH": f"{other}{os.pathsep}{site}"}
    assert engine(shadowed) == ("0.3.0", torch, False, 4)
    assert engine(env) == ("0.2.0", torch, True, 4)  # each install keeps its entry
    (site / "torch-99.0.dist-info").mkdir()  # a package installed next to it: torch's version changes
    (site / "torch-99.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 99.0\n"
    )
    assert engine() == ("0.2.0", "99.0", False, 5)
    assert engine(env | {"VLLM_TARGET_DEVICE": "cpu"}) == ("0.2.0", "99.0", False, 6)  # an engine variable
    (site / "vllm" / "entrypoints" / "openai" / "api_server.py").unlink()  # the launch module is gone
    err = refused(preflight.check_engine_cached, config, env)
    assert err.field == "server.launch" and imported(imports) == 7
    err = refused(preflight.check_engine_cached, config, env)  # a failed check is never remembered
    assert err.field == "server.launch" and imported(imports) == 8


def test_the_fingerprints_versions_come_from_the_remembered_check_without_an_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # plan --config fingerprints the config to find its saved profile: after a tune or a run on the box,
    # the preflight's remembered check of the same install answers (the demo: 7.3 s became 0.6 s), read
    # only; an upgrade changes the install key, and the engine is asked again
    from r1sup.adapters import launcher

    site, imports = tmp_path / "site", tmp_path / "imports"
    fake_vllm(site, "0.1.0", imports)
    monkeypatch.setenv("PYTHONPATH", str(site))
    state = tmp_path / "state"
    config = build(state={"dir": str(state)})
    assert preflight.engine_versions(config)["vllm"] == "0.1.0" and imported(imports) == 1
    assert not state.exists()  # nothing remembered, and nothing written by the versions' reader
    preflight.check_engine_cached(config, launcher.engine_env(config))  # the preflight remembers it
    assert imported(imports) == 2
    before = (state / preflight.CACHE_FILE).read_bytes()
    assert preflight.engine_versions(config)["vllm"] == "0.1.0" and imported(imports) == 2
    assert (state / preflight.CACHE_FILE).read_bytes() == before
    fake_vllm(site, "0.2.0", imports)  # upgraded in place
    assert preflight.engine_versions(config)["vllm"] == "0.2.0" and imported(imports) == 3


def test_a_changed_interpreter_is_checked_again(tmp_path: Path) -> None:
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    config = build(
        server={"python": str(wrapper), "launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path)}
    )
    assert not preflight.check_engine_cached(config, FAKE_ENV).cached
    assert preflight.check_engine_cached(config, FAKE_ENV).cached
    wrapper.write_text(f'#!/bin/sh\n# edited\nexec "{sys.executable}" "$@"\n')  # the same, edited
    assert not preflight.check_engine_cached(config, FAKE_ENV).cached
    assert preflight.check_engine_cached(config, FAKE_ENV).cached
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I "$@"\n')  # now blind to PYTHONPATH
    err = refused(preflight.check_engine_cached, config, FAKE_ENV)
    assert err.field == "server.python" and "cannot import fakevllm" in err.message


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b'{"schema_version": 1, "entries": {"a": 1}}',
        b'{"schema_version": 1, "entries": [1, "x", {"key": 5}]}',
        b'{"schema_version": 99, "entries": []}',
        "\u00e9".encode("latin-1"),
    ],
)
def test_a_corrupt_cache_means_a_full_check_and_is_rewritten(tmp_path: Path, content: bytes) -> None:
    config = build(server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path)})
    (tmp_path / preflight.CACHE_FILE).write_bytes(content)
    heard: list[object] = []
    assert not preflight.check_engine_cached(config, FAKE_ENV, publish=heard.append).cached
    assert all(isinstance(e, E.PreflightCacheUnusable) for e in heard)  # said, never an error
    assert preflight.check_engine_cached(config, FAKE_ENV).cached  # rewritten whole


def test_a_cache_entry_that_does_not_fit_means_a_full_check(tmp_path: Path) -> None:
    config = build(server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path)})
    key = preflight.install_key(config, FAKE_ENV)
    assert key is not None and key == preflight.install_key(config, FAKE_ENV)
    engine = preflight.check_engine(config, FAKE_ENV)
    good = preflight.remembered(None, key, engine, 1000.0)
    assert preflight.cached_engine(good, key, 1000.0 + preflight.CACHE_MAX_AGE_S) == replace(
        engine, seconds=0.0, cached=True
    )
    assert preflight.cached_engine(good, key, 1001.0 + preflight.CACHE_MAX_AGE_S) is None  # too old
    assert preflight.cached_engine(good, key, 999.0) is None  # the clock went back
    assert preflight.cached_engine(good, "another key", 1000.0) is None
    entry = good["entries"][0]
    for bad in (
        {"checked_at": "yesterday"},
        {"checked_at": True},
        {"engine": None},
        {"engine": {"python": 3}},
    ):
        spoilt = {**good, "entries": [{**entry, **bad}]}
        assert preflight.cached_engine(spoilt, key, 1000.0) is None
    spoilt = {**good, "entries": [{**entry, "engine": {**entry["engine"], "version": 32}}]}
    assert preflight.cached_engine(spoilt, key, 1000.0) is None
    (tmp_path / preflight.CACHE_FILE).write_text(
        json.dumps({**good, "entries": [{**entry, "checked_at": 1.0}]})
    )
    assert not preflight.check_engine_cached(config, FAKE_ENV).cached  # an old entry: checked again
    many = good
    for n in range(preflight.CACHE_ENTRIES + 2):
        many = preflight.remembered(many, f"key {n}", engine, 1000.0 + n)
    assert [e["key"] for e in many["entries"]] == [f"key {n}" for n in (5, 4, 3, 2)]


def test_an_unusable_cache_place_never_fails_the_preflight(tmp_path: Path) -> None:
    (tmp_path / "state" / preflight.CACHE_FILE).mkdir(parents=True)  # a directory where the file goes
    config = build(server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path / "state")})
    heard: list[object] = []
    for _ in range(2):
        assert not preflight.check_engine_cached(config, FAKE_ENV, publish=heard.append).cached
    assert [type(e) for e in heard] == [E.PreflightCacheUnusable, E.PreflightCacheNotSaved] * 2
    (tmp_path / "file").write_text("")  # a state.dir that cannot be created
    config = build(server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path / "file" / "state")})
    assert not preflight.check_engine_cached(config, FAKE_ENV).cached


# serial: the cache's key reads the engine package's and site-packages' listings, which other workers'
# first imports change (new __pycache__ entries) between this test's two looks
@pytest.mark.serial
def test_check_always_imports_and_leaves_the_cache_alone(tmp_path: Path) -> None:
    config = build(server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path)})
    assert not preflight.check_engine_cached(config, FAKE_ENV).cached
    before = (tmp_path / preflight.CACHE_FILE).read_bytes()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = build(
        model={"name": str(model)}, server={"launch": ["-m", "fakevllm"]}, state={"dir": str(tmp_path)}
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(ROOT / "tests"))
        assert not preflight.run(config).engine.cached  # what r1sup check runs
        assert preflight.run(config, cache=True).engine.cached  # what tune and run run
    assert (tmp_path / preflight.CACHE_FILE).read_bytes() == before


# --- model.name -----------------------------------------------------------------------------------


def hf_cache(tmp_path: Path, repo: str, revision: str = "main") -> dict[str, str]:
    root = tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "snapshots" / "abc123").mkdir(parents=True)
    (root / "snapshots" / "abc123" / "config.json").write_text("{}")
    (root / "refs").mkdir()
    (root / "refs" / revision).write_text("abc123")
    return {"HF_HOME": str(tmp_path / "hf")}


def test_model_resolution(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    env = hf_cache(tmp_path, "org/cached")
    assert preflight.resolve_model(str(model), None, env).kind == "local"
    assert preflight.resolve_model(str(tmp_path / "m.gguf"), None, env).kind == "local"
    assert preflight.resolve_model("org/cached", None, env).kind == "hf-cache"
    download = preflight.resolve_model("org/elsewhere", None, env)
    assert download.kind == "download" and "downloads it at the first launch" in download.describe()

    def fails(name: str, revision: str | None, environ: dict[str, str]) -> str:
        err = refused(preflight.resolve_model, name, revision, environ)
        assert err.field == "model.name" and err.exit_code == 4
        return err.message

    assert fails(str(tmp_path / "nope"), None, env) == f"model directory not found: {tmp_path / 'nope'}"
    assert fails("./relative/nope", None, env) == "model directory not found: ./relative/nope"
    assert fails("a/b/c", None, env) == "model directory not found: a/b/c"
    assert fails(str(empty), None, env) == f"directory {empty} has no config.json"
    assert "is a file" in fails(str(model / "config.json"), None, env)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    assert preflight.resolve_model("org/cached", None, offline).kind == "hf-cache"
    message = fails("org/elsewhere", None, offline)
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1 forbids a download" in message
    message = fails("org/cached", "v2", {**env, "TRANSFORMERS_OFFLINE": "yes"})
    assert "org/cached at revision v2 is not in the Hugging Face cache" in message


# --- end to end: what a user sees --------------------------------------------------------------------


def run_cli(tmp_path: Path, command: str, body: dict[str, dict[str, object]], timeout: float = 120) -> R1sup:
    scenario = fake_scenario(tmp_path)
    config = write_config(tmp_path / "r1sup.toml", body)
    proc = R1sup(command, "--config", str(config), env=fake_env(scenario))
    try:
        proc.wait(timeout)
    finally:
        proc.kill()
        left = engine_processes(config)
        kill_engine_processes(config)
    assert not left, f"engine processes left behind: {left}"
    return proc


def said(proc: R1sup) -> list[str]:
    """What r1sup said to a person on stderr: every line but its JSON log events."""
    return [line for line in proc.stderr if not line.startswith("{")]


def assert_one_line(proc: R1sup, code: int, starts: str) -> None:
    assert proc.proc.returncode == code, proc.tail()
    lines = said(proc)
    assert len(lines) == 1 and lines[0].startswith(f"r1sup: error: {starts}"), lines
    assert proc.lines == []  # no result on stdout
    assert "Traceback" not in "".join(proc.stderr)
    assert not proc.named("launch_started") and not proc.named("child_started")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["tune", "run"])
def test_missing_interpreter_ends_before_any_launch(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "venv" / "bin" / "python"
    body = fake_body(tmp_path, model=QWEN_7B, server={"python": str(missing)})
    proc = run_cli(tmp_path, command, body)
    assert_one_line(proc, 2, f"server.python: {missing}: no such file")
    assert engine_records(tmp_path) == []
    if command == "run":
        state = json.loads((tmp_path / "state" / "status.json").read_text())
        assert state["state"] == "failed" and state["child_pid"] is None


@pytest.mark.slow
@pytest.mark.parametrize("command", ["tune", "run"])
def test_interpreter_without_vllm_ends_before_any_launch(tmp_path: Path, command: str) -> None:
    python = no_site_python(tmp_path)
    body = fake_body(
        tmp_path,
        model=QWEN_7B,
        server={"python": str(python), "launch": ["-m", "vllm.entrypoints.openai.api_server"]},
    )
    proc = run_cli(tmp_path, command, body)
    assert_one_line(proc, 4, f"server.python: {python} cannot import vllm: ModuleNotFoundError")
    assert [e["field"] for e in proc.named("preflight_failed")] == ["server.python"]
    if command == "run":
        state = json.loads((tmp_path / "state" / "status.json").read_text())
        assert state["state"] == "failed"
        assert any(e["event"] == "daemon_failed" for e in state["recent_events"])


@pytest.mark.slow
def test_missing_model_directory_ends_before_any_launch(tmp_path: Path) -> None:
    body = fake_body(tmp_path, model=str(tmp_path / "no-such-model"))
    proc = run_cli(tmp_path, "tune", body)
    assert_one_line(proc, 4, f"model.name: model directory not found: {tmp_path / 'no-such-model'}")


@pytest.mark.slow
def test_preflight_runs_once_and_feeds_the_fingerprint(tmp_path: Path) -> None:
    body = fake_body(tmp_path, model=QWEN_7B)
    proc = run_cli(tmp_path, "tune", body)
    assert proc.proc.returncode == 0, proc.tail()
    assert len(proc.named("launch_started")) == 1 and proc.named("probe_passed")  # one launch, probe ok
    (passed,) = proc.named("preflight_passed")
    assert passed["engine_package"] == "fakevllm" and passed["vllm_version"] == "0.32.0"
    assert passed["model"] == "download"
    profile = json.loads(next((tmp_path / "state" / "profiles").glob("*.json")).read_text())
    assert profile["fingerprint"]["versions"]["vllm"] == "0.32.0"
    assert profile["fingerprint"]["versions"]["torch"] == passed["torch_version"]
    assert passed["cached"] is False
    again = run_cli(tmp_path, "tune", body)  # the same install: the import is not done again
    assert again.proc.returncode == 0, again.tail()
    (cached,) = again.named("preflight_passed")
    assert cached["cached"] is True and cached["vllm_version"] == "0.32.0"
    assert cached["torch_version"] == passed["torch_version"]


def test_check_runs_the_preflight_and_says_what_it_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from r1sup.cli.app import main

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    port = free_port()
    body = {
        "model": {"name": str(model)},
        "server": {"launch": ["-m", "fakevllm"], "port": port},
        "state": {"dir": str(tmp_path / "state")},
    }
    config = write_config(tmp_path / "c.toml", body)
    assert main(["check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"# server.python {sys.executable}: fakevllm 0.32.0" in out
    assert f"# model.name: local directory {model}" in out
    assert f"# server.port: 127.0.0.1:{port} is free" in out
    assert main(["check", "--config", str(config), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["preflight"]
    assert found["engine"]["version"] == "0.32.0" and found["engine"]["package"] == "fakevllm"
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert main(["check", "--config", str(config)]) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"r1sup: error: server.port: port {port} on 127.0.0.1 is held by pid {os.getpid()}")
    write_config(config, {**body, "server": {"launch": ["-m", "fakevllm"], "port": port, "python": "/nope"}})
    assert main(["check", "--config", str(config)]) == 2
    assert main(["check", "--config", str(config), "--no-preflight"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "r1sup: error: server.python: /nope: no such file\n"
