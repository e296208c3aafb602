"""The fleet's shared profile store: lookups, atomic publishing, the lease, r1sup processes sharing one."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, free_port, wait_until
from r1sup.core import events as E
from r1sup.core.config import build
from r1sup.core.errors import ConfigError
from r1sup.core.hardware import DeviceFacts, GpuInfo
from r1sup.state import fleet
from r1sup.state.fleet import DirectoryStore, Here, Holder, HttpStore, Lease, StoreError, consult, stale
from r1sup.state.profiles import Profile, ProfileStore, fingerprint, fingerprint_key

GIB = 1024**3
HERE = Here(host="node-a", pid=100, boot_id="boot-1", pid_ns=4026531836)


@pytest.fixture
def heard() -> list[Any]:
    """What the store and ``consult`` told their caller (the events a bus would carry)."""
    return []


def a_fingerprint(model: str = "org/model", driver: str = "550.54.14") -> dict[str, Any]:
    gpu = GpuInfo(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        total_bytes=80 * GIB,
        free_bytes=79 * GIB,
        compute_capability=(9, 0),
    )
    return fingerprint(
        model=model,
        model_config_hash="0123456789abcdef",
        device=DeviceFacts(backend="cuda", gpus=(gpu,), driver=driver, host_total_bytes=512 * GIB),
        versions={"vllm": "0.33.0", "torch": "2.13.0"},
        target={"concurrency": 4, "context": 8192},
        tensor_parallel_size=1,
        r1sup_version="0.1.0",
    )


def a_profile(fp: dict[str, Any] | None = None, max_model_len: int = 8192) -> Profile:
    fp = fp or a_fingerprint()
    return Profile.create(
        fingerprint=fp,
        model="org/model",
        served_name="r1",
        flags={"max_model_len": max_model_len, "gpu_memory_utilization": 0.9},
        command=["python", "-m", "vllm.entrypoints.openai.api_server", "--api-key", "sk-secret"],
    )


# --- the fingerprint a fleet shares --------------------------------------------------------------


def test_boxes_that_differ_only_in_the_driver_patch_release_share_a_key():
    assert fingerprint_key(a_fingerprint(driver="550.54.14")) == fingerprint_key(
        a_fingerprint(driver="550.90.07")
    )
    assert fingerprint_key(a_fingerprint(driver="550.54.14")) != fingerprint_key(
        a_fingerprint(driver="560.28.03")
    )


# --- staleness (pure) ------------------------------------------------------------------------------


def holder(**changes: Any) -> Holder:
    base = Holder(owner="o1", host="node-a", pid=200, boot_id="boot-1", pid_ns=4026531836, expires_at=1000.0)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("record", "now", "alive", "why"),
    [
        (holder(), 990.0, True, None),  # live and renewed
        (holder(), 1000.0 + fleet.CLOCK_SKEW_S, True, None),  # expiry reached, within the skew allowance
        (holder(), 1000.0 + fleet.CLOCK_SKEW_S + 1, True, "expired"),
        (holder(), 990.0, False, "is gone"),  # same host, boot and PID namespace: its pid says it all
        (holder(host="node-b"), 990.0, False, None),  # another host: a pid there means nothing here
        (holder(boot_id="boot-2"), 990.0, False, None),  # rebooted since: pids were reused
        (holder(pid_ns=1), 990.0, False, None),  # another container on this host
        (holder(boot_id=None), 990.0, False, None),  # unknown boot: trust only the expiry
    ],
)
def test_when_a_lease_may_be_taken_over(record: Holder, now: float, alive: bool, why: str | None):
    said = stale(record, now, HERE, lambda pid: alive)
    assert (said is None) if why is None else (said is not None and why in said), said


# --- a directory store -----------------------------------------------------------------------------


def test_publish_then_lookup(tmp_path: Path, heard: list[Any]):
    store = DirectoryStore(tmp_path / "store", tell=heard.append, here=HERE)
    profile = a_profile()
    assert store.lookup(profile.key) is None
    assert store.publish(profile) is True
    path = tmp_path / "store" / "profiles" / f"{profile.key}.json"
    assert oct(path.stat().st_mode & 0o777) == oct(fleet.FILE_MODE)
    found = store.lookup(profile.key)
    assert found is not None and found.flags == profile.flags and found.updated_at  # stamped on publish
    assert "sk-secret" not in path.read_text()  # the API key was masked in the command
    assert store.publish(profile) is False  # the same flags again: nothing rewritten
    stepped = a_profile(max_model_len=4096)
    assert store.publish(stepped) is True
    assert store.lookup(profile.key).flags["max_model_len"] == 4096  # type: ignore[union-attr]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    ['{"schema_version": 1, "key": "trunc', "not json", '{"schema_version": 1}', "[]"],
)
def test_an_unusable_file_in_the_store_is_a_miss_and_is_left_for_the_next_publish(
    tmp_path: Path, content: str, heard: list[Any]
):
    store = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    profile = a_profile()
    (tmp_path / "profiles").mkdir()
    bad = tmp_path / "profiles" / f"{profile.key}.json"
    bad.write_text(content)
    assert store.lookup(profile.key) is None
    assert [type(e) for e in heard] == [E.FleetFileInvalid] and heard[0].path == str(bad)
    assert bad.read_text() == content  # not moved: other replicas read this directory too
    assert store.publish(profile) is True
    assert store.lookup(profile.key) is not None


def test_a_file_holding_another_key_is_not_used(tmp_path: Path, heard: list[Any]):
    store = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    other = a_profile(a_fingerprint(model="org/other"))
    (tmp_path / "profiles").mkdir()
    wrong = tmp_path / "profiles" / f"{a_profile().key}.json"
    wrong.write_text(
        json.dumps(
            {**other.to_dict(), "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"}
        )
    )
    assert store.lookup(a_profile().key) is None


def test_a_bad_key_is_refused_before_any_path_is_built(tmp_path: Path, heard: list[Any]):
    with pytest.raises(ConfigError):
        DirectoryStore(tmp_path, tell=heard.append, here=HERE).lookup("../../etc/passwd")


# --- the lease -------------------------------------------------------------------------------------


def test_one_holder_at_a_time_and_release(tmp_path: Path, heard: list[Any]):
    a = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    b = DirectoryStore(tmp_path, tell=heard.append, here=dataclasses.replace(HERE, host="node-b", pid=7))
    key = a_profile().key
    lease = a.try_acquire(key, 60.0)
    assert isinstance(lease, Lease)
    try:
        seen = b.try_acquire(key, 60.0)
        assert isinstance(seen, Holder) and seen.host == "node-a" and seen.owner == lease.owner
        assert seen.expires_at > time.time() + 50
    finally:
        lease.release()
    assert not a.lease_path(key).exists()
    again = b.try_acquire(key, 60.0)
    assert isinstance(again, Lease)
    again.release()


def test_the_holder_renews_its_lease_while_it_lives(tmp_path: Path, heard: list[Any]):
    # a short lease, still long beside the fsyncs of a renewal on a busy disk
    store = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    key = a_profile().key
    lease = store.try_acquire(key, 3.0)
    assert isinstance(lease, Lease)
    try:
        first = store.holder(key)[0]
        assert first is not None
        time.sleep(4.0)  # longer than the lease: renewals keep it
        renewed = store.holder(key)[0]
        assert renewed is not None and renewed.owner == first.owner
        assert renewed.expires_at > first.expires_at + 1.0
        other = DirectoryStore(tmp_path, tell=heard.append, here=dataclasses.replace(HERE, host="node-b"))
        assert isinstance(other.try_acquire(key, 3.0), Holder)
        assert not lease.lost
    finally:
        lease.release()


def test_a_lease_someone_else_took_over_is_reported_lost_and_not_released(tmp_path: Path, heard: list[Any]):
    store = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    key = a_profile().key
    lease = store.try_acquire(key, 0.6)
    assert isinstance(lease, Lease)
    usurper = {**Holder("o2", "node-b", 9, None, None, time.time() + 60, key).to_dict()}
    store.lease_path(key).write_text(json.dumps(usurper))
    wait_until(lambda: lease.lost, 5, what="the lease to be reported lost")
    assert heard == [E.FleetLeaseLost(key, str(tmp_path))]
    lease.release()
    assert json.loads(store.lease_path(key).read_text())["owner"] == "o2"  # the other holder's, kept


HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from r1sup.state.fleet import DirectoryStore, Here
    here = Here(host="elsewhere", pid=1, boot_id=None, pid_ns=None)
    store = DirectoryStore(sys.argv[1], tell=lambda event: None, here=here)
    lease = store.try_acquire(sys.argv[2], float(sys.argv[3]))
    print("held" if lease is not None and not hasattr(lease, "host") else "not held", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.serial  # timing-bound: the holder's thread must renew a 3 s lease within its second
def test_a_killed_holders_lease_expires_and_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heard: list[Any]
):
    monkeypatch.setattr(fleet, "CLOCK_SKEW_S", 1.0)
    key = a_profile().key
    ttl = 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT / "supervisor")}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, str(tmp_path), key, str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        me = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
        time.sleep(ttl + 1.0)  # past the first expiry: the holder's thread has renewed it
        assert isinstance(me.try_acquire(key, ttl), Holder)
        proc.kill()
        proc.wait(timeout=10)
        killed_at = time.monotonic()
        # the record names another host: only the expiry frees it
        got = wait_until(
            lambda: (lambda g: g if isinstance(g, Lease) else None)(me.try_acquire(key, ttl)), 10
        )
        assert time.monotonic() - killed_at >= 1.0
        assert isinstance(got, Lease)
        got.release()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_holder_on_this_host_whose_process_is_gone_is_taken_over_at_once(tmp_path: Path, heard: list[Any]):
    here = fleet.this_process()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=10)
    record = Holder("o1", here.host, dead.pid, here.boot_id, here.pid_ns, time.time() + 3600, "k")
    (tmp_path / "leases").mkdir()
    key = a_profile().key
    DirectoryStore(tmp_path, tell=heard.append).lease_path(key).write_text(json.dumps(record.to_dict()))
    store = DirectoryStore(tmp_path, tell=heard.append)
    assert store.try_acquire(key, 60.0) is None  # broken now
    lease = store.try_acquire(key, 60.0)
    assert isinstance(lease, Lease)
    lease.release()


# --- an HTTP store -------------------------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path):
    """``tmp_path`` over HTTP on loopback, the way a web server would serve a directory store."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_http_store_serves_a_directory_store_as_it_is(tmp_path: Path, served: str, heard: list[Any]):
    profile = a_profile()
    http_store = HttpStore(served + "/")
    assert http_store.lookup(profile.key) is None  # 404
    DirectoryStore(tmp_path, tell=heard.append, here=HERE).publish(profile)
    found = http_store.lookup(profile.key)
    assert found is not None and found.flags == profile.flags
    assert http_store.publish(profile) is False and http_store.try_acquire(profile.key, 10) is None
    (tmp_path / "profiles" / f"{profile.key}.json").write_text("{broken")
    with pytest.raises(StoreError, match="not a usable profile"):
        http_store.lookup(profile.key)


