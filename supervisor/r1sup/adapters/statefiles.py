"""Safe state files: the state directory, atomic JSON writes, and reads that never crash on bad content.

Every file r1sup keeps (profiles, ``status.json``) is one JSON object with a ``schema_version``. Writes go
to a temporary file in the same directory (created with ``O_EXCL``, its mode set before the rename), are
flushed and fsynced, replace the old file with ``os.replace`` and fsync the directory, so a crash at any
point leaves either the old file or the new one. A file that cannot be used (a symlink, too large,
truncated, not JSON, not an object, another schema) is moved aside to ``<name>.bad-<UTC timestamp>``,
never deleted and never overwritten, with a ``state_file_set_aside`` event.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import re
import stat
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from r1sup.adapters.logs import get_logger
from r1sup.core.errors import EXIT_CONFIG, EXIT_INTERNAL, ConfigError, R1supError

SCHEMA_VERSION = 1
MAX_STATE_FILE_BYTES = 4 * 1024 * 1024  # larger files are set aside unread
DIR_MODE = 0o700
FILE_MODE = 0o600
STALE_TEMP_AGE_S = 3600.0  # a temporary file this old is left over from a crash, whoever wrote it

# .<name>.<pid>.<8 hex>.tmp
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")


class StateWriteError(R1supError):
    """A state file could not be written; the previous version of the file is intact."""

    exit_code = EXIT_INTERNAL


def utc_now_iso(offset_s: float = 0.0, *, zulu: bool = True, now: datetime | None = None) -> str:
    """The one timestamp of r1sup: ``now`` (default: the clock) plus ``offset_s`` seconds, ISO 8601 UTC to
    the second. ``Z`` for the state files (profiles, run records, the fleet store); ``+00:00`` (``zulu``
    False) where the daemon's state and events always wrote it. :func:`parse_iso` reads both."""
    at = (now or datetime.now(timezone.utc)).astimezone(timezone.utc) + timedelta(seconds=offset_s)
    text = at.isoformat(timespec="seconds")
    return text[: -len("+00:00")] + "Z" if zulu else text


def utc_name_stamp(now: datetime | None = None) -> str:
    """:func:`utc_now_iso`'s instant without separators (``20261205T183000Z``), for a file name or a
    run's id, where ``:`` is no good."""
    return (now or datetime.now(timezone.utc)).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def parse_iso(text: str) -> datetime:
    """Parse an ISO 8601 timestamp (``Z`` accepted on Python 3.10 too); naive values count as UTC."""
    value = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


# --- the state directory -----------------------------------------------------------------------


def ensure_state_dir(path: str | os.PathLike[str]) -> Path:
    """Create the state directory with mode 0700 (parents as needed) and return the path to use.

    A symlink at ``path`` is accepted only when it points to a directory owned by this user (the
    resolved directory is returned); any other symlink, or a path that is not a directory, is a
    :class:`ConfigError` on ``state.dir``. An existing directory is never chmod-ed (r1sup did not
    create it): one that every user may write to (a 1777 ``/tmp``) is refused, one that others can
    read gets a ``state_dir_insecure`` warning and is used as it is.
    """
    return _ensure_dir(Path(path), "state.dir", allow_symlink=True)


