"""State files: atomic writes that survive crashes, reads that set bad files aside, a private state dir."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from conftest import wait_until
from r1sup.adapters import statefiles
from r1sup.adapters.statefiles import (
    MAX_STATE_FILE_BYTES,
    SCHEMA_VERSION,
    StateWriteError,
    atomic_write_json,
    ensure_state_dir,
    ensure_subdir,
    inspect_json,
    read_json,
    remove_stale_temp_files,
    set_file_aside,
)
from r1sup.core.errors import ConfigError

OLD = {"schema_version": SCHEMA_VERSION, "value": "old"}
NEW = {"schema_version": SCHEMA_VERSION, "value": "new"}


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def temp_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".tmp"))


def bad_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.bad-*"))


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Other tests run ``r1sup.cli.app.main``, which points structlog at their captured stdout with a
    level filter; start and end each test with structlog's defaults."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


# --- atomic writes -----------------------------------------------------------------------------


def test_atomic_write_creates_0600_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "p.json"
    old_umask = os.umask(0)  # the mode must not depend on the umask
    try:
        atomic_write_json(target, OLD)
    finally:
        os.umask(old_umask)
    assert json.loads(target.read_text()) == OLD
    assert mode_of(target) == 0o600
    assert temp_files(tmp_path) == []
    atomic_write_json(target, NEW, mode=0o640)
    assert json.loads(target.read_text()) == NEW
    assert mode_of(target) == 0o640


def test_replace_failure_keeps_old_file_and_removes_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "p.json"
    atomic_write_json(target, OLD)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(StateWriteError, match="Input/output error"):
        atomic_write_json(target, NEW)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == OLD
    assert temp_files(tmp_path) == []
    assert StateWriteError.exit_code == 1


CRASHING_WRITER = """
import os, sys
from pathlib import Path
from r1sup.adapters import statefiles

target, marker = Path(sys.argv[1]), Path(sys.argv[2])

def blocked_replace(src, dst):
    marker.touch()  # the temporary file is written and fsynced; now wait to be killed
    sys.stdin.read()

