"""A profile store shared by a fleet: look there before tuning, publish there after, one tune at a time.

``state.profile_store`` names a directory (a ReadWriteMany volume, an NFS export, any mounted path) or
an ``http(s)://`` URL, which is read-only. Both have one layout, so a directory store can be served
over HTTP as it is::

    <store>/profiles/<key>.json    a profile, exactly as the state directory keeps it
    <store>/leases/<key>.lease     the replica tuning <key> now (directory stores only)

The key is the fingerprint's (:func:`r1sup.state.profiles.fingerprint_key`): same GPUs, driver branch,
vLLM and torch versions, model, target and request. A replica without a local profile looks in the
store; a match is launched once. Without one it takes the key's lease, tunes, publishes (temporary
file, fsync, rename: a reader sees the old file or the new one, never half of one) and gives the lease
back. Replicas that find the lease taken wait, looking for the profile, until it appears (then one
launch each), the lease is released or expires (then one of them takes it), or
``state.profile_wait_s`` passes (then each tunes on its own).

The lease is a file created whole with ``link()`` of a written temporary file, which fails when the
name exists on every file system r1sup supports, NFS included, where ``fcntl`` locks are unreliable.
It holds the owner (a random token), host, pid and an expiry in wall-clock seconds (the only clock
replicas share), and its holder rewrites it every third of ``state.profile_lease_s`` from a thread.
A holder that dies stops renewing: once the expiry (plus :data:`CLOCK_SKEW_S`) has passed, a waiter
takes the lease over by renaming the file to a name of its own (one rename wins), checking that it
moved the record it judged stale (else it puts it back) and creating its own. A holder on this very
host, boot and PID namespace whose process is gone is taken over at once.

What this guarantees: no profile file is ever partly written, and one replica tunes a key at a time
while its holder renews. A holder that could not renew for a whole lease (a paused VM, a stalled
mount) may find another replica tuning beside it; both publish the same key atomically, and it logs
``profile_lease_lost``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from r1sup.adapters.statefiles import (
    MAX_STATE_FILE_BYTES,
    StateWriteError,
    atomic_write_json,
    inspect_json,
    utc_now_iso,
)
from r1sup.core.errors import ConfigError, R1supError
from r1sup.core.events import (
    FleetFileInvalid,
    FleetHit,
    FleetLeaseAcquired,
    FleetLeaseBreakFailed,
    FleetLeaseLost,
    FleetLeaseReleaseFailed,
    FleetLeaseTakenOver,
    FleetMiss,
    FleetPublished,
    FleetPublishFailed,
    FleetReadOnly,
    FleetUnavailable,
    FleetWaiting,
    FleetWaitTimeout,
    Publish,
)
from r1sup.state.profiles import KEY_RE, Profile

PROFILES = "profiles"
LEASES = "leases"
FILE_MODE = 0o644  # profiles hold no secret (the key is masked in the command) and are meant to be shared
DIR_MODE = 0o755
CLOCK_SKEW_S = 5.0  # tolerated difference between replicas' wall clocks
HTTP_TIMEOUT_S = 15.0  # one read of an HTTP store
HTTP_DEADLINE_S = 30.0  # a whole lookup of an HTTP store, from the connection to the last byte
TEMP_MAX_AGE_S = 3600.0  # a temporary file this old in the store is left over from a crash


def is_url(location: str) -> bool:
    return location.startswith(("http://", "https://"))


# --- the lease record (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says."""

    owner: str
    host: str
    pid: int
    boot_id: str | None
    pid_ns: int | None
    expires_at: float  # wall clock (time.time())
    key: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: Any) -> Holder:
        if not isinstance(data, dict):
            raise ValueError("not an object")
        try:
            return cls(
                owner=str(data["owner"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                boot_id=data.get("boot_id"),
                pid_ns=data.get("pid_ns"),
                expires_at=float(data["expires_at"]),
                key=str(data.get("key", "")),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: a pid of Infinity
            raise ValueError(f"bad lease record: {exc}") from None


@dataclass(frozen=True)
class Here:
    """This process as a lease holder would name it."""

    host: str
    pid: int
    boot_id: str | None
    pid_ns: int | None


def stale(holder: Holder, now: float, here: Here, pid_alive: Callable[[int], bool]) -> str | None:
    """Why ``holder``'s lease may be taken over, or None while it stands. A record no live holder would
    write (an expiry that is not a finite number, a pid below 1) counts as expired."""
    if not math.isfinite(holder.expires_at):
        return f"its expiry {holder.expires_at} is not a time"
    if holder.pid < 1:
        return f"its pid {holder.pid} is not a process"
    if now > holder.expires_at + CLOCK_SKEW_S:
        return f"expired {now - holder.expires_at:.0f}s ago"
    same_pid_space = (
        holder.host == here.host
        and holder.boot_id is not None
        and holder.boot_id == here.boot_id
        and holder.pid_ns is not None
        and holder.pid_ns == here.pid_ns
    )
    if same_pid_space and holder.pid != here.pid and not pid_alive(holder.pid):
        return f"its process {holder.pid} on this host is gone"
    return None


def this_process() -> Here:
    boot_id: str | None
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip() or None
    except OSError:
        boot_id = None
    try:
        pid_ns: int | None = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = None
    return Here(host=socket.gethostname(), pid=os.getpid(), boot_id=boot_id, pid_ns=pid_ns)


# --- stores ----------------------------------------------------------------------------------------


class StoreError(R1supError):
    """The shared store could not be read or written (the replica goes on without it)."""


class HttpStore:
    """A read-only store over HTTP(S): ``GET <url>/profiles/<key>.json``; 404 means none. A lookup has
    ``deadline_s`` in all, from the connection to the last byte: a server that answers a byte at a time
    cannot hold a replica back longer (each read also times out after ``timeout_s``)."""

    writable = False

    def __init__(
        self, url: str, timeout_s: float = HTTP_TIMEOUT_S, deadline_s: float = HTTP_DEADLINE_S
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s

    def __str__(self) -> str:
        return self.url

    def lookup(self, key: str) -> Profile | None:
        url = f"{self.url}/{PROFILES}/{_checked(key)}.json"
        box: dict[str, Any] = {}

        def fetch() -> None:
            try:
                box["raw"] = self._get(url, time.monotonic() + self.deadline_s)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc

        worker = threading.Thread(target=fetch, name="profile-store-get", daemon=True)
        worker.start()
        worker.join(self.deadline_s)
        if worker.is_alive():  # it stops reading at the deadline: left to end on its own
            raise StoreError(f"{url}: no whole answer within {self.deadline_s:g} s")
        if "error" in box:
            raise box["error"]
        raw: bytes | None = box["raw"]
        if raw is None:
            return None
        try:
            return _profile(json.loads(raw.decode("utf-8")), key)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise StoreError(f"{url}: not a usable profile ({reason})") from None

    def _get(self, url: str, deadline: float) -> bytes | None:
        """The body at ``url`` (None: 404), read until ``deadline`` at the latest."""
        try:
            with urllib.request.urlopen(url, timeout=min(self.timeout_s, self.deadline_s)) as response:  # noqa: S310 - http(s) only
                chunks: list[bytes] = []
                size = 0
                while size <= MAX_STATE_FILE_BYTES:
                    if time.monotonic() > deadline:
                        raise StoreError(f"{url}: no whole answer within {self.deadline_s:g} s")
                    chunk = response.read1(MAX_STATE_FILE_BYTES + 1 - size)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise StoreError(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise StoreError(f"{url}: {reason}") from None
        if size > MAX_STATE_FILE_BYTES:
            raise StoreError(f"{url}: larger than {MAX_STATE_FILE_BYTES} bytes")
        return b"".join(chunks)

    def publish(self, profile: Profile) -> bool:
        return False

    def try_acquire(self, key: str, ttl_s: float) -> Lease | Holder | None:
        return None


class DirectoryStore:
    """A store in a directory shared by the replicas."""

    writable = True

    def __init__(self, path: str | os.PathLike[str], *, tell: Publish, here: Here | None = None) -> None:
        self.root = Path(path)
        self.here = here or this_process()
        self.tell = tell  # the caller's publish: what the store saw goes there as events

    def __str__(self) -> str:
        return str(self.root)

    def _dir(self, name: str) -> Path:
        path = self.root / name
        try:
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {path}: {exc.strerror}") from None
        return path

    def lookup(self, key: str) -> Profile | None:
        path = self.root / PROFILES / f"{_checked(key)}.json"
        data, problem = inspect_json(path)
        if problem is not None:
            # never moved aside here: a replica replaces it on its next publish
            self.tell(FleetFileInvalid(str(path), problem))
            return None
        if data is None:
            return None
        try:
            return _profile(data, key)
        except ValueError as exc:
            self.tell(FleetFileInvalid(str(path), str(exc)))
            return None

    def publish(self, profile: Profile) -> bool:
        """Write ``profile`` atomically; False when the store already holds the same flags for it."""
        directory = self._dir(PROFILES)
        _remove_old_temp_files(directory)
        current = self.lookup(profile.key)
        if current is not None and current.flags == profile.flags:
            return False
        if not profile.updated_at:  # a profile whose local save failed has no timestamps yet
            now = utc_now_iso()
            profile = dataclasses.replace(profile, created_at=profile.created_at or now, updated_at=now)
        try:
            atomic_write_json(directory / f"{profile.key}.json", profile.to_dict(), mode=FILE_MODE)
        except StateWriteError as exc:
            raise StoreError(str(exc)) from None
        return True

    # --- the lease ----------------------------------------------------------------------------

    def lease_path(self, key: str) -> Path:
        return self.root / LEASES / f"{_checked(key)}.lease"

    def holder(self, key: str) -> tuple[Holder | None, str | None]:
        """The lease's record, or (None, why it is unreadable), or (None, None) when there is none."""
        data, problem = inspect_json(self.lease_path(key), expect_schema=None)
        if data is None:
            return None, problem
        try:
            return Holder.from_dict(data), None
        except ValueError as exc:
            return None, str(exc)

    def try_acquire(self, key: str, ttl_s: float) -> Lease | Holder | None:
        """Our :class:`Lease`, or the :class:`Holder` that has it, or None when a stale lease was just
        broken or a record could not be read yet (ask again)."""
        directory = self._dir(LEASES)
        _remove_old_temp_files(directory)
        path = self.lease_path(key)
        owner = uuid.uuid4().hex
        record = self._record(owner, key, ttl_s)
        if _create_whole(directory, path, record):
            return Lease(self, key, owner, ttl_s)
        holder, problem = self.holder(key)
        if holder is None:
            if problem is None:  # released meanwhile
                return None
            if _older_than(path, ttl_s + CLOCK_SKEW_S):  # unreadable and not renewed for a lease
                self._break(path, None, f"unreadable lease ({problem})")
            return None
        why = stale(holder, time.time(), self.here, _pid_alive)
        if why is None:
            return holder
        self._break(path, holder, why)
        return None

    def _record(self, owner: str, key: str, ttl_s: float) -> dict[str, Any]:
        h = self.here
        return Holder(owner, h.host, h.pid, h.boot_id, h.pid_ns, time.time() + ttl_s, key).to_dict()

    def _break(self, path: Path, judged: Holder | None, why: str) -> None:
        """Move a stale lease out of the way, unless it changed since it was judged stale."""
        aside = path.with_name(f".{path.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # someone else broke or released it first
        except OSError as exc:
            self.tell(FleetLeaseBreakFailed(str(path), exc.strerror))
            return
        data, _ = inspect_json(aside, expect_schema=None)
        moved = None
        with contextlib.suppress(ValueError):
            moved = Holder.from_dict(data)
        if judged is not None and moved != judged:
            # renewed (or replaced) between the read and the rename: put it back if the name is free
            with contextlib.suppress(OSError):
                os.link(aside, path)
        else:
            if judged is not None:  # what its writes in flight left behind: it renews no more
                _remove_temp_files(path.parent, f".{path.name}.{judged.pid}.")
            self.tell(
                FleetLeaseTakenOver(
                    key=judged.key if judged else path.stem,
                    holder_host=judged.host if judged else None,
                    holder_pid=judged.pid if judged else None,
                    why=why,
                )
            )
        with contextlib.suppress(OSError):
            os.unlink(aside)

    def renew(self, key: str, owner: str, ttl_s: float) -> bool:
        """Push our lease's expiry forward; False when the lease is no longer ours."""
        holder, _ = self.holder(key)
        if holder is None or holder.owner != owner:
            return False
        try:
            atomic_write_json(self.lease_path(key), self._record(owner, key, ttl_s), mode=FILE_MODE)
        except StateWriteError:
            return False
        return True

    def release(self, key: str, owner: str) -> None:
        holder, _ = self.holder(key)
        if holder is not None and holder.owner == owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lease_path(key))


def _checked(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise ConfigError("profile", f"invalid profile key {str(key)[:80]!r}")
    return key


def checked_profile(data: Any, key: str) -> Profile:
    """The profile ``data`` holds, checked as every store entry is (ValueError naming what is wrong)."""
    return _profile(data, key)


def _profile(data: Any, key: str) -> Profile:
    profile = Profile.from_dict(data)
    if profile.key != key:
        raise ValueError(f"holds the profile of key {profile.key}, not {key}")
    return profile


def _create_whole(directory: Path, path: Path, record: dict[str, Any]) -> bool:
    """Create ``path`` holding ``record``, complete from its first instant; False when it exists."""
    tmp = directory / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        atomic_write_json(tmp, record, mode=FILE_MODE)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot create {path}: {exc.strerror}") from None
        return True
    except StateWriteError as exc:
        raise StoreError(str(exc)) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False


def _remove_temp_files(directory: Path, prefix: str) -> None:
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(prefix) and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(directory / name)


def _remove_old_temp_files(directory: Path) -> None:
    """Temporary files a crashed writer left. By age only: a pid means nothing on another host."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(".") and name.endswith(".tmp"):
                path = directory / name
                with contextlib.suppress(OSError):
                    if now - os.lstat(path).st_mtime > TEMP_MAX_AGE_S:
                        os.unlink(path)


def _pid_alive(pid: int) -> bool:
    from r1sup.adapters.statefiles import pid_alive

    return pid_alive(pid)


class Lease:
    """A held lease, renewed from a thread every third of its lifetime until released."""

    def __init__(self, store: DirectoryStore, key: str, owner: str, ttl_s: float) -> None:
        self.store = store
        self.key = key
        self.owner = owner
        self.ttl_s = ttl_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="profile-lease", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                ok = self.store.renew(self.key, self.owner, self.ttl_s)
            except (OSError, R1supError):
                ok = False
            if not ok and not self.lost:
                self.lost = True
                # told from this thread: on the daemon's bus only the log's sink acts on this event
                self.store.tell(FleetLeaseLost(self.key, str(self.store)))

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.store.release(self.key, self.owner)
        except (OSError, R1supError) as exc:
            self.store.tell(FleetLeaseReleaseFailed(self.key, str(exc)))


# --- what run and tune do ----------------------------------------------------------------------------


Store = DirectoryStore | HttpStore


def open_store(location: str | None, tell: Publish) -> Store | None:
    if not location:
        return None
    return HttpStore(location) if is_url(location) else DirectoryStore(location, tell=tell)


@dataclass
class Consulted:
    """What the shared store said: a profile to launch once, or (None) tune, holding ``lease`` if any."""

    store: Store | None = None
    profile: Profile | None = None
    lease: Lease | None = None
    waited_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def consult(
    config: Any,
    key: str,
    *,
    sleep: Callable[[float], None],
    tell: Publish,
    status: Callable[[str], None] = lambda text: None,
    store: Store | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Consulted:
    """Look for ``key`` in the shared store; without it take the lease, or wait for the replica that
    holds it. ``sleep`` is the caller's interruptible wait (signals end it); ``tell`` its publish (what
    the store said goes there as events). Never raises for the store itself: an unreachable store is
    told and the replica tunes on its own."""
    st = config.state
    store = store if store is not None else open_store(st.profile_store, tell)
    out = Consulted(store=store)
    if store is None:
        return out
    start = clock()
    announced: str | None = None
    poll = min(5.0, max(0.2, st.profile_lease_s / 10))
    while True:
        try:
            found = store.lookup(key)
            if found is not None:
                out.profile, out.waited_s = found, round(clock() - start, 1)
                tell(FleetHit(key, str(store), out.waited_s))
                return out
            got = store.try_acquire(key, st.profile_lease_s)
        except R1supError as exc:
            tell(FleetUnavailable(str(store), str(exc)))
            return out
        if got is None and not store.writable:
            tell(FleetMiss(key, str(store)))
            return out
        if isinstance(got, Lease):
            try:
                found = store.lookup(key)  # published between the look and the lease
            except R1supError:
                found = None
            if found is not None:
                got.release()
                out.profile = found
                tell(FleetHit(key, str(store), round(clock() - start, 1)))
                return out
            out.lease, out.waited_s = got, round(clock() - start, 1)
            tell(FleetLeaseAcquired(key, str(store), st.profile_lease_s))
            return out
        if isinstance(got, Holder) and announced != got.owner:
            announced = got.owner
            text = f"waiting for {got.host} (pid {got.pid}) to tune; profile store {store}"
            tell(FleetWaiting(key, got.host, got.pid, round(got.expires_at - time.time(), 1)))
            status(text)
        if clock() - start >= st.profile_wait_s:
            tell(FleetWaitTimeout(key, round(clock() - start, 1)))
            out.waited_s = round(clock() - start, 1)
            return out
        sleep(poll)


def publish(config: Any, profile: Profile, *, tell: Publish, store: Store | None = None) -> None:
    """Publish ``profile`` to the shared store, if there is one (never raises: told to ``tell``, the
    caller's publish)."""
    store = store if store is not None else open_store(config.state.profile_store, tell)
    if store is None:
        return
    if not store.writable:
        tell(FleetReadOnly(profile.key, str(store)))
        return
    try:
        written = store.publish(profile)
    except (R1supError, OSError) as exc:
        tell(FleetPublishFailed(profile.key, str(store), str(exc)))
        return
    tell(FleetPublished(profile.key, str(store), written))