def ensure_subdir(state_dir: Path, name: str) -> Path:
    """A 0700 directory inside the state directory; here no symlink is accepted at all."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid state subdirectory name {name!r}")
    return _ensure_dir(state_dir / name, "state.dir", allow_symlink=False)


def _ensure_dir(path: Path, field: str, *, allow_symlink: bool) -> Path:
    log = get_logger()
    created = False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(field, f"cannot inspect {path}: {exc.strerror}") from None
    if st is None:
        try:
            if not path.parent.exists():
                os.makedirs(path.parent, exist_ok=True)
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass  # created meanwhile by someone else; inspected below like any existing entry
        except OSError as exc:
            raise ConfigError(field, f"cannot create {path}: {exc.strerror}") from None
        else:
            created = True
            log.info("state_dir_created", path=str(path))
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise ConfigError(field, f"cannot inspect {path}: {exc.strerror}") from None
    target = path
    if stat.S_ISLNK(st.st_mode):
        if not allow_symlink:
            raise ConfigError(field, f"{path} is a symlink; r1sup does not write through symlinks here")
        target = Path(os.path.realpath(path))
        try:
            st = os.stat(target)
        except OSError:
            raise ConfigError(field, f"{path} is a symlink to a missing target ({target})") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ConfigError(
                field, f"{path} is a symlink to {target}, which is not a directory owned by this user"
            )
    elif not stat.S_ISDIR(st.st_mode):
        raise ConfigError(field, f"{path} exists and is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if created:
        return target
    # a directory r1sup did not create is never chmod-ed (it may be shared: a 1777 /tmp, a volume);
    # what r1sup writes in it is private anyway (files 0600, its own subdirectories 0700)
    if mode & 0o002:
        raise ConfigError(
            field,
            f"{target} is writable by every user (mode {oct(mode)}); give r1sup a directory of its own "
            "(a path that does not exist yet is created 0700)",
        )
    if mode & 0o077:
        _warn_open_dir(str(target), mode, st.st_uid)
    return target


@functools.lru_cache(maxsize=64)
def _warn_open_dir(path: str, mode: int, owner_uid: int) -> None:
    """Once per directory and mode in a process (the state directory is checked at every write)."""
    get_logger().warning(
        "state_dir_insecure",
        path=path,
        mode=oct(mode),
        owner_uid=owner_uid,
        reason="group or others can access it; r1sup did not create it and leaves its mode alone",
    )


# --- one r1sup per state directory -------------------------------------------------------------

LOCK_NAME = "r1sup.lock"


class StateDirBusy(ConfigError):
    """Another r1sup (``run`` or ``tune``) holds the state directory's lock. Exit 2."""

    exit_code = EXIT_CONFIG

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        self.holder = holder
        pid = holder.get("pid", "?")
        command = str(holder.get("command") or "another r1sup")[:200]
        super().__init__(
            "state.dir",
            f"{path} is in use by pid {pid} ({command}); one r1sup per state directory: stop that one "
            "first (systemctl stop r1sup@NAME), or give this one its own --state-dir and server.port",
        )


