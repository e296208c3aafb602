"""``r1sup status`` and ``r1sup profile export/import`` through the real CLI entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import structlog

from conftest import wait_until
from r1sup.adapters.statefiles import atomic_write_json
from r1sup.cli.app import main
from r1sup.cli.commands.status import is_r1sup_cmdline
from r1sup.state import profiles
from r1sup.state.profiles import ProfileStore
from test_profiles import fp_with, gpu_box, make_profile


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """main() points structlog at the captured stdout with a level filter; start and end each test
    with structlog's defaults, so that no test logs into another's closed capture."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what the test's own set-up logged
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def now_iso(offset_s: float = 0.0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=offset_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_status(directory: Path, pid: int, child_pid: int | None, **changes: Any) -> dict[str, Any]:
    status = {
        "schema_version": 1,
        "updated_at": now_iso(),
        "state": "serving",
        "pid": pid,
        "child_pid": child_pid,
        "launches": 2,
        "profile_source": "persisted",
        "flags": {"max_model_len": 4096, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"},
        "since": now_iso(-60),
        "last_failure": {"class": "kv_cache_too_small", "phase": "kv_cache", "estimated_max_model_len": 3712},
        "config": "/etc/r1sup/qwen.toml",
        "served_model": "qwen",
        "port": 8000,
        "recent_events": [
            {"ts": now_iso(-70), "event": "launch_started", "attempt": 1},
            {"ts": now_iso(-65), "event": "failure_classified", "failure_class": "kv_cache_too_small"},
            {"ts": now_iso(-60), "event": "probe_passed", "requests": 8},
        ],
        **changes,
    }
    directory.mkdir(mode=0o700, exist_ok=True, parents=True)
    atomic_write_json(directory / "status.json", status)
    return status


@pytest.fixture
def sleepers(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real processes that block on stdin; each is stopped and reaped at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def start(procs: list[subprocess.Popen[bytes]], argv: list[str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    procs.append(proc)
    return proc


def r1sup_like(tmp_path: Path) -> list[str]:
    """The command line of an installed console script: ``python /path/bin/r1sup run ...``."""
    script = tmp_path / "bin" / "r1sup"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\nsys.stdin.read()\n")
    return [sys.executable, str(script), "run", "--config", "/etc/r1sup/qwen.toml"]


# --- status ------------------------------------------------------------------------------------


def test_missing_state_dir_is_reported_with_exit_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "absent"
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    assert "does not exist" in out
    code, out, _ = run(capsys, "status", "--state-dir", str(state), "--json")
    assert code == 0
    assert json.loads(out) == {
        "state_dir": str(state),
        "exists": False,
        "profiles": [],
        "unusable_files": [],
        "daemon": None,
    }
    assert not state.exists()
    state.write_text("")
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0 and "is not a directory" in out


@pytest.mark.timeout(60)
def test_live_daemon_and_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    profile = make_profile()
    assert ProfileStore(state).save(profile) is not None
    daemon = start(sleepers, r1sup_like(tmp_path))
    child = start(sleepers, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    write_status(state, daemon.pid, child.pid)

    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    assert profile.key in out
    assert "Qwen/Qwen2.5-7B-Instruct (served as qwen)" in out
    assert "flags: max_model_len=4096 gpu_memory_utilization=0.9 kv_cache_dtype=fp8" in out
    assert "probe: passed=true requests=8 p50_latency_s=0.4" in out
    assert "box: 1x NVIDIA GeForce RTX 4090; vllm 0.33.0, torch 2.9.0" in out
    assert f"daemon: serving, pid {daemon.pid} running" in out
    assert f"child pid {child.pid} running" in out
    assert "launches 2" in out and "profile persisted" in out
    assert "last failure: class=kv_cache_too_small phase=kv_cache estimated_max_model_len=3712" in out
    assert "probe_passed requests=8" in out

    code, out, _ = run(capsys, "status", "--state-dir", str(state), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["state_dir"] == str(state)
    assert [p["key"] for p in report["profiles"]] == [profile.key]
    assert report["profiles"][0]["flags"]["kv_cache_dtype"] == "fp8"
    d = report["daemon"]
    assert (d["state"], d["pid"], d["alive"], d["stale"]) == ("serving", daemon.pid, True, False)
    assert d["child_alive"] is True
    assert d["liveness"] == "running"
    assert len(d["recent_events"]) == 3

    child.kill()
    child.wait(timeout=10)
    report = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])
    assert report["daemon"]["alive"] is True and report["daemon"]["child_alive"] is False


@pytest.mark.timeout(60)
def test_a_draining_daemon_shows_the_requests_it_waits_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    daemon = start(sleepers, r1sup_like(tmp_path))
    child = start(sleepers, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    write_status(state, daemon.pid, child.pid, state="draining", status="draining: 3 running, 2 waiting")

    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    lines = out.splitlines()
    head = lines.index(f"daemon: draining, pid {daemon.pid} running")
    assert lines[head + 1] == "  status: draining: 3 running, 2 waiting"
    report = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])
    assert (report["daemon"]["state"], report["daemon"]["status"]) == (
        "draining",
        "draining: 3 running, 2 waiting",
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["dead", "not-r1sup", "reused", "no-pid", "zombie"])
def test_stale_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]], case: str
) -> None:
    state = tmp_path / "state"
    pid: Any
    updated_at = now_iso()
    if case == "dead":
        proc = start(sleepers, r1sup_like(tmp_path))
        proc.kill()
        proc.wait(timeout=10)
        pid, fragment = proc.pid, "does not exist"
    elif case == "not-r1sup":
        other = start(sleepers, [sys.executable, "-c", "import sys; sys.stdin.read()"])
        pid, fragment = other.pid, "not an r1sup"
    elif case == "reused":
        pid, fragment = start(sleepers, r1sup_like(tmp_path)).pid, "reused"
        updated_at = now_iso(-3600)  # written an hour before this process existed
    elif case == "zombie":
        proc = start(sleepers, r1sup_like(tmp_path))
        proc.kill()
        # not reaped yet: a zombie keeps its pid until the parent waits
        import psutil

        zombie = psutil.Process(proc.pid)
        wait_until(lambda: zombie.status() == psutil.STATUS_ZOMBIE, timeout=10, what="a zombie")
        pid, fragment = proc.pid, "zombie"
    else:
        pid, fragment = None, "no pid"
    write_status(state, pid, None, updated_at=updated_at)
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    assert "daemon: not running (stale status: last state serving" in out
    assert fragment in out
    report = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])
    assert report["daemon"]["alive"] is False and report["daemon"]["stale"] is True
    assert fragment in report["daemon"]["liveness"]