def test_an_unreachable_http_store_is_an_error_the_replica_survives(tmp_path: Path, heard: list[Any]):
    store = HttpStore(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(StoreError):
        store.lookup(a_profile().key)
    config = build({"model": {"name": "m"}, "state": {"profile_store": store.url}}, env={})
    said = consult(config, a_profile().key, sleep=lambda s: None, tell=heard.append)
    assert said.profile is None and said.lease is None  # tune here, nothing to wait for
    assert [type(e) for e in heard] == [E.FleetUnavailable]


@pytest.fixture
def misbehaving():
    """An HTTP store on loopback that answers every GET with ``body`` (a callable writing to the socket)."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def serve(write: Any) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the handler's name
                write(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _answer(handler: Any, body: bytes, length: int | None = None) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(length if length is not None else len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _in_thread(work: Any, limit_s: float) -> Any:
    """``work()``'s result or exception, failing the test when it has not ended after ``limit_s``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s"
    return box


def test_an_http_store_serving_json_nested_thousands_deep_is_a_store_error(
    misbehaving: Any, heard: list[Any]
):
    """Issue 34: a RecursionError escaped HttpStore.lookup and every tune and run exited 1."""
    url = misbehaving(lambda h: _answer(h, b"[" * 100_000 + b"]" * 100_000))
    with pytest.raises(StoreError, match="not a usable profile.*nested too deeply"):
        HttpStore(url).lookup(a_profile().key)
    said = consult(store_config(url), a_profile().key, sleep=lambda s: None, tell=heard.append)
    assert said.profile is None and [type(e) for e in heard] == [E.FleetUnavailable]


def test_an_http_store_that_drips_a_byte_at_a_time_is_given_up_at_the_deadline(misbehaving: Any):
    """Issue 34: a server sending a byte every few seconds held `tune` before any launch, with no end."""
    stop = threading.Event()

    def drip(handler: Any) -> None:
        _answer(handler, b"", length=10_000)
        while not stop.is_set():
            try:
                handler.wfile.write(b" ")
                handler.wfile.flush()
            except OSError:
                return
            stop.wait(0.2)  # each read gets a byte well within the read timeout

    url = misbehaving(drip)
    try:
        store = HttpStore(url, timeout_s=5)
        store.deadline_s = 1.0  # the whole lookup's (HTTP_DEADLINE_S is 30 s)
        box = _in_thread(lambda: store.lookup(a_profile().key), limit_s=20)
        assert isinstance(box.get("error"), StoreError), box
        assert "no whole answer within 1 s" in str(box["error"])
        # consult, as run and tune call it: the replica goes on without the store
        told: list[Any] = []
        config = store_config(url)
        box = _in_thread(
            lambda: consult(config, a_profile().key, sleep=lambda s: None, tell=told.append, store=store), 20
        )
        assert box["value"].profile is None and [type(e) for e in told] == [E.FleetUnavailable]
    finally:
        stop.set()


# --- consult: what run and tune do -----------------------------------------------------------------


def store_config(location: Path | str, **state: Any) -> Any:
    return build({"model": {"name": "m"}, "state": {"profile_store": str(location), **state}}, env={})


def test_consult_waits_for_the_holder_and_takes_its_profile(tmp_path: Path, heard: list[Any]):
    profile = a_profile()
    other = DirectoryStore(tmp_path, tell=heard.append, here=dataclasses.replace(HERE, host="node-b"))
    lease = other.try_acquire(profile.key, 60.0)
    assert isinstance(lease, Lease)
    naps: list[float] = []
    statuses: list[str] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:  # the holder finishes its tune
            other.publish(profile)
            lease.release()

    said = consult(store_config(tmp_path), profile.key, sleep=nap, tell=heard.append, status=statuses.append)
    assert said.profile is not None and said.profile.flags == profile.flags and said.lease is None
    assert len(naps) == 3 and statuses == [f"waiting for node-b (pid 100) to tune; profile store {tmp_path}"]
    assert [type(e) for e in heard] == [E.FleetWaiting, E.FleetHit]
    assert heard[0].holder_host == "node-b" and (heard[1].key, heard[1].store) == (profile.key, str(tmp_path))


def test_consult_takes_the_lease_when_nobody_tunes(tmp_path: Path, heard: list[Any]):
    said = consult(
        store_config(tmp_path),
        a_profile().key,
        sleep=lambda s: pytest.fail("no wait expected"),
        tell=heard.append,
    )
    assert said.profile is None and isinstance(said.lease, Lease)
    assert DirectoryStore(tmp_path, tell=heard.append).holder(a_profile().key)[0] is not None
    said.release()
    assert DirectoryStore(tmp_path, tell=heard.append).holder(a_profile().key) == (None, None)


def test_consult_gives_up_waiting_after_profile_wait_s(tmp_path: Path, heard: list[Any]):
    profile = a_profile()
    other = DirectoryStore(tmp_path, tell=heard.append, here=dataclasses.replace(HERE, host="node-b"))
    lease = other.try_acquire(profile.key, 600.0)
    assert isinstance(lease, Lease)
    clock = [0.0]

    def nap(seconds: float) -> None:
        clock[0] += seconds

    try:
        said = consult(
            store_config(tmp_path, profile_wait_s=30.0),
            profile.key,
            sleep=nap,
            tell=heard.append,
            clock=lambda: clock[0],
        )
    finally:
        lease.release()
    assert said.profile is None and said.lease is None and said.waited_s >= 30.0
    assert [type(e) for e in heard] == [E.FleetWaiting, E.FleetWaitTimeout]


def test_an_unusable_store_location_is_a_config_error():
    with pytest.raises(ConfigError, match="state.profile_store"):
        build({"model": {"name": "m"}, "state": {"profile_store": "s3://bucket/profiles"}}, env={})
    with pytest.raises(ConfigError, match="state.profile_store"):
        build({"model": {"name": "m"}, "state": {"profile_store": " "}}, env={})


def test_a_profile_store_directory_that_cannot_be_created_is_survived(tmp_path: Path, heard: list[Any]):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    said = consult(store_config(blocker / "store"), a_profile().key, sleep=lambda s: None, tell=heard.append)
    assert said.profile is None and said.lease is None


def test_local_profiles_are_unaffected_by_the_store(tmp_path: Path):
    local = ProfileStore(tmp_path / "state")
    assert local.save(a_profile()) is not None
    assert not (tmp_path / "store").exists()


# --- several r1sup processes sharing one store, on the fake engine ------------------------------------


def replica(
    tmp_path: Path, name: str, store: Path, **state: Any
) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """A replica's config body, scenario and directory: its own port, state and engine record; the
    same box (an RTX 4090), model and [start], so every replica has the same fingerprint."""
    from test_tune_fake import QWEN_7B, fake_body, fake_scenario

    home = tmp_path / name
    home.mkdir()
    # 128k tokens of context do not fit in bf16 KV: the first launch fails (kv_insufficient), fp8 KV fits
    body = fake_body(
        home,
        model=QWEN_7B,
        start={"max_model_len": 131072},
        state={"profile_store": str(store), "profile_lease_s": 3.0, **state},
        daemon={"health_interval_s": 0.5, "liveness_interval_s": 3600.0},
    )
    return body, fake_scenario(home, time_scale=0.01), home


def launches(home: Path) -> list[dict[str, Any]]:
    from test_tune_fake import engine_records

    return engine_records(home)


def store_files(store: Path) -> tuple[list[str], list[str]]:
    profiles = sorted(p.name for p in (store / "profiles").iterdir()) if (store / "profiles").exists() else []
    leases = sorted(p.name for p in (store / "leases").iterdir()) if (store / "leases").exists() else []
    return profiles, leases


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_replicas_tune_once_and_share_the_profile(tmp_path: Path):
    from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config
    from test_tune_fake import fake_env

    store = tmp_path / "store"
    replicas = []
    for name in ("a", "b", "c"):
        body, scenario, home = replica(tmp_path, name, store)
        config = write_config(home / "r1sup.toml", body)
        replicas.append((name, config, home, R1sup("run", "--config", str(config), env=fake_env(scenario))))
    try:
        for _, _, _, proc in replicas:
            proc.wait_event("serving", 120)
        tuned = [name for name, _, _, proc in replicas if proc.named("profile_lease_acquired")]
        assert len(tuned) == 1, [proc.tail() for *_, proc in replicas]
        counts = {name: len(launches(home)) for name, _, home, _ in replicas}
        holder = tuned[0]
        assert counts[holder] == 2, counts  # kv_insufficient, then the search's step
        final = launches(dict((n, h) for n, _, h, _ in replicas)[holder])[-1]["flags"]
        for name, _, home, proc in replicas:
            if name == holder:
                assert proc.named("profile_published")
                continue
            assert counts[name] == 1, counts  # one launch with the fleet's profile
            assert launches(home)[0]["flags"] == final
            assert proc.named("profile_store_waiting") or proc.named("profile_store_hit")
            status = json.loads((home / "state" / "status.json").read_text())
            assert status["profile_source"] == "shared" and status["launches"] == 1
            assert len(list((home / "state" / "profiles").glob("*.json"))) == 1  # kept locally as well
        profiles, leases = store_files(store)
        assert len(profiles) == 1 and leases == []
        published = Profile.from_dict(json.loads((store / "profiles" / profiles[0]).read_text()))
        # the holder's working flags (the full context kept by the search's step), not its first launch's
        keys = ("max_model_len", "gpu_memory_utilization", "kv_cache_dtype", "max_num_seqs")
        first = launches(dict((n, h) for n, _, h, _ in replicas)[holder])[0]["flags"]
        assert published.flags["max_model_len"] == 131072
        assert [published.flags[k] for k in keys] == [final[k] for k in keys] != [first[k] for k in keys]
        for *_, proc in replicas:
            proc.signal(signal.SIGTERM)
        for _, config, _, proc in replicas:
            assert proc.wait(60) == 0, proc.tail()
            assert not engine_processes(config)
    finally:
        for _, config, _, proc in replicas:
            proc.kill()
            kill_engine_processes(config)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_killed_while_tuning_leaves_a_lease_the_next_one_takes_over(tmp_path: Path):
    from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config
    from test_tune_fake import fake_env

    store = tmp_path / "store"
    body_a, scenario_a, home_a = replica(tmp_path, "a", store)
    scenario_a["hang_at"] = "load_weights"  # replica a never finishes its first launch
    config_a = write_config(home_a / "r1sup.toml", body_a)
    a = R1sup("run", "--config", str(config_a), env=fake_env(scenario_a))
    body_b, scenario_b, home_b = replica(tmp_path, "b", store)
    config_b = write_config(home_b / "r1sup.toml", body_b)
    b = None
    try:
        a.wait_event("profile_lease_acquired", 60)
        a.wait_event("child_started", 60)
        b = R1sup("run", "--config", str(config_b), env=fake_env(scenario_b))
        b.wait_event("profile_store_waiting", 60)
        a.kill()  # SIGKILL: no release, no more renewals; its orphan guard stops its engine
        wait_until(lambda: not engine_processes(config_a), 30, what="replica a's engine to go")
        taken = b.wait_event("profile_lease_taken_over", 60)
        assert "is gone" in taken["why"]  # same host, boot and PID namespace: no need to wait the lease out
        b.wait_event("serving", 120)
        assert len(launches(home_b)) == 2 and b.named("profile_published")
        profiles, leases = store_files(store)
        assert len(profiles) == 1 and leases == []
        b.signal(signal.SIGTERM)
        assert b.wait(60) == 0, b.tail()
    finally:
        a.kill()
        kill_engine_processes(config_a)
        if b is not None:
            b.kill()
        kill_engine_processes(config_b)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tune_uses_the_fleets_profile_with_one_launch(tmp_path: Path):
    from test_tune_fake import run_plan, run_tune

    store = tmp_path / "store"
    body, scenario, home = replica(tmp_path, "a", store)
    first = run_tune(home, body, scenario)
    assert first.code == 0 and first.result["launches"] == 2, first.explain()
    assert first.proc.named("profile_published")
    body_b, scenario_b, home_b = replica(tmp_path, "b", store)
    # issue 36: plan --config on the second replica (nothing saved there) says what it launches: the
    # fleet's profile, read without a lease, and where it came from
    from r1sup_proc import write_config

    code, out = run_plan(write_config(home_b / "r1sup.toml", body_b), scenario_b, "--json")
    planned = json.loads(out)
    assert planned["recommended"] == first.result["flags"], out
    origin = planned["recommended_from"]
    assert origin["source"] == "shared_profile" and origin["store"] == str(store), origin
    assert store_files(store)[1] == []  # no lease taken
    second = run_tune(home_b, body_b, scenario_b)
    assert second.code == 0 and second.result["launches"] == 1, second.explain()
    assert second.result["flags"] == first.result["flags"]
    assert second.proc.named("profile_store_hit") and second.proc.named("profile_store_unchanged")
    assert store_files(store) == ([f"{second.proc.named('profile_store_hit')[0]['key']}.json"], [])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_waiting_replica_says_so_is_not_ready_and_stops_on_sigterm(tmp_path: Path):
    from r1sup_proc import NotifySocket, R1sup, engine_processes, kill_engine_processes, write_config
    from test_endpoint import get
    from test_tune_fake import fake_env

    store = tmp_path / "store"
    body_a, scenario_a, home_a = replica(tmp_path, "a", store)
    scenario_a["hang_at"] = "load_weights"  # replica a holds the lease and never finishes
    config_a = write_config(home_a / "r1sup.toml", body_a)
    a = R1sup("run", "--config", str(config_a), env=fake_env(scenario_a))
    body, scenario, home = replica(tmp_path, "b", store)
    endpoint = free_port()
    body["daemon"]["metrics_port"] = endpoint
    config = write_config(home / "r1sup.toml", body)
    notify = NotifySocket(tmp_path / "notify.sock")
    b = None
    try:
        a.wait_event("profile_lease_acquired", 60)
        b = R1sup(
            "run", "--config", str(config), env={**fake_env(scenario), "NOTIFY_SOCKET": str(notify.path)}
        )
        waiting = b.wait_event("profile_store_waiting", 60)
        assert waiting["holder_pid"] == a.proc.pid
        wait_until(lambda: any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in notify.messages), 30)
        assert any(
            m.startswith("STATUS=waiting for ") and f"(pid {a.proc.pid})" in m for m in notify.messages
        )
        assert get(endpoint, "/readyz")[0] == 503 and get(endpoint, "/livez")[0] == 200
        status = json.loads(get(endpoint, "/status")[2])
        assert (
            status["state"] == "planning" and status["recent_events"][-1]["event"] == "profile_store_waiting"
        )
        b.signal(signal.SIGTERM)
        assert b.wait(30) == 0, b.tail()
        assert not launches(home) and not engine_processes(config)  # it never launched
        (lease,) = (store / "leases").glob("*.lease")
        assert json.loads(lease.read_text())["pid"] == a.proc.pid  # still a's
    finally:
        a.kill()
        kill_engine_processes(config_a)
        if b is not None:
            b.kill()
        notify.close()