class StateLock:
    """An advisory ``flock`` on ``<state dir>/r1sup.lock``, held until :meth:`release` or the process
    ends (the kernel drops it then, also after a SIGKILL). The file says who holds it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def lock_state_dir(state_dir: str | os.PathLike[str], command: str) -> StateLock:
    """Take the state directory's lock for this process's life, or raise :class:`StateDirBusy` at once
    naming the holder's pid and command. ``command`` is what the holder file says of this process."""
    directory = ensure_state_dir(state_dir)
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError("state.dir", f"{path} is a symlink; r1sup does not follow it") from None
        raise ConfigError("state.dir", f"cannot open {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError("state.dir", f"{path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateDirBusy(directory, _lock_holder(fd)) from None
        except OSError as exc:
            raise ConfigError("state.dir", f"cannot lock {path}: {exc.strerror}") from None
        record = {"pid": os.getpid(), "command": command[:500], "since": utc_now_iso()}
        data = (json.dumps(record) + "\n").encode("utf-8")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as exc:  # the lock holds without the note; a second r1sup then names no pid
            get_logger().warning("state_lock_note_failed", path=str(path), error=exc.strerror)
    except BaseException:
        os.close(fd)
        raise
    sweep_stale_temp_files(directory)  # ours to sweep now: no other r1sup writes here
    return StateLock(path, fd)


def _lock_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


# --- writing -----------------------------------------------------------------------------------


def atomic_write_json(path: Path, obj: Any, mode: int = FILE_MODE) -> None:
    """Write ``obj`` as JSON to ``path`` atomically with file mode ``mode``.

    Raises :class:`StateWriteError` (old file intact, temporary file removed) on any OSError, when
    ``path`` is a symlink or not a regular file, when ``obj`` is not JSON-serializable, or when the
    text would exceed :data:`MAX_STATE_FILE_BYTES`.
    """
    path = Path(path)
    try:
        data = (json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise StateWriteError(f"cannot write {path}: not serializable as JSON ({exc})") from None
    if len(data) > MAX_STATE_FILE_BYTES:
        raise StateWriteError(
            f"cannot write {path}: {len(data)} bytes is over the {MAX_STATE_FILE_BYTES}-byte limit"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise StateWriteError(f"cannot write {path}: {exc.strerror}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise StateWriteError(f"refusing to write {path}: it is a symlink")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise StateWriteError(f"refusing to write {path}: it exists and is not a regular file")

    directory = path.parent
    tmp = directory / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = -1
    replaced = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        os.fchmod(fd, mode)  # the umask may have removed bits; the mode is exact before the replace
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        replaced = True
    except OSError as exc:
        raise StateWriteError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        if not replaced:
            _unlink_quietly(tmp)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        get_logger().warning("state_dir_fsync_failed", path=str(directory), error=exc.strerror)
        return
    try:
        os.fsync(dfd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot fsync a directory
            get_logger().warning("state_dir_fsync_failed", path=str(directory), error=exc.strerror)
    finally:
        os.close(dfd)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        get_logger().warning("state_temp_file_left", path=str(path), error=exc.strerror)


def remove_stale_temp_files(directory: Path, *, max_age_s: float = STALE_TEMP_AGE_S) -> list[Path]:
    """Remove temporary files left by a writer that crashed between write and replace.

    A temporary file is stale when the process named in it is gone or when it is older than
    ``max_age_s`` seconds. Returns the files removed (each logged as ``stale_temp_file_removed``).
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()  # wall clock: compared with file modification times
    for name in names:
        m = _TEMP_RE.match(name)
        if not m:
            continue
        path = Path(directory) / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or (pid_alive(pid) and now - st.st_mtime < max_age_s):
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        get_logger().info("stale_temp_file_removed", path=str(path), writer_pid=pid)
    return removed


def sweep_stale_temp_files(state_dir: Path) -> list[Path]:
    """:func:`remove_stale_temp_files` in the state directory and in each of its subdirectories (not
    through symlinks): the run records' and profiles' temporary files as well as status.json's."""
    removed = remove_stale_temp_files(state_dir)
    try:
        entries = list(os.scandir(state_dir))
    except OSError:
        return removed
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                removed += remove_stale_temp_files(Path(entry.path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


# --- reading -----------------------------------------------------------------------------------


def inspect_json(
    path: Path,
    *,
    expect_schema: int | None = SCHEMA_VERSION,
    follow_symlinks: bool = False,
    max_bytes: int = MAX_STATE_FILE_BYTES,
    finite: bool = False,
) -> tuple[dict[str, Any] | None, str | None]:
    """Read ``path`` without changing anything: ``(object, None)``, ``(None, None)`` when it is
    missing, or ``(None, reason)`` when it cannot be used. Never raises for bad content.
    ``expect_schema=None`` skips the ``schema_version`` check. A lone surrogate (``"\\ud800"``, which
    no encoding can write back) makes the file unusable; with ``finite`` so does NaN or Infinity
    (also as ``1e400``), which r1sup never writes (readers that check each field leave it off, to
    name the field).
    """
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks and os.path.islink(path):
            return None, "a symlink (r1sup does not follow symlinks in its state directory)"
        return None, f"cannot be read: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size > max_bytes:
            return None, f"too large ({st.st_size} bytes, limit {max_bytes})"
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                return None, f"too large (more than {max_bytes} bytes)"
    except OSError as exc:
        return None, f"cannot be read: {exc.strerror}"
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if not raw.strip():
        return None, "empty (truncated)"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start})"
    try:
        obj = (
            json.loads(text, parse_constant=_no_constant, parse_float=_finite) if finite else json.loads(text)
        )
    except _NotWritten as exc:
        return None, f"not valid JSON ({exc})"
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated")
        what = "truncated JSON" if truncated else "not valid JSON"
        return None, f"{what} ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except (RecursionError, ValueError) as exc:
        return None, f"not valid JSON ({type(exc).__name__})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object (a {type(obj).__name__})"
    if "\\ud" in text.lower() and not _encodable(obj):
        return None, "not valid JSON (a lone surrogate escape, which r1sup never writes)"
    if expect_schema is not None:
        found = obj.get("schema_version")
        if found != expect_schema or isinstance(found, bool):
            if "schema_version" not in obj:
                return None, "no schema_version"
            return None, f"schema_version {found!r}, this r1sup reads {expect_schema}"
    return obj, None


class _NotWritten(ValueError):
    """A JSON value r1sup never writes (its writers pass ``allow_nan=False``)."""


def _no_constant(name: str) -> Any:
    raise _NotWritten(f"{name}, which r1sup never writes")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: Infinity by another name
        raise _NotWritten(f"{text[:20]}, out of a float's range")
    return value


def _encodable(obj: Any) -> bool:
    """Whether ``obj`` can be written as UTF-8 (a lone surrogate, from a ``\\udXXX`` escape, cannot)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


def read_json(
    path: Path,
    *,
    expect_schema: int = SCHEMA_VERSION,
    kind: str = "profile",
    set_aside: bool = True,
) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing or unusable.

    An unusable file (symlink, too large, truncated or not JSON, not an object, another schema) is
    moved aside with a ``state_file_set_aside`` warning, or with ``set_aside=False`` (read-only
    callers such as ``r1sup status``) only reported as ``state_file_invalid``. Never raises for bad
    content.
    """
    obj, problem = inspect_json(path, expect_schema=expect_schema)
    if problem is None:
        return obj
    if set_aside:
        set_file_aside(path, problem, kind=kind)
    else:
        get_logger().warning("state_file_invalid", path=str(path), reason=problem, kind=kind)
    return None


def set_file_aside(path: Path, reason: str, *, kind: str = "profile") -> Path | None:
    """Move ``path`` (the entry itself, never a symlink's target) to ``<name>.bad-<UTC timestamp>``.

    Never overwrites an existing file: a numbered suffix is added when the name is taken. Logs
    ``state_file_set_aside`` (path, reason, moved_to); returns the new path, or None when the move
    failed (logged as ``state_file_set_aside_failed``).
    """
    path = Path(path)
    log = get_logger()
    stamp = utc_name_stamp()
    last_error = "no free name"
    for n in range(100):
        dest = path.with_name(f"{path.name}.bad-{stamp}" + (f"-{n}" if n else ""))
        if os.path.lexists(dest):
            continue
        try:
            _move_no_replace(path, dest)
        except FileExistsError:
            continue
        except FileNotFoundError:
            return None  # gone meanwhile: nothing left to protect
        except OSError as exc:
            last_error = exc.strerror or str(exc)
            break
        log.warning("state_file_set_aside", path=str(path), reason=reason, moved_to=str(dest), kind=kind)
        return dest
    log.warning("state_file_set_aside_failed", path=str(path), reason=reason, error=last_error, kind=kind)
    return None


def _move_no_replace(src: Path, dest: Path) -> None:
    """Rename without replacing: a hard link (fails if ``dest`` exists) then unlink; for entries
    that cannot be hard-linked (directories, some file systems) a rename after an existence check."""
    try:
        os.link(src, dest, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if os.path.lexists(dest):
            raise FileExistsError(errno.EEXIST, "exists", str(dest)) from None
        os.rename(src, dest)
        return
    os.unlink(src)