def test_bad_files_are_reported_and_left_in_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    good = make_profile()
    ProfileStore(state).save(good)
    bad_profile = state / "profiles" / "00000000aaaaaaaa.json"
    bad_profile.write_text('{"schema_version": 1, "key"')
    (state / "status.json").write_text('{"schema_version": 7, "state": "serving"}')
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    assert good.key in out
    assert f"unusable: {bad_profile}: truncated JSON" in out
    assert "daemon: status file unusable: schema_version 7, this r1sup reads 1" in out
    report = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])
    assert report["unusable_files"][0]["path"] == str(bad_profile)
    assert report["daemon"]["problem"].startswith("schema_version 7")
    assert bad_profile.read_text() == '{"schema_version": 1, "key"'  # status is read-only
    assert sorted(p.name for p in state.iterdir()) == ["profiles", "status.json"]


def test_state_dir_from_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "from-config"
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\nname = "org/model"\n[state]\ndir = "{state}"\n')
    ProfileStore(state).save(make_profile())
    report = json.loads(run(capsys, "status", "--config", str(config), "--json")[1])
    assert report["state_dir"] == str(state) and len(report["profiles"]) == 1
    override = tmp_path / "override"
    code, out, _ = run(capsys, "status", "--config", str(config), "--state-dir", str(override), "--json")
    report = json.loads(out)
    assert report["state_dir"] == str(override)
    code, _, err = run(capsys, "status", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "config file not found" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/local/bin/r1sup", "run", "-c", "x.toml"], True),
        (["r1sup"], True),
        (["/opt/venv/bin/python3", "/opt/venv/bin/r1sup", "run"], True),
        (["python3.11", "-u", "/opt/venv/bin/r1sup", "run"], True),
        (["python", "-m", "r1sup.cli.app", "run"], True),
        (["python", "-X", "importtime", "-m", "r1sup", "run"], True),
        (["python", "-mr1sup.cli"], True),
        (["/home/ci/r1sup/.venv/bin/python", "-c", "import r1sup"], False),
        (["/home/ci/r1sup/.venv/bin/python", "-m", "pytest", "r1sup"], False),
        (["python", "/srv/other.py", "r1sup"], False),
        (["vim", "r1sup"], False),
        (["python", "-m", "r1suppressor"], False),
        ([], False),
    ],
)
def test_what_counts_as_an_r1sup_process(argv: list[str], expected: bool) -> None:
    assert is_r1sup_cmdline(argv) is expected