# --- a store profile is untrusted input (issue 26) -----------------------------------------------------


def _tampered(profile: dict[str, Any], section: str | None, name: str, value: Any) -> str:
    data = json.loads(json.dumps(profile))
    (data[section] if section else data)[name] = value
    return json.dumps(data, allow_nan=True)


# the reproductions: each stopped a fleet (internal error, exit 4) or launched what vLLM refuses
BAD_STORE_VALUES = [
    ("observations", "kv_cache_tokens", "x"),
    ("flags", "kv_cache_dtype", "fp8; touch /tmp/r1sup-pwned"),
    ("flags", "quantization", "--trust-remote-code"),
    ("flags", "tensor_parallel_size", 0),
    ("observations", "weights_gib", float("nan")),
    # issue 34: accepted, then a 300-digit --cpu-offload-gb, an OverflowError, or a context of one token
    ("flags", "cpu_offload_gb", 1e300),
    ("observations", "weights_gib", 1e308),
    ("flags", "max_model_len", 1),
]


@pytest.fixture(scope="module")
def published_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The store's file name and content of the profile a first replica published after its tune (once
    per test process: each bad value below tampers with a copy)."""
    from test_tune_fake import run_tune

    tmp_path = tmp_path_factory.mktemp("publisher")
    store = tmp_path / "store"
    body, scenario, home = replica(tmp_path, "a", store)
    first = run_tune(home, body, {**scenario, "time_scale": 0.002})
    assert first.code == 0 and first.result["launches"] == 2, first.explain()
    [published] = (store / "profiles").glob("*.json")
    return published.name, json.loads(published.read_text())


@pytest.mark.parametrize(("section", "name", "value"), BAD_STORE_VALUES, ids=lambda v: str(v)[:24])
def test_every_bad_store_value_is_refused_where_the_replica_reads_the_store(
    tmp_path: Path, published_profile: tuple[str, dict[str, Any]], section: str, name: str, value: Any
):
    # the store's lookup, which tune's bring-up calls (the process test below shows one value end to end:
    # the event, no launch with it, the replica's own search and its profile published over it)
    file_name, good = published_profile
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / file_name).write_text(_tampered(good, section, name, value))
    heard: list[Any] = []
    store = DirectoryStore(tmp_path, tell=heard.append, here=HERE)
    assert store.lookup(Path(file_name).stem) is None, (section, name, value)
    [invalid] = heard
    assert isinstance(invalid, E.FleetFileInvalid) and name in invalid.reason, invalid
    # the good one, in the same place, is read
    (tmp_path / "profiles" / file_name).write_text(json.dumps(good))
    assert store.lookup(Path(file_name).stem) is not None and len(heard) == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("section", "name", "value"), [BAD_STORE_VALUES[1]], ids=lambda v: str(v)[:24])
def test_a_bad_store_profile_is_refused_and_the_replica_tunes_on_its_own(
    tmp_path: Path, published_profile: tuple[str, dict[str, Any]], section: str, name: str, value: Any
):
    from test_tune_fake import run_tune

    file_name, good = published_profile
    store = tmp_path / "store"
    (store / "profiles").mkdir(parents=True)
    published = store / "profiles" / file_name
    published.write_text(_tampered(good, section, name, value))
    body_b, scenario_b, home_b = replica(tmp_path, "b", store)
    second = run_tune(home_b, body_b, {**scenario_b, "time_scale": 0.002})
    what = f"{section}.{name}={value!r}"
    assert second.code == 0, (what, second.explain())
    invalid = second.proc.named("profile_store_file_invalid")
    assert invalid and name in invalid[0]["reason"], (what, invalid)
    assert not second.proc.named("profile_store_hit")
    assert second.result["launches"] == 2, what  # the search ran, as without a store profile
    for launch in launches(home_b):
        assert launch["flags"]["kv_cache_dtype"] in (None, "auto", "fp8", "fp8_e4m3", "fp8_e5m2"), what
        assert launch["flags"]["quantization"] is None and launch["flags"]["tensor_parallel_size"] == 1
    assert not Path("/tmp/r1sup-pwned").exists()
    # the replica published its own working profile over the bad one
    assert Profile.from_dict(json.loads(published.read_text())).flags == good["flags"], what


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_local_profile_with_a_nan_is_set_aside_and_tune_exits_0(tmp_path: Path):
    from test_tune_fake import run_tune

    body, scenario, home = replica(tmp_path, "a", tmp_path / "store")
    del body["state"]["profile_store"]
    first = run_tune(home, body, scenario)
    assert first.code == 0, first.explain()
    [saved] = (home / "state" / "profiles").glob("*.json")
    saved.write_text(_tampered(json.loads(saved.read_text()), "observations", "weights_gib", float("nan")))
    again = run_tune(home, body, scenario)
    assert again.code == 0, again.explain()
    aside = again.proc.named("state_file_set_aside")
    assert aside and "weights_gib" in aside[0]["reason"] and "finite" in aside[0]["reason"]
    assert list((home / "state" / "profiles").glob("*.json.bad-*"))
    assert Profile.from_dict(json.loads(saved.read_text())).observations.weights_gib > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_fleets_profile_is_kept_locally_only_after_it_passed_here(tmp_path: Path):
    """A replica stopped while it launches the store's profile keeps no local copy of it: a profile that
    never passed here must not outlive a fix of the store."""
    from r1sup_proc import R1sup, kill_engine_processes, write_config
    from test_tune_fake import fake_env, run_tune

    store = tmp_path / "store"
    body, scenario, home = replica(tmp_path, "a", store)
    assert run_tune(home, body, scenario).code == 0
    body_b, scenario_b, home_b = replica(tmp_path, "b", store)
    scenario_b["time_scale"] = 1.0  # a slow load: the stop comes while vLLM starts
    config = write_config(home_b / "r1sup.toml", body_b)
    b = R1sup("run", "--config", str(config), env=fake_env(scenario_b))
    try:
        b.wait_event("profile_store_hit", 60)
        b.wait_event("launch_started", 60)
        assert not list((home_b / "state" / "profiles").glob("*.json"))
        b.signal(signal.SIGTERM)
        assert b.wait(60) == 0, b.tail()
        assert not list((home_b / "state" / "profiles").glob("*.json"))
    finally:
        b.kill()
        kill_engine_processes(config)


# --- the property, fuzzed: a store entry or a lease is used within bounds or set aside, never raises -------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ANY_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(
    record=st.one_of(
        _ANY_JSON,
        st.fixed_dictionaries(
            {"owner": _ANY_JSON, "host": _ANY_JSON, "pid": _ANY_JSON, "expires_at": _ANY_JSON},
            optional={"boot_id": _ANY_JSON, "pid_ns": _ANY_JSON, "key": _ANY_JSON},
        ),
    ),
    now=st.floats(min_value=0, max_value=1e10),
)
def test_fuzzed_lease_records_are_judged_or_refused_never_raise(record: Any, now: float):
    try:
        held = Holder.from_dict(record)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    said = stale(held, now, HERE, lambda pid: True)
    assert said is None or isinstance(said, str)


@settings(max_examples=150, deadline=None)
@given(
    section=st.sampled_from(["flags", "observations", "probe", "capacity", "fingerprint"]),
    name=st.sampled_from(["max_model_len", "cpu_offload_gb", "weights_gib", "requests", "ok", "versions"]),
    value=_ANY_JSON,
)
def test_fuzzed_store_entries_are_used_within_the_bounds_or_told_invalid(
    tmp_path_factory: pytest.TempPathFactory, section: str, name: str, value: Any
):
    from r1sup.core import config as cfg

    root = tmp_path_factory.mktemp("store")
    good = a_profile().to_dict()
    data = json.loads(json.dumps(good))
    data.setdefault(section, {})
    if isinstance(data[section], dict):
        data[section][name] = value
    (root / "profiles").mkdir()
    (root / "profiles" / f"{good['key']}.json").write_text(json.dumps(data, allow_nan=True))
    told: list[Any] = []
    found = DirectoryStore(root, tell=told.append, here=HERE).lookup(good["key"])
    if found is None:
        assert [type(e) for e in told] == [E.FleetFileInvalid]
        return
    for flag, v in found.flags.items():
        cfg.check_start_value(f"flags.{flag}", flag, v)
    assert all(len(a) < 40 for a in found.engine_flags.to_argv())