os.replace = blocked_replace
statefiles.atomic_write_json(target, {"schema_version": 1, "value": "new"})
"""


@pytest.mark.timeout(60)
def test_crash_between_write_and_replace_keeps_old_file(tmp_path: Path) -> None:
    """A real writer process is SIGKILLed after writing its temporary file, before the replace."""
    state = tmp_path / "state"
    state.mkdir()
    target = state / "p.json"
    atomic_write_json(target, OLD)
    marker = tmp_path / "at-replace"
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHING_WRITER, str(target), str(marker)],
        stdin=subprocess.PIPE,
    )
    try:
        wait_until(marker.exists, timeout=30, what="the writer to reach os.replace")
        leftovers = temp_files(state)
        assert len(leftovers) == 1
        assert json.loads(leftovers[0].read_text()) == NEW  # fully written, not yet in place
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert read_json(target) == OLD
    assert temp_files(state) == leftovers
    with capture_logs() as logs:
        assert remove_stale_temp_files(state) == leftovers  # its writer is dead
    assert events(logs, "stale_temp_file_removed")[0]["writer_pid"] == proc.pid
    atomic_write_json(target, NEW)
    assert read_json(target) == NEW
    assert temp_files(state) == []


def test_stale_temp_files_of_a_live_writer_are_kept_unless_old(tmp_path: Path) -> None:
    live = tmp_path / f".p.json.{os.getppid()}.0123abcd.tmp"
    live.write_text("{}")
    other = tmp_path / "notes.tmp"
    other.write_text("not ours")
    assert remove_stale_temp_files(tmp_path) == []
    hour_ago = time.time() - 2 * statefiles.STALE_TEMP_AGE_S
    os.utime(live, (hour_ago, hour_ago))
    assert remove_stale_temp_files(tmp_path) == [live]
    assert other.exists()


def test_disk_full_while_writing_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "p.json"
    atomic_write_json(target, OLD)
    real_write = os.write

    def full_disk_write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_write)
    with pytest.raises(StateWriteError, match="No space left on device"):
        atomic_write_json(target, NEW)
    monkeypatch.undo()
    assert read_json(target) == OLD
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize(
    ("obj", "fragment"),
    [
        ({"schema_version": 1, "x": object()}, "not serializable"),
        ({"schema_version": 1, "x": float("nan")}, "not serializable"),
        ({"schema_version": 1, "x": "a" * MAX_STATE_FILE_BYTES}, "over the"),
    ],
)
def test_unwritable_content_is_refused_before_touching_the_file(
    tmp_path: Path, obj: object, fragment: str
) -> None:
    target = tmp_path / "p.json"
    atomic_write_json(target, OLD)
    with pytest.raises(StateWriteError, match=fragment):
        atomic_write_json(target, obj)
    assert read_json(target) == OLD
    assert temp_files(tmp_path) == []


def test_write_refuses_a_symlink_and_leaves_its_target_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    state = tmp_path / "state"
    state.mkdir()
    link = state / "p.json"
    link.symlink_to(outside)
    with pytest.raises(StateWriteError, match="symlink"):
        atomic_write_json(link, NEW)
    assert outside.read_text() == "precious"
    assert link.is_symlink()
    assert temp_files(state) == []


def test_write_refuses_a_directory_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "p.json").mkdir()
    with pytest.raises(StateWriteError, match="not a regular file"):
        atomic_write_json(tmp_path / "p.json", NEW)


# --- reads that set bad files aside --------------------------------------------------------------


def _huge() -> bytes:
    return b'{"schema_version": 1, "pad": "' + b"x" * MAX_STATE_FILE_BYTES + b'"}'


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b'{"schema_version": 1, "value": "ol', "truncated JSON"),
        (b"", "empty"),
        (b"   \n", "empty"),
        (b"schema_version = 1\n", "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2, 3]", "not a JSON object"),
        (b'"text"', "not a JSON object"),
        (b'{"value": "old"}', "no schema_version"),
        (b'{"schema_version": 2, "value": "future"}', "schema_version 2, this r1sup reads 1"),
        (b'{"schema_version": "1"}', "schema_version '1'"),
        (b'{"schema_version": true}', "schema_version True"),
        (b"[" * 100000 + b"]" * 100000, "not"),
        (_huge(), "too large"),
    ],
    ids=[
        "truncated",
        "empty",
        "blank",
        "toml",
        "binary",
        "list",
        "string",
        "no-schema",
        "future-schema",
        "schema-string",
        "schema-bool",
        "deep-nesting",
        "huge",
    ],
)
def test_unusable_file_is_set_aside_with_an_event(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with capture_logs() as logs:
        assert read_json(path, kind="profile") is None
    aside = events(logs, "state_file_set_aside")
    assert len(aside) == 1, logs
    assert fragment in aside[0]["reason"]
    assert aside[0]["path"] == str(path)
    assert aside[0]["kind"] == "profile"
    moved = Path(aside[0]["moved_to"])
    assert moved.parent == tmp_path
    assert moved.name.startswith("p.json.bad-")
    assert moved.read_bytes() == content  # kept, byte for byte
    assert not path.exists()


def test_symlinked_state_file_is_set_aside_without_touching_the_target(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(OLD))
    state = tmp_path / "state"
    state.mkdir()
    link = state / "status.json"
    link.symlink_to(outside)
    with capture_logs() as logs:
        assert read_json(link, kind="status") is None
    (event,) = events(logs, "state_file_set_aside")
    assert "symlink" in event["reason"]
    moved = Path(event["moved_to"])
    assert moved.is_symlink() and os.readlink(moved) == str(outside)
    assert json.loads(outside.read_text()) == OLD
    assert not os.path.lexists(link)


def test_fifo_is_set_aside_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    os.mkfifo(path)
    with capture_logs() as logs:
        assert read_json(path) is None
    (event,) = events(logs, "state_file_set_aside")
    assert event["reason"] == "not a regular file"


def test_missing_file_is_none_without_events(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert read_json(tmp_path / "absent.json") is None
    assert logs == []


def test_valid_file_is_returned(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    atomic_write_json(path, OLD)
    assert read_json(path) == OLD
    assert inspect_json(path, expect_schema=None) == (OLD, None)


def test_read_only_callers_report_without_moving(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text("{broken")
    with capture_logs() as logs:
        assert read_json(path, kind="status", set_aside=False) is None
    (event,) = events(logs, "state_file_invalid")
    assert event["kind"] == "status"
    assert path.read_text() == "{broken"
    assert bad_files(path) == []


def test_set_aside_never_overwrites_an_earlier_backup(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    now = datetime.now(timezone.utc)
    taken = []
    for delta in (0, 1, 2):  # the names the next call can pick within the next two seconds
        stamp = (now + timedelta(seconds=delta)).strftime("%Y%m%dT%H%M%SZ")
        earlier = tmp_path / f"p.json.bad-{stamp}"
        earlier.write_text(f"earlier {delta}")
        taken.append(earlier)
    path.write_text("second bad version")
    moved = set_file_aside(path, "test", kind="profile")
    assert moved is not None and moved not in taken
    assert moved.read_text() == "second bad version"
    for delta, earlier in enumerate(taken):
        assert earlier.read_text() == f"earlier {delta}"


def test_set_aside_failure_is_logged_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "p.json"
    path.write_text("{")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "link", refuse)
    with capture_logs() as logs:
        assert read_json(path) is None
    (event,) = events(logs, "state_file_set_aside_failed")
    assert event["error"] == "Read-only file system"
    assert path.read_text() == "{"


# --- the state directory -----------------------------------------------------------------------


def test_state_dir_is_created_0700_with_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "state"
    with capture_logs() as logs:
        assert ensure_state_dir(str(target)) == target
    assert target.is_dir()
    assert mode_of(target) == 0o700
    assert events(logs, "state_dir_created")
    assert ensure_state_dir(target) == target  # idempotent


def test_an_existing_state_dir_is_never_chmodded(tmp_path: Path) -> None:
    """r1sup did not create it, so it leaves its mode alone (issue 26: a shared directory was locked
    to 0700); it says so once, and what it writes there is private anyway."""
    target = tmp_path / "state"
    target.mkdir()
    target.chmod(0o755)
    with capture_logs() as logs:
        ensure_state_dir(target)
        ensure_state_dir(target)
    assert mode_of(target) == 0o755
    (event,) = events(logs, "state_dir_insecure")
    assert event["mode"] == "0o755" and not events(logs, "state_dir_mode_tightened")
    assert mode_of(ensure_subdir(target, "profiles")) == 0o700  # created here: private
    atomic_write_json(target / "status.json", NEW)
    assert mode_of(target / "status.json") == 0o600


def test_a_symlink_to_an_open_dir_of_ours_is_not_chmodded(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o755)
    link = tmp_path / "state"
    link.symlink_to(real)
    assert ensure_state_dir(link) == real
    assert mode_of(real) == 0o755


def test_a_world_writable_state_dir_is_refused_not_chmodded(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ConfigError, match="writable by every user") as info:
        ensure_state_dir(shared)
    assert info.value.field == "state.dir"
    assert stat.S_IMODE(os.lstat(shared).st_mode) == 0o1777
    inside = ensure_state_dir(shared / "r1sup")  # a directory of its own in it: created 0700
    assert mode_of(inside) == 0o700


def test_stale_temp_files_are_swept_in_every_state_subdirectory(tmp_path: Path) -> None:
    state = ensure_state_dir(tmp_path / "state")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(dead.stdout)  # a process that has exited
    left = []
    for sub in ("", "runs", "profiles"):
        d = state / sub if sub else state
        d.mkdir(exist_ok=True)
        left.append(d / f".record.json.{pid}.0123abcd.tmp")
        left[-1].write_text("{")
    mine = state / "runs" / f".x.json.{os.getpid()}.0123abcd.tmp"
    mine.write_text("{")
    lock = statefiles.lock_state_dir(state, "r1sup tune")
    try:
        assert not any(p.exists() for p in left)
        assert mine.exists()  # a writer that is alive keeps its temporary file
    finally:
        lock.release()


def test_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "state"
    target.write_text("")
    with pytest.raises(ConfigError, match="not a directory") as info:
        ensure_state_dir(target)
    assert info.value.field == "state.dir"


def test_state_dir_symlink_to_our_own_dir_is_resolved(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "state"
    link.symlink_to(real)
    assert ensure_state_dir(link) == real


@pytest.mark.parametrize("kind", ["file", "dangling"])
def test_state_dir_symlink_elsewhere_is_refused(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("")
    link = tmp_path / "state"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink") as info:
        ensure_state_dir(link)
    assert info.value.field == "state.dir"


def _foreign_dir(tmp_path: Path) -> Path:
    """An existing 0755 directory owned by another user, or skip."""
    if os.geteuid() == 0:
        d = tmp_path / "foreign"
        d.mkdir()
        os.chown(d, 54321, 54321)
        d.chmod(0o755)
        return d
    for candidate in ("/usr/share", "/usr", "/etc"):
        st = os.stat(candidate)
        if st.st_uid != os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            return Path(candidate)
    pytest.skip("no directory owned by another user")


def test_state_dir_symlink_to_someone_elses_dir_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "state"
    link.symlink_to(_foreign_dir(tmp_path))
    with pytest.raises(ConfigError, match="not a directory owned by this user"):
        ensure_state_dir(link)


def test_open_state_dir_we_cannot_tighten_is_warned_about(tmp_path: Path) -> None:
    foreign = _foreign_dir(tmp_path)
    with capture_logs() as logs:
        assert ensure_state_dir(foreign) == foreign
    (event,) = events(logs, "state_dir_insecure")
    assert event["mode"] == oct(stat.S_IMODE(os.stat(foreign).st_mode))


def test_subdir_symlink_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    state = ensure_state_dir(tmp_path / "state")
    (state / "profiles").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symlink"):
        ensure_subdir(state, "profiles")
    with pytest.raises(ValueError):
        ensure_subdir(state, "../x")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tune_exits_1_when_the_profile_was_not_saved(tmp_path: Path) -> None:
    from test_tune_fake import QWEN_7B, fake_body, fake_scenario, run_tune

    body = fake_body(tmp_path, model=QWEN_7B)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "profiles").write_text("not a directory")  # the save cannot succeed
    tune = run_tune(tmp_path, body, fake_scenario(tmp_path, time_scale=0.01))
    assert tune.result["ok"] and tune.result["profile_path"] is None, tune.explain()
    assert tune.code == 1, tune.explain()
    assert tune.proc.named("profile_save_failed")
    assert any("profile was not saved" in line for line in tune.proc.stderr)


# --- state writing recovers (issue 26) -------------------------------------------------------------


class _Source:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = str(state_dir)
        self.n = 0

    def status_fields(self, recent: list) -> dict:
        self.n += 1
        return {"schema_version": SCHEMA_VERSION, "state": "serving", "n": self.n}


def test_a_status_json_symlink_is_set_aside_and_the_file_rewritten(tmp_path: Path) -> None:
    from r1sup.core import events as E
    from r1sup.supervision.subscribers import StatusFile

    state = ensure_state_dir(tmp_path / "state")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (state / "status.json").symlink_to(elsewhere)
    sink = StatusFile(_Source(state), structlog.get_logger())
    with capture_logs() as logs:
        sink(E.StatusText("serving"))
    assert not (state / "status.json").is_symlink()
    assert json.loads((state / "status.json").read_text())["state"] == "serving"
    assert elsewhere.read_text() == "{}"  # never written through
    assert [p.is_symlink() for p in bad_files(state / "status.json")] == [True]
    assert events(logs, "state_file_set_aside") and not events(logs, "status_write_failed")


def test_status_json_comes_back_when_the_disk_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r1sup.core import events as E
    from r1sup.supervision.subscribers import STATUS_RETRY_S, StatusFile

    state = ensure_state_dir(tmp_path / "state")
    real = statefiles.atomic_write_json
    full = {"on": True}

    def disk(path: Path, obj: object, mode: int = 0o600) -> None:
        if full["on"]:
            raise StateWriteError(f"cannot write {path}: No space left on device")
        real(path, obj, mode)

    monkeypatch.setattr(statefiles, "atomic_write_json", disk)
    sink = StatusFile(_Source(state), structlog.get_logger())
    with capture_logs() as logs:
        sink(E.StateChanged("probing", "serving"))
        sink(E.Heartbeat(100.0))
        sink(E.StatusText("x"))
        assert not (state / "status.json").exists()
        full["on"] = False  # space again; no change of state follows
        sink(E.Heartbeat(100.0 + STATUS_RETRY_S / 2))
        assert not (state / "status.json").exists()  # not before the retry interval
        sink(E.Heartbeat(100.0 + STATUS_RETRY_S))
    assert json.loads((state / "status.json").read_text())["state"] == "serving"
    assert len(events(logs, "status_write_failed")) == 1  # once, not at every try
    assert events(logs, "status_write_recovered")


def test_run_records_come_back_when_the_disk_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r1sup.core.config import build
    from r1sup.state import runrecord

    config = build({"model": {"name": "m"}, "state": {"dir": str(tmp_path / "state")}}, env={})
    real = runrecord.atomic_write_json
    full = {"on": True}

    def disk(path: Path, obj: object, mode: int = 0o600) -> None:
        if full["on"]:
            raise StateWriteError(f"cannot write {path}: No space left on device")
        real(path, obj, mode)

    monkeypatch.setattr(runrecord, "atomic_write_json", disk)
    monkeypatch.setattr(runrecord, "RETRY_S", 0.0)
    record = runrecord.RunLog(tmp_path / "state", "run", config, None)
    with capture_logs() as logs:
        assert record.save() is None
        record.attempt({"outcome": "failed"})
        full["on"] = False
        record.attempt({"outcome": "passed"})
    assert record.path is not None and record.path.exists()
    saved = json.loads(record.path.read_text())
    assert [a["outcome"] for a in saved["attempts"]] == ["failed", "passed"]
    assert len(events(logs, "run_record_not_saved")) == 1 and events(logs, "run_record_saved_again")