IMPORT_PROBE = """
import json, sys
from r1sup.cli.app import main
code = main(["status", "--state-dir", sys.argv[1], "--json"])
HEAVY = ("torch", "vllm", "openai", "transformers", "pynvml")
OURS = (
    "r1sup.adapters.devices",
    "r1sup.core.planner",
    "r1sup.adapters.modelinfo",
    "r1sup.adapters.launcher",
    "r1sup.adapters.probe",
)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY or m in OURS)
print(json.dumps({"code": code, "heavy": heavy, "psutil": "psutil" in sys.modules}), file=sys.stderr)
"""


@pytest.mark.timeout(120)
def test_status_imports_nothing_heavy(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    state = tmp_path / "state"
    ProfileStore(state).save(make_profile())

    def probe() -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE, str(state)], capture_output=True, text=True, timeout=60
        )
        return dict(json.loads(done.stderr.strip().splitlines()[-1]))

    assert probe() == {"code": 0, "heavy": [], "psutil": False}  # no status file: psutil not needed
    write_status(state, start(sleepers, r1sup_like(tmp_path)).pid, None)
    assert probe() == {"code": 0, "heavy": [], "psutil": True}


LIGHT_PROBE = """
import json, sys
from r1sup.cli.app import main
code = main(["status", "--state-dir", sys.argv[1]])
LAZY = ("structlog", "hashlib", "r1sup.core.probing", "r1sup.core.hardware", "r1sup.cli.commands.plan",
        "shutil", "bz2", "lzma")
print(json.dumps({"code": code, "loaded": sorted(m for m in LAZY if m in sys.modules)}), file=sys.stderr)
"""


@pytest.mark.timeout(120)
def test_status_imports_no_logging_library_until_it_logs(tmp_path: Path) -> None:
    """Issue 36 (``status`` cost 10x a bare interpreter): structlog, the probe's and the device's types
    and OpenSSL are loaded only where needed, and shutil (with its compression modules: argparse loads it
    for the terminal's width) not at all; an unusable file is still logged, as before."""
    state = tmp_path / "state"

    def probe() -> tuple[dict[str, Any], list[str]]:
        done = subprocess.run(
            [sys.executable, "-c", LIGHT_PROBE, str(state)], capture_output=True, text=True, timeout=60
        )
        *logged, last = done.stderr.strip().splitlines()
        return dict(json.loads(last)), logged

    assert probe() == ({"code": 0, "loaded": []}, [])
    ProfileStore(state).save(make_profile())
    # reading a profile checks its key (hashlib), logs nothing
    assert probe()[0] == {"code": 0, "loaded": ["hashlib"]}
    (state / "profiles" / "0123456789abcdef.json").write_text("{}")
    result, logged = probe()
    assert result["code"] == 0 and "structlog" in result["loaded"]
    (line,) = logged
    assert json.loads(line)["event"] == "state_file_invalid"


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--state-dir", "x", "--json", "--verbose"],
        ["status", "--watch", "2"],
        ["status", "--bogus"],
        ["status", "--help"],
    ],
)
def test_the_status_parser_alone_parses_helps_and_fails_as_the_full_one(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from r1sup.cli.app import build_parser

    said = []
    for parser in (build_parser(), build_parser(only="status")):
        try:
            said.append(("parsed", vars(parser.parse_args(argv))))
        except SystemExit as exc:
            said.append(("exit", exc.code))
        said.append(capsys.readouterr())
    assert said[0:2] == said[2:4]


# --- profile export / import -------------------------------------------------------------------


@pytest.fixture
def box(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This box's fingerprint, as ``current_fingerprint`` would compute it; tests change it."""
    current: dict[str, Any] = {"fp": fp_with()}
    monkeypatch.setattr(profiles, "current_fingerprint", lambda config: current["fp"])
    return current


def cfg(tmp_path: Path, state: Path) -> str:
    """A config file whose state.dir is ``state``."""
    path = tmp_path / f"{state.name}.toml"
    path.write_text(f'[model]\nname = "Qwen/Qwen2.5-7B-Instruct"\n[state]\ndir = "{state}"\n')
    return str(path)


def test_export_and_import_on_an_identical_box(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], box: dict[str, Any]
) -> None:
    here, there = tmp_path / "here", tmp_path / "there"
    profile = make_profile()
    ProfileStore(here).save(profile)
    exported = tmp_path / "exported.json"
    code, out, _ = run(capsys, "profile", "export", str(exported), "--config", cfg(tmp_path, here))
    assert code == 0, out
    assert f"exported profile {profile.key} to {exported}" in out
    code, out, _ = run(capsys, "profile", "import", str(exported), "--config", cfg(tmp_path, there))
    assert code == 0, out
    assert "fingerprint matches this box" in out
    assert f"imported profile {profile.key}" in out
    assert "--max-model-len 4096" in out and "--kv-cache-dtype fp8" in out
    assert ProfileStore(there).lookup(fp_with()) is not None


def test_export_without_a_profile_for_this_box(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], box: dict[str, Any]
) -> None:
    state = tmp_path / "state"
    old = make_profile()
    ProfileStore(state).save(old)
    box["fp"] = fp_with(versions={"vllm": "0.34.0", "torch": "2.9.0"})
    out_file = tmp_path / "exported.json"
    code, _, err = run(capsys, "profile", "export", str(out_file), "--config", cfg(tmp_path, state))
    assert code == 2
    assert "no saved profile for this box and config" in err
    assert f"profile {old.key} of the same model differs: versions.vllm: 0.33.0 -> 0.34.0" in err
    assert not out_file.exists()


def test_import_from_another_box_is_refused_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], box: dict[str, Any]
) -> None:
    here = tmp_path / "here"
    ProfileStore(here).save(make_profile())
    exported = tmp_path / "exported.json"
    assert run(capsys, "profile", "export", str(exported), "--config", cfg(tmp_path, here))[0] == 0
    box["fp"] = fp_with(device=gpu_box(name="NVIDIA L40S", total_bytes=48 * 1024**3))
    there = tmp_path / "there"
    config = cfg(tmp_path, there)
    code, _, err = run(capsys, "profile", "import", str(exported), "--config", config)
    assert code == 2
    assert "gpu.names: ['NVIDIA GeForce RTX 4090'] -> ['NVIDIA L40S']" in err
    assert "gpu.memory_gib: [24.0] -> [48.0]" in err
    assert ProfileStore(there).all() == []
    code, out, _ = run(capsys, "profile", "import", str(exported), "--config", config, "--force")
    assert code == 0
    assert "imported because of --force" in out and "NVIDIA L40S" in out
    saved = ProfileStore(there).lookup(box["fp"])
    assert saved is not None and saved.imported is not None


def test_import_of_a_corrupt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], box: dict[str, Any]
) -> None:
    src = tmp_path / "in.json"
    src.write_text("not json")
    code, _, err = run(capsys, "profile", "import", str(src), "--config", cfg(tmp_path, tmp_path / "s"))
    assert code == 2
    assert "not valid JSON" in err
    assert src.read_text() == "not json"


# --- the served-model line (like ollama ps), a clean stop, --watch ----------------------------------


@pytest.mark.timeout(60)
def test_one_line_per_served_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    daemon = start(sleepers, r1sup_like(tmp_path))
    write_status(
        state, daemon.pid, None, url="http://127.0.0.1:1/v1", max_model_len=4096, kv_cache_tokens=230304,
        memory_gib=21.37, since=now_iso(-3725), capacity=CAPACITY,
    )  # fmt: skip
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    header, row = out.splitlines()[:2]
    assert header.split() == "MODEL URL CONTEXT REQUESTS TOKENS/S MEMORY UPTIME STATE".split()
    cells = re.split(r"\s{2,}", row)
    # what the probe proved: 4 requests at once, 96.5 output tokens/s
    assert cells[:5] == ["qwen", "http://127.0.0.1:1/v1", "4096", "4", "96.5"]
    assert cells[5] == "21.4 GiB (vLLM's account)"  # no child running: vLLM's own figures
    assert re.fullmatch(r"1:02:0\d", cells[6]), row  # serving for an hour and two minutes
    assert cells[7] == "serving"
    assert "  capacity: measured: 4 request(s) at once of ~4,000 tokens (96.5 output tok/s, TTFT" in out

    code, out, _ = run(capsys, "status", "--state-dir", str(state), "--verbose")
    header, row = out.splitlines()[:2]
    assert (
        header.split()
        == (
            "MODEL URL CONTEXT REQUESTS TOKENS/S MEMORY KV TOKENS KV USE TTFT P50/P95 LAUNCHES PROFILE "
            "UPTIME STATE"
        ).split()
    )
    cells = re.split(r"\s{2,}", row)
    assert cells[6:11] == [
        "230,304",
        "-",
        "0.21/0.40s",
        "2",
        "persisted",
    ]  # nothing answers /metrics on port 1
    report = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])
    (served,) = report["served"]
    assert served["context"] == 4096 and served["state"] == "serving" and served["uptime_s"] >= 3725
    assert (served["requests"], served["output_tokens_per_second"], served["reduced"]) == (4, 96.5, False)


CAPACITY = {
    "requests": 4,
    "context_tokens": 4096,
    "probe_tokens": 4000,
    "output_tokens_per_second": 96.5,
    "ttft_p50_s": 0.21,
    "ttft_p95_s": 0.4,
    "kv_cache_tokens": 230304,
    "asked_requests": 4,
    "asked_context": 4096,
    "reduced": False,
    "reduced_because": [],
}


@pytest.mark.timeout(60)
def test_a_reduced_configuration_says_so_on_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    daemon = start(sleepers, r1sup_like(tmp_path))
    reduced = {
        **CAPACITY,
        "requests": 1,
        "reduced": True,
        "reduced_because": ["1 request(s) at once of 4 asked"],
    }
    write_status(state, daemon.pid, None, url="http://127.0.0.1:1/v1", capacity=reduced)
    row = run(capsys, "status", "--state-dir", str(state))[1].splitlines()[1]
    assert re.split(r"\s{2,}", row)[3] == "1"
    assert row.endswith("serving, REDUCED: 1 request(s) at once of 4 asked"), row


@pytest.mark.timeout(60)
def test_memory_is_vllms_gpu_account_not_the_host_rss_of_its_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """A GPU engine whose processes NVML does not show to this command (no driver here, another PID
    namespace): the MEMORY column is vLLM's own account of the GPU memory, not the few MiB of host
    memory its processes hold."""
    state = tmp_path / "state"
    daemon = start(sleepers, r1sup_like(tmp_path))
    child = start(sleepers, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    write_status(state, daemon.pid, child.pid, memory_gib=15.62, capacity=CAPACITY)
    row = run(capsys, "status", "--state-dir", str(state))[1].splitlines()[1]
    assert re.split(r"\s{2,}", row)[5] == "15.6 GiB (vLLM's account)", row
    # without vLLM's account (a status.json of an engine that printed no figures): the host RSS
    write_status(state, daemon.pid, child.pid)
    row = run(capsys, "status", "--state-dir", str(state))[1].splitlines()[1]
    assert re.fullmatch(r"\d+ MiB \(host RSS\)", re.split(r"\s{2,}", row)[5]), row


@pytest.mark.timeout(60)
def test_loading_progress_counts_on_from_the_status_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    daemon = start(sleepers, r1sup_like(tmp_path))
    progress = {"phase": "weights", "label": "loading weights", "percent": 45.0,
                "launch_started_at": now_iso(-95), "eta_at": now_iso(70)}  # fmt: skip
    write_status(state, daemon.pid, None, state="launching", attempt=2, progress=progress)
    out = run(capsys, "status", "--state-dir", str(state))[1]
    row = out.splitlines()[1]
    assert re.search(r"launching: loading weights 45%, 1:3\d elapsed, ETA 1:[01]\d \(attempt 2\)", row), row


@pytest.mark.timeout(60)
def test_a_clean_stop_reads_as_stopped_not_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "state"
    proc = start(sleepers, r1sup_like(tmp_path))
    proc.kill()
    proc.wait(timeout=10)
    write_status(state, proc.pid, None, state="stopped")
    out = run(capsys, "status", "--state-dir", str(state))[1]
    assert "daemon: stopped at " in out and f"(pid {proc.pid} has exited)" in out
    assert "stale" not in out
    assert out.splitlines()[1].split()[-1] == "stopped"
    d = json.loads(run(capsys, "status", "--state-dir", str(state), "--json")[1])["daemon"]
    assert (d["alive"], d["stale"]) == (False, False)
    write_status(state, proc.pid, None, state="probing")  # vanished mid-way: that is stale
    out = run(capsys, "status", "--state-dir", str(state))[1]
    assert "daemon: not running (stale status: last state probing" in out
    assert out.splitlines()[1].split()[-1] == "stale"


def test_instances_of_the_systemd_template_each_get_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "r1sup"
    for name, port in (("qwen", 8001), ("llama", 8002)):
        write_status(base / name, 999_999_99, None, state="stopped", served_model=name, port=port)
    out = run(capsys, "status", "--state-dir", str(base))[1]
    rows = out.splitlines()[1:3]
    assert [r.split()[0] for r in rows] == ["llama", "qwen"]
    assert "http://127.0.0.1:8002/v1" in rows[0] and rows[0].split()[-1] == "stopped"
    assert f"instance {base / 'qwen'}:" in out


def test_no_vllm_none_for_an_unknown_engine_version() -> None:
    from r1sup.cli.commands.status import box_summary

    fp = {"gpu": {"names": ["L4"], "count": 1}, "versions": {"vllm": None, "torch": "2.9.0"}}
    assert box_summary(fp) == "1x L4; torch 2.9.0, vllm version unknown"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_watch_redraws_until_ctrl_c(tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]) -> None:
    import signal

    state = tmp_path / "state"
    write_status(state, start(sleepers, r1sup_like(tmp_path)).pid, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "r1sup.cli.app", "status", "--state-dir", str(state), "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # Ctrl-C as a terminal delivers it: an ignored SIGINT left in this test process by an earlier
        # in-process test would be inherited and make the watch deaf to it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        frames = 0
        while frames < 3:
            line = proc.stdout.readline().decode()
            assert line, "status --watch ended on its own"
            frames += line.startswith("--- ")
        proc.send_signal(signal.SIGINT)
        # read what it still writes: a pipe left full would block its last frame, not a terminal
        proc.communicate(timeout=20)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    bad = subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "status", "--state-dir", str(state), "--watch", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--watch: must be a positive number" in bad.stderr


# --- what a status file or a profile holds is data, never a crash or a terminal command (issue 34) -----


def _status_cli(state: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """``r1sup status`` in a child whose stdout is a pipe in UTF-8: a lone surrogate cannot be written."""
    return subprocess.run(
        [sys.executable, "-m", "r1sup.cli.app", "status", "--state-dir", str(state), *extra],
        capture_output=True, timeout=60, env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_nan_and_lone_surrogates_are_set_aside_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    good = make_profile()
    ProfileStore(state).save(good)
    nan_profile = state / "profiles" / "00000000aaaaaaaa.json"
    text = (state / "profiles" / f"{good.key}.json").read_text()
    assert '"p50_latency_s": 0.4' in text
    nan_profile.write_text(text.replace('"p50_latency_s": 0.4', '"p50_latency_s": NaN'))
    odd_profile = state / "profiles" / "00000000bbbbbbbb.json"
    odd_profile.write_text(text.replace('"served_name": "qwen"', '"served_name": "q\\udfff"'))
    cases = {
        "NaN": '{"schema_version": 1, "state": "serving", "pid": 1, "max_model_len": NaN}',
        "Infinity": '{"schema_version": 1, "state": "serving", "pid": 1, "launches": Infinity}',
        "a lone surrogate": '{"schema_version": 1, "state": "serving", "pid": 1, "served_model": "q\\ud800"}',
    }
    for what, document in cases.items():
        (state / "status.json").write_text(document)
        done = _status_cli(state)
        out = done.stdout.decode("utf-8")
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert f"daemon: status file unusable: not valid JSON ({what}" in out
        assert f"unusable: {nan_profile}: " in out  # the profile's own checks name the field
        assert f"unusable: {odd_profile}: not valid JSON (a lone surrogate" in out
        assert good.key in out
        report = json.loads(_status_cli(state, "--json").stdout)
        assert report["daemon"]["problem"].startswith("not valid JSON")


@pytest.mark.timeout(60)
def test_terminal_escapes_in_a_status_file_are_shown_not_sent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_status(
        state,
        999_999_99,
        None,
        state="serving\x1b[2J",
        status="draining\x1b]0;owned\x07",
        served_model="qwen\x9b31m",
        recent_events=[{"ts": now_iso(), "event": "launch_started\r", "note": "\u202eevil"}],
    )
    done = _status_cli(state)
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode("utf-8")
    assert all(ch == "\n" or ch.isprintable() for ch in out), repr(out)
    assert "status: draining\\x1b]0;owned\\x07" in out
    assert "last state serving\\x1b[2J" in out
    assert "launch_started\\x0d" in out and "note=\\u202eevil" in out
    assert "qwen\\x9b31m" in out
    assert json.loads(_status_cli(state, "--json").stdout)["daemon"]["status"] == "draining\x1b]0;owned\x07"


@pytest.mark.timeout(30)  # on the old code 1e-7 redraws without end
@pytest.mark.parametrize("seconds", ["inf", "1e300", "nan", "1e-7", "-1"])
def test_watch_outside_its_bounds_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seconds: str
) -> None:
    code, out, err = run(capsys, "status", "--state-dir", str(tmp_path), "--watch", seconds)
    assert code == 2 and out == ""
    said = f"--watch: must be a positive number of seconds from 0.1 to 86400, got {float(seconds)}"
    assert err.strip().endswith(said)


# --- issue 36: one answer to each question, in words ----------------------------------------------

PROBE_RECORD = {
    "ok": True,
    "requests": 4,
    "succeeded": 4,
    "concurrency": 4,
    "prompt_tokens": 3990,
    "sizing": {"model": "qwen", "prompt_tokens": 3990, "prompts": [{"words": 2000, "tokens": 3990}]},
    "sizing_reused": False,
    "tokenize_calls": 16,
    "ttft_p50_s": 0.31,
    "ttft_p95_s": 0.52,
    "output_tokens_per_s": 40.2,
    "peak_kv_usage": 0.07,
    "preemptions": 0,
    "concurrency_proven": 4,
}


@pytest.mark.timeout(60)
def test_status_shows_no_internals_and_no_change_of_state_that_is_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sleepers: list[subprocess.Popen[bytes]]
) -> None:
    from dataclasses import replace

    state = tmp_path / "state"
    profile = replace(make_profile(), probe=PROBE_RECORD, capacity=CAPACITY)
    assert ProfileStore(state).save(profile) is not None
    daemon = start(sleepers, r1sup_like(tmp_path))
    events = [
        {"ts": now_iso(-70), "event": "state_changed", "old": "starting", "new": "planning"},
        {"ts": now_iso(-69), "event": "state_changed", "old": "planning", "new": "planning"},
        {"ts": now_iso(-60), "event": "state_changed", "old": "planning", "new": "launching"},
    ]
    write_status(state, daemon.pid, None, recent_events=events, capacity=CAPACITY)
    code, out, _ = run(capsys, "status", "--state-dir", str(state))
    assert code == 0
    for raw in ("sizing", "tokenize_calls", "sizing_reused", "{"):
        assert raw not in out, (raw, out)
    assert "old=planning new=planning" not in out
    assert "old=starting new=planning" in out and "old=planning new=launching" in out
    probe = next(line for line in out.splitlines() if line.startswith("    probe: "))
    assert (
        probe
        == "    probe: 4/4 ok at concurrency 4, prompts of 3,990 tokens, peak KV usage 7%, preemptions 0"
    )
    # TTFT and tokens/s once each per profile: the capacity line's, measured at its requests at once
    profile_lines = out[out.index("profiles:") :]
    assert profile_lines.count("TTFT") == 1 and "TTFT p50 0.21s p95 0.40s" in profile_lines
