"""Profiles: the fingerprint decides re-tuning; the store survives bad files, full disks and symlinks."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from r1sup.adapters import preflight
from r1sup.adapters.statefiles import StateWriteError
from r1sup.core import capacity
from r1sup.core.errors import ConfigError
from r1sup.core.figures import Figures
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB, DeviceFacts, GpuInfo
from r1sup.core.probing import ProbeResult
from r1sup.state import profiles
from r1sup.state.profiles import (
    Profile,
    ProfileStore,
    diff_fingerprints,
    fingerprint,
    fingerprint_key,
    mask_command,
)

MIB = 1024**2
RTX4090 = GpuInfo(0, "NVIDIA GeForce RTX 4090", 24564 * MIB, 23000 * MIB, (8, 9))
GPU_BOX = DeviceFacts(backend="cuda", gpus=(RTX4090,), driver="550.54.14", host_total_bytes=64 * GIB)
CPU_BOX = DeviceFacts(
    backend="cpu",
    cpu_model="AMD EPYC 7B13",
    host_total_bytes=24 * GIB + 300 * MIB,
    host_available_bytes=20 * GIB,
)
TWO_GPUS = dataclasses.replace(GPU_BOX, gpus=(RTX4090, dataclasses.replace(RTX4090, index=1)))
BASE = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "model_config_hash": "a1b2c3d4e5f60718",
    "device": GPU_BOX,
    "versions": {"vllm": "0.33.0", "torch": "2.9.0"},
    "target": {"concurrency": 8, "context": 4096},
    "tensor_parallel_size": 1,
    "r1sup_version": "0.1.0",
}


def fp_with(**changes: Any) -> dict[str, Any]:
    return fingerprint(**{**BASE, **changes})


def gpu_box(**gpu_changes: Any) -> DeviceFacts:
    return dataclasses.replace(GPU_BOX, gpus=(dataclasses.replace(RTX4090, **gpu_changes),))


def make_profile(fp: dict[str, Any] | None = None, **changes: Any) -> Profile:
    profile = Profile.create(
        fingerprint=fp if fp is not None else fp_with(),
        model="Qwen/Qwen2.5-7B-Instruct",
        served_name="qwen",
        flags=EngineFlags(max_model_len=4096, kv_cache_dtype="fp8"),
        command=["python", "-m", "vllm.entrypoints.openai.api_server", "--max-model-len", "4096"],
        probe={"passed": True, "requests": 8, "p50_latency_s": 0.4},
        observations=Figures(weights_gib=14.2, kv_cache_gib=6.1),
        attempts=[{"flags": {"max_model_len": 32768}, "failure": "kv_cache_too_small"}],
    )
    return dataclasses.replace(profile, **changes) if changes else profile


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Other tests run ``r1sup.cli.app.main``, which points structlog at their captured stdout with a
    level filter; start and end each test with structlog's defaults."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# --- fingerprint -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"device": gpu_box(name="NVIDIA GeForce RTX 3090")}, "gpu.names"),
        ({"device": TWO_GPUS}, "gpu.count"),
        ({"device": gpu_box(total_bytes=16 * GIB)}, "gpu.memory_gib"),
        ({"device": gpu_box(compute_capability=(8, 6))}, "gpu.compute_capability"),
        ({"device": dataclasses.replace(GPU_BOX, driver="560.28.03")}, "gpu.driver"),
        ({"device": CPU_BOX}, "backend"),
        ({"versions": {"vllm": "0.34.0", "torch": "2.9.0"}}, "versions.vllm"),
        ({"versions": {"vllm": "0.33.0", "torch": "2.10.0"}}, "versions.torch"),
        ({"model": "Qwen/Qwen2.5-14B-Instruct"}, "model.id"),
        ({"model_config_hash": "ffffffffffffffff"}, "model.config_hash"),
        ({"target": {"concurrency": 16, "context": 4096}}, "target.concurrency"),
        ({"target": {"concurrency": 8, "context": 8192}}, "target.context"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"r1sup_version": "1.0.0"}, "r1sup_major"),
    ],
)
def test_fingerprint_changes_that_force_a_retune(changes: dict[str, Any], field: str) -> None:
    base, changed = fp_with(), fp_with(**changes)
    assert fingerprint_key(base) != fingerprint_key(changed)
    differences = diff_fingerprints(base, changed)
    assert any(line.startswith(f"{field}:") for line in differences), differences


@pytest.mark.parametrize(
    "changes",
    [
        {"r1sup_version": "0.2.0"},
        {"r1sup_version": "0.1.7"},
        {"device": gpu_box(total_bytes=24560 * MIB)},  # a few MiB of driver noise
        {"device": gpu_box(free_bytes=1 * GIB)},
        {"device": gpu_box(uuid="GPU-1234")},
        {"device": dataclasses.replace(GPU_BOX, host_total_bytes=128 * GIB, host_available_bytes=3 * GIB)},
        {"device": dataclasses.replace(GPU_BOX, source="catalog", notes=("x",))},
    ],
)
def test_fingerprint_ignores_noise(changes: dict[str, Any]) -> None:
    assert fingerprint_key(fp_with(**changes)) == fingerprint_key(fp_with())
    assert diff_fingerprints(fp_with(), fp_with(**changes)) == []


@pytest.mark.parametrize(
    ("box", "same"),
    [
        (dataclasses.replace(CPU_BOX, host_total_bytes=24 * GIB + 310 * MIB), True),
        (dataclasses.replace(CPU_BOX, host_available_bytes=1 * GIB), True),
        (dataclasses.replace(CPU_BOX, host_total_bytes=32 * GIB), False),
        (dataclasses.replace(CPU_BOX, cpu_model="Intel Xeon Platinum 8480"), False),
    ],
)
def test_cpu_fingerprint(box: DeviceFacts, same: bool) -> None:
    base = fp_with(device=CPU_BOX)
    assert base["cpu"] == {"model": "AMD EPYC 7B13", "memory_gib": 24}
    assert "gpu" not in base
    assert (fingerprint_key(fp_with(device=box)) == fingerprint_key(base)) is same


def test_fingerprint_content_and_diff_lines() -> None:
    fp = fp_with()
    assert fp["gpu"] == {
        "names": ["NVIDIA GeForce RTX 4090"],
        "count": 1,
        "memory_gib": [24.0],
        "compute_capability": "8.9",
        "driver": "550",  # the branch: patch releases share profiles
    }
    assert fp["r1sup_major"] == 0
    assert fp["model"] == {"id": "Qwen/Qwen2.5-7B-Instruct", "config_hash": "a1b2c3d4e5f60718"}
    key = fingerprint_key(fp)
    assert len(key) == 16 and int(key, 16) >= 0
    assert fingerprint_key(json.loads(json.dumps(fp))) == key  # stable through a JSON round trip
    other = fp_with(device=gpu_box(name="RTX 3090"), model_config_hash=None)
    assert diff_fingerprints(fp, other) == [
        "gpu.names: ['NVIDIA GeForce RTX 4090'] -> ['RTX 3090']",
        "model.config_hash: a1b2c3d4e5f60718 -> (unknown)",
    ]
    assert diff_fingerprints({"a": 1}, {"b": 2}) == ["a: 1 -> (absent)", "b: (absent) -> 2"]


def test_the_vllm_version_a_fingerprint_names_whatever_file_it_came_from() -> None:
    assert profiles.fingerprint_vllm(fp_with(versions={"vllm": "0.32.0", "torch": "2.9.0"})) == "0.32.0"
    assert profiles.fingerprint_vllm(fp_with(versions={"vllm": None, "torch": None})) is None
    # an imported or shared profile's fingerprint is untrusted JSON
    for odd in ({}, {"versions": ["0.32.0"]}, {"versions": {"vllm": 32}}, {"versions": {"vllm": ""}}):
        assert profiles.fingerprint_vllm(odd) is None


def test_fingerprint_change_forces_retune_and_says_why(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "state")
    saved = make_profile()
    assert store.save(saved) is not None
    assert store.lookup(fp_with()) is not None  # same box: launch once with the saved flags
    new_box = fp_with(
        device=gpu_box(name="NVIDIA GeForce RTX 3090"), versions={"vllm": "0.34.0", "torch": "2.9.0"}
    )
    assert store.lookup(new_box) is None  # changed: re-tune
    ((near, differences),) = store.near_misses(new_box)
    assert near.key == saved.key
    assert differences == [
        "gpu.names: ['NVIDIA GeForce RTX 4090'] -> ['NVIDIA GeForce RTX 3090']",
        "versions.vllm: 0.33.0 -> 0.34.0",
    ]
    assert store.near_misses(fp_with(model="other/model")) == []


# --- the profile value -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--api-key", "sk-secret", "--port", "8000"], ["--api-key", "***", "--port", "8000"]),
        (["--api-key=sk-secret"], ["--api-key=***"]),
        (["--port", "8000"], ["--port", "8000"]),
        (["--api-key"], ["--api-key"]),
    ],
)
def test_api_keys_are_masked(argv: list[str], expected: list[str]) -> None:
    assert mask_command(argv) == expected
    assert make_profile(command=["python", *argv]).command == ["python", *expected]


def test_round_trip_and_engine_flags() -> None:
    profile = make_profile(created_at="2025-01-01T00:00:00Z", updated_at="2025-01-02T00:00:00Z")
    data = json.loads(json.dumps(profile.to_dict()))
    assert data["schema_version"] == 1
    assert Profile.from_dict(data) == profile
    assert profile.engine_flags == EngineFlags(max_model_len=4096, kv_cache_dtype="fp8")
    assert set(data["flags"]) == set(EngineFlags().to_dict())


def _valid() -> dict[str, Any]:
    return make_profile(created_at="2025-01-01T00:00:00Z", updated_at="2025-01-01T00:00:00+00:00").to_dict()


def _with(**changes: Any) -> dict[str, Any]:
    data = _valid()
    data.update(changes)
    return data


def _without(name: str) -> dict[str, Any]:
    data = _valid()
    del data[name]
    return data


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "JSON object"),
        (_without("fingerprint"), "missing field fingerprint"),
        (_without("command"), "missing field command"),
        (_with(schema_version=2), "schema_version 2"),
        (_with(schema_version=True), "schema_version must be int"),
        (_with(key="../../etc/passwd"), "not 8-64 lowercase hex"),
        (_with(key="0123456789abcdef"), "does not match the fingerprint"),
        (_with(model=""), "must not be empty"),
        (_with(model=3), "model must be str"),
        (_with(flags={"max_model_len": "4096"}), "flags.max_model_len"),
        (_with(flags={"enforce_eager": 1}), "flags.enforce_eager"),
        (_with(flags={"gpu_memory_utilization": True}), "flags.gpu_memory_utilization"),
        (_with(flags={"swap_space": 4}), "unknown flag swap_space"),
        (_with(command=[]), "non-empty list of strings"),
        (_with(command=["python", 3]), "non-empty list of strings"),
        (_with(probe=[]), "probe must be dict"),
        (_with(attempts=[1]), "list of objects"),
        (_with(created_at="yesterday"), "not an ISO 8601"),
        (_with(extra=1), "unknown field(s): extra"),
        (_with(imported="yes"), "imported must be an object"),
    ],
)
def test_malformed_profiles_are_rejected(data: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        Profile.from_dict(data)
    assert fragment in str(info.value)


def test_flags_accept_partial_and_integral_floats() -> None:
    data = _with(flags={"max_model_len": 2048, "gpu_memory_utilization": 1})
    assert Profile.from_dict(data).engine_flags == EngineFlags(max_model_len=2048, gpu_memory_utilization=1)


# --- the store ---------------------------------------------------------------------------------


def test_save_and_load_with_private_modes(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = ProfileStore(state)
    profile = make_profile(command=["python", "--api-key", "sk-secret"])
    with capture_logs() as logs:
        path = store.save(profile)
    assert path == state / "profiles" / f"{profile.key}.json"
    assert events(logs, "profile_saved")
    assert mode_of(state) == 0o700
    assert mode_of(state / "profiles") == 0o700
    assert mode_of(path) == 0o600
    assert "sk-secret" not in path.read_text()
    loaded = store.load(profile.key)
    assert loaded is not None
    assert loaded.created_at and loaded.updated_at
    assert dataclasses.replace(loaded, created_at="", updated_at="") == profile
    assert store.all() == [loaded]
    # a second save keeps created_at and moves updated_at
    again = store.save(dataclasses.replace(profile, probe={"passed": True, "requests": 16}))
    assert again == path
    reloaded = store.load(profile.key)
    assert reloaded is not None
    assert reloaded.created_at == loaded.created_at
    assert reloaded.probe == {"passed": True, "requests": 16}


def test_reading_needs_no_directory_and_creates_none(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path / "absent")
    assert store.load("0123456789abcdef") is None
    assert store.all() == []
    assert store.scan() == ([], [])
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(
    "key", ["../x", "../../etc/passwd", "ABCDEF0123456789", "abc", "0123456789abcdef/..", ""]
)
def test_invalid_keys_never_become_paths(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match="invalid profile key"):
        ProfileStore(tmp_path).path_for(key)


def test_save_refuses_a_profile_whose_key_does_not_match(tmp_path: Path) -> None:
    with capture_logs() as logs:
        assert ProfileStore(tmp_path).save(make_profile(key="0123456789abcdef")) is None
    assert "does not match" in events(logs, "profile_save_failed")[0]["error"]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"schema_version": 1, "key": "ab', "truncated"),
        ('{"schema_version": 9}', "schema_version 9"),
        ('{"schema_version": 1, "key": "x"}', "malformed profile"),
    ],
)
def test_bad_profile_is_set_aside_and_never_overwritten_without_backup(
    tmp_path: Path, content: str, fragment: str
) -> None:
    store = ProfileStore(tmp_path)
    profile = make_profile()
    path = store.path_for(profile.key)
    path.parent.mkdir(mode=0o700)
    path.write_text(content)
    with capture_logs() as logs:
        assert store.load(profile.key) is None
    (event,) = events(logs, "state_file_set_aside")
    assert fragment in event["reason"]
    assert Path(event["moved_to"]).read_text() == content
    # r1sup goes on: it re-tunes and saves a good profile next to the backup
    assert store.save(profile) == path
    assert store.load(profile.key) is not None
    assert Path(event["moved_to"]).read_text() == content


def test_profile_filed_under_another_key_is_set_aside(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    profile = make_profile()
    store.save(profile)
    wrong = store.path_for("0123456789abcdef")
    wrong.write_text(store.path_for(profile.key).read_text())
    with capture_logs() as logs:
        assert store.load("0123456789abcdef") is None
    assert "not 0123456789abcdef" in events(logs, "state_file_set_aside")[0]["reason"]
    assert [p.key for p in store.all()] == [profile.key]


def test_symlinked_profile_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    profile = make_profile(created_at="2025-01-01T00:00:00Z", updated_at="2025-01-01T00:00:00Z")
    outside.write_text(json.dumps(profile.to_dict()))
    store = ProfileStore(tmp_path / "state")
    path = store.path_for(profile.key)
    path.parent.mkdir(parents=True)
    path.symlink_to(outside)
    before = outside.read_text()
    with capture_logs() as logs:
        assert store.load(profile.key) is None  # not read through the link
    assert "symlink" in events(logs, "state_file_set_aside")[0]["reason"]
    path.symlink_to(outside)
    assert store.save(profile) == path  # the link is set aside, a regular file written in its place
    assert not path.is_symlink()
    assert outside.read_text() == before


def test_symlinked_profiles_dir_is_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    profile = make_profile(created_at="2025-01-01T00:00:00Z", updated_at="2025-01-01T00:00:00Z")
    (elsewhere / f"{profile.key}.json").write_text(json.dumps(profile.to_dict()))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "profiles").symlink_to(elsewhere)
    read_only = ProfileStore(state, repair=False)
    assert read_only.all() == []
    assert "symlink" in read_only.scan()[1][0][1]
    assert (state / "profiles").is_symlink()  # reported, not moved
    store = ProfileStore(state)
    assert store.load(profile.key) is None
    assert store.save(profile) == state / "profiles" / f"{profile.key}.json"
    assert not (state / "profiles").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == [f"{profile.key}.json"]


def test_read_only_store_reports_bad_files_without_moving_them(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    good = make_profile()
    store.save(good)
    bad = store.path_for("00000000aaaaaaaa")
    bad.write_text("{")
    (store.directory / "README.json").write_text("{")  # not a profile name: ignored
    profiles_found, problems = ProfileStore(tmp_path, repair=False).scan()
    assert [p.key for p in profiles_found] == [good.key]
    assert problems == [(bad, problems[0][1])] and "truncated" in problems[0][1]
    assert bad.read_text() == "{"


def test_disk_full_keeps_old_profile_and_serving_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ProfileStore(tmp_path)
    old = make_profile()
    path = store.save(old)
    assert path is not None
    before = path.read_bytes()
    real_write = os.write

    def full_disk_write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_write)
    with capture_logs() as logs:
        assert store.save(dataclasses.replace(old, probe={"passed": False})) is None
    monkeypatch.undo()
    (event,) = events(logs, "profile_save_failed")
    assert "No space left on device" in event["error"]
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert store.save(dataclasses.replace(old, probe={"passed": False})) == path  # the next try works


def test_read_only_state_dir_keeps_old_profile(tmp_path: Path) -> None:
    store = ProfileStore(tmp_path)
    old = make_profile()
    path = store.save(old)
    assert path is not None
    before = path.read_bytes()
    path.parent.chmod(0o500)
    try:
        if os.access(path.parent, os.W_OK):
            pytest.skip("running as root: chmod does not stop writes (see the tmpfs tests)")
        with capture_logs() as logs:
            assert store.save(dataclasses.replace(old, probe={"passed": False})) is None
        assert "Permission denied" in events(logs, "profile_save_failed")[0]["error"]
        assert path.read_bytes() == before
    finally:
        path.parent.chmod(0o700)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real small tmpfs at ``path`` (needs root and mount rights; else the test is skipped)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a real small file system needs root")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "r1sup-test", str(path)],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30, check=False)


@pytest.mark.timeout(60)
def test_real_full_file_system_keeps_old_profile(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "64k") as fs:
        store = ProfileStore(fs / "state")
        old = make_profile()
        path = store.save(old)
        assert path is not None
        before = path.read_bytes()
        with open(fs / "filler", "wb", buffering=0) as filler:
            try:
                while filler.write(b"\0" * 4096):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        with capture_logs() as logs:
            assert store.save(dataclasses.replace(old, attempts=[{"pad": "x" * 8192}])) is None
        assert "No space left on device" in events(logs, "profile_save_failed")[0]["error"]
        assert path.read_bytes() == before
        assert [p.name for p in path.parent.iterdir()] == [path.name]
        (fs / "filler").unlink()
        assert store.save(dataclasses.replace(old, attempts=[{"pad": "x" * 8192}])) == path


@pytest.mark.timeout(60)
def test_real_read_only_file_system_keeps_old_profile(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "1m") as fs:
        store = ProfileStore(fs / "state")
        old = make_profile()
        path = store.save(old)
        assert path is not None
        before = path.read_bytes()
        remount = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, timeout=30)
        assert remount.returncode == 0, remount.stderr
        with capture_logs() as logs:
            assert store.save(dataclasses.replace(old, probe={"passed": False})) is None
        assert "Read-only file system" in events(logs, "profile_save_failed")[0]["error"]
        assert path.read_bytes() == before
        assert store.load(old.key) is not None


FILE_SIZE_LIMITED_SAVER = """
import json, resource, signal, sys
from pathlib import Path
from r1sup.adapters import logs
from r1sup.state import profiles

logs.configure(level="info", fmt="json", stream=sys.stderr)
data = json.loads(Path(sys.argv[2]).read_text())
profile = profiles.Profile.from_dict(data)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
saved = profiles.ProfileStore(sys.argv[1]).save(profile)
print(json.dumps({"saved": None if saved is None else str(saved)}))
"""


@pytest.mark.timeout(60)
def test_write_failure_in_a_real_process_keeps_old_profile(tmp_path: Path) -> None:
    """A real process whose file-size limit stops the write half-way, like a disk filling up."""
    state = tmp_path / "state"
    store = ProfileStore(state)
    old = make_profile()
    path = store.save(old)
    assert path is not None
    before = path.read_bytes()
    bigger = dataclasses.replace(old, attempts=[{"pad": "x" * 4096}], updated_at="2025-01-01T00:00:00Z")
    bigger = dataclasses.replace(bigger, created_at="2025-01-01T00:00:00Z")
    new_file = tmp_path / "new.json"
    new_file.write_text(json.dumps(bigger.to_dict()))
    done = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMITED_SAVER, str(state), str(new_file)],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"saved": None}
    failures = [json.loads(line) for line in done.stderr.splitlines() if "profile_save_failed" in line]
    assert failures and "File too large" in failures[0]["error"]
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# --- export and import -------------------------------------------------------------------------


def test_export_then_import_on_an_identical_box(tmp_path: Path) -> None:
    here = ProfileStore(tmp_path / "here")
    profile = make_profile()
    here.save(profile)
    exported = here.export(profile.key, tmp_path / "exported.json")
    assert mode_of(exported) == 0o600
    there = ProfileStore(tmp_path / "there")
    imported, differences = there.import_file(exported, fp_with())
    assert differences == []
    assert imported.key == profile.key and imported.imported is None
    assert there.load(profile.key) == imported
    assert exported.exists()  # the user's file is left where it was


def test_import_refuses_another_box_unless_forced(tmp_path: Path) -> None:
    here = ProfileStore(tmp_path / "here")
    profile = make_profile()
    here.save(profile)
    exported = here.export(profile.key, tmp_path / "exported.json")
    there = ProfileStore(tmp_path / "there")
    other_box = fp_with(device=gpu_box(name="NVIDIA A100-SXM4-80GB", total_bytes=80 * GIB))
    with pytest.raises(ConfigError) as info:
        there.import_file(exported, other_box)
    message = str(info.value)
    assert info.value.field == "profile"
    assert "gpu.names: ['NVIDIA GeForce RTX 4090'] -> ['NVIDIA A100-SXM4-80GB']" in message
    assert "gpu.memory_gib: [24.0] -> [80.0]" in message
    assert "--force" in message
    assert there.all() == []
    imported, differences = there.import_file(exported, other_box, force=True)
    assert len(differences) == 2
    assert imported.key == fingerprint_key(other_box)
    assert imported.fingerprint == other_box
    assert imported.imported == {
        "from": str(exported),
        "original_key": profile.key,
        "differences": differences,
    }
    assert there.lookup(other_box) == imported


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (None, "file not found"),
        ('{"schema_version": 1', "truncated"),
        ('{"schema_version": 3}', "schema_version 3"),
        ('{"schema_version": 1, "key": "../x"}', "malformed profile"),
    ],
)
def test_import_of_a_bad_file_is_a_config_error(tmp_path: Path, content: str | None, fragment: str) -> None:
    src = tmp_path / "in.json"
    if content is not None:
        src.write_text(content)
    with pytest.raises(ConfigError, match=fragment):
        ProfileStore(tmp_path / "state").import_file(src, fp_with())
    if content is not None:
        assert src.read_text() == content
    assert not (tmp_path / "state").exists()


def test_export_of_a_missing_profile_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no saved profile"):
        ProfileStore(tmp_path).export("0123456789abcdef", tmp_path / "out.json")


def test_import_write_failure_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = ProfileStore(tmp_path / "here")
    profile = make_profile()
    here.save(profile)
    exported = here.export(profile.key, tmp_path / "exported.json")
    blocked = tmp_path / "blocked"
    blocked.write_text("")  # the state dir is a file: a ConfigError names state.dir
    with pytest.raises(ConfigError, match="state.dir"):
        ProfileStore(blocked).import_file(exported, fp_with())
    there = tmp_path / "there"
    real_write = os.write

    def full_disk_write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(there)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_write)
    with pytest.raises(StateWriteError, match="No space left"):
        ProfileStore(there).import_file(exported, fp_with())
    monkeypatch.undo()
    assert ProfileStore(there).all() == []


# --- versions of the vLLM environment and the fingerprint of this box --------------------------


def test_current_fingerprint_wires_devices_model_and_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r1sup.adapters import devices, modelinfo
    from r1sup.core import config as cfg

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    model_config = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2}
    (model_dir / "config.json").write_text(json.dumps(model_config))
    probed: list[str] = []

    def fake_probe(cuda_visible_devices: str | None = None) -> DeviceFacts:
        probed.append("probe")
        return GPU_BOX

    monkeypatch.setattr(devices, "probe", fake_probe)
    # the versions as the preflight reads them (tests/test_preflight.py runs the real interpreters)
    monkeypatch.setattr(preflight, "engine_versions", lambda config: {"vllm": "0.33.0", "torch": "2.9.0"})
    config = cfg.build(
        {"model": {"name": str(model_dir)}, "target": {"concurrency": 8, "context": 4096}}, env={}
    )
    request = {"start": dataclasses.asdict(config.start), "ladder": dataclasses.asdict(config.search)}
    expected = fp_with(
        model=str(model_dir), model_config_hash=modelinfo.config_hash(model_config), request=request
    )
    assert profiles.current_fingerprint(config) == expected
    # another [start] (what the search starts from) is another key: the profile is not reused
    edited = cfg.build(
        {
            "model": {"name": str(model_dir)},
            "target": {"concurrency": 8, "context": 4096},
            "start": {"max_model_len": 4096},
        },
        env={},
    )
    changed = profiles.current_fingerprint(edited, device=GPU_BOX)
    assert profiles.fingerprint_key(changed) != profiles.fingerprint_key(expected)
    assert "request.start.max_model_len: (unknown) -> 4096" in profiles.diff_fingerprints(expected, changed)
    assert probed == ["probe"]
    assert profiles.current_fingerprint(config, device=GPU_BOX) == expected  # facts already probed
    assert probed == ["probe"]
    missing = cfg.build({"model": {"name": str(tmp_path / "no-such-model")}}, env={})
    with capture_logs() as logs:
        fp = profiles.current_fingerprint(missing, device=CPU_BOX)
    assert fp["model"] == {"id": str(tmp_path / "no-such-model"), "config_hash": None}
    assert events(logs, "model_config_unavailable")


def test_cpu_fingerprint_uses_the_machines_memory_not_numa_node0():
    # NUMA node 0's MemTotal moves on VMs with hot-plugged memory; the machine's RAM does not
    base = DeviceFacts(
        backend="cpu", cpu_model="EPYC", host_total_bytes=8 * GIB, machine_memory_bytes=24 * GIB
    )
    moved = dataclasses.replace(base, host_total_bytes=14 * GIB)
    kw = dict(
        model="m", model_config_hash=None, versions={}, target={}, tensor_parallel_size=1, r1sup_version="0.1"
    )
    assert fingerprint_key(fingerprint(device=base, **kw)) == fingerprint_key(fingerprint(device=moved, **kw))
    bigger = dataclasses.replace(base, machine_memory_bytes=48 * GIB)
    assert fingerprint_key(fingerprint(device=base, **kw)) != fingerprint_key(
        fingerprint(device=bigger, **kw)
    )


# --- the verified capacity (r1sup.core.capacity) -------------------------------------------------------


PASSED = {
    "ok": True,
    "concurrency": 4,
    "concurrency_proven": 2,
    "prompt_tokens": 8020,
    "output_tokens": 16,
    "output_tokens_per_s": 96.5,
    "ttft_p50_s": 0.21,
    "ttft_p95_s": 0.4,
}


def _verified(
    probe: dict[str, Any],
    flags: dict[str, Any],
    figures: Figures | None,
    asked: dict[str, Any],
    reduced: bool = False,
) -> capacity.Capacity | None:
    """The capacity of a probe record, its flags' and what was asked (as they are stored)."""
    return capacity.verified(
        ProbeResult.from_dict(probe),
        flags.get("max_model_len"),
        figures,
        capacity.Asked.from_dict(asked),
        reduced,
    )


def test_the_capacity_a_probe_proved_is_saved_and_read_back() -> None:
    from dataclasses import replace

    flags = {"max_model_len": 8192}
    verified = _verified(PASSED, flags, Figures(kv_cache_tokens=101456), {"requests": 4, "context": 16384})
    assert verified is not None
    assert (verified.requests, verified.context_tokens, verified.kv_cache_tokens) == (
        2,
        8192,
        101456,
    )
    assert verified.probe_tokens == 8036 and verified.output_tokens_per_second == 96.5
    assert verified.reduced and verified.reduced_because == (
        "2 request(s) at once of 4 asked",
        "context 8,192 of 16,384 asked",
    )
    profile = replace(
        make_profile(created_at="2025-01-01T00:00:00Z", updated_at="2025-01-02T00:00:00Z"),
        capacity=verified.to_dict(),
    )
    data = json.loads(json.dumps(profile.to_dict()))
    assert Profile.from_dict(data) == profile and data["schema_version"] == 1
    # a profile saved before the capacity was recorded reads as it is
    assert "capacity" not in _valid() and Profile.from_dict(_valid()).capacity == {}


@pytest.mark.parametrize(
    ("probe", "flags", "asked", "requests", "reduced"),
    [
        (PASSED, {"max_model_len": 8192}, {"requests": 2, "context": 8192}, 2, False),
        ({**PASSED, "ok": False}, {"max_model_len": 8192}, {}, None, None),  # failed: nothing proven
        ({k: v for k, v in PASSED.items() if k != "concurrency_proven"}, {}, {"requests": 1}, None, False),
        (PASSED, {}, {"requests": None, "context": None}, 2, False),  # nothing asked: nothing reduced
    ],
)
def test_what_a_probe_proves(
    probe: dict[str, Any],
    flags: dict[str, Any],
    asked: dict[str, Any],
    requests: int | None,
    reduced: bool | None,
) -> None:

    verified = _verified(probe, flags, None, asked)
    if reduced is None:
        assert verified is None
        return
    assert verified is not None and verified.requests == requests and verified.reduced is reduced
    # the search's own verdict adds to what the figures show, never hides it
    again = _verified(probe, flags, None, asked, reduced=True)
    assert again is not None and again.reduced


WAVE = {
    "requests": 16,
    "sent": 16,
    "prompt_tokens": 250,
    "concurrency_proven": 16,
    "limit": 16,
    "output_tokens_per_s": 812.0,
    "ttft_p50_s": 0.05,
    "ttft_p95_s": 0.09,
}


def test_the_wave_gives_the_requests_at_once_and_the_context_requests_stay_beside_them() -> None:

    probe = {**PASSED, "concurrency": 1, "concurrency_proven": 1, "wave": WAVE}
    asked = {"requests": 1, "context": 8192, "concurrent": 16}
    c = _verified(probe, {"max_model_len": 8192}, None, asked)
    assert c is not None and not c.reduced, c
    assert (c.requests, c.concurrent_prompt_tokens, c.context_requests) == (16, 250, 1)
    # the throughput and TTFT are the wave's, measured at the 16 at once
    assert (c.output_tokens_per_second, c.ttft_p50_s, c.ttft_p95_s) == (812.0, 0.05, 0.09)
    assert c.probe_tokens == 8036  # the context requests' size, as before
    # each group with its own size; tokens/s and TTFT inside the brackets of the group they were measured at
    assert c.text() == (
        "measured: 16 request(s) at once of ~250 prompt tokens (812.0 output tok/s, TTFT p50 0.05s p95 "
        "0.09s), 1 at once of ~8,036 tokens; computed: context 8,192 tokens"
    )
    assert capacity.check(json.loads(json.dumps(c.to_dict()))) == c.to_dict()


def test_the_capacity_line_says_what_ran_and_what_is_computed_of_the_context() -> None:
    """Issue 36, a 7B on an RTX 4090: two short long-context probes seen together and a wave of 5 must
    not read "2 of up to 131,072 tokens" beside a 216,032-token cache (1.65 such requests)."""

    probe = {
        **PASSED,
        "prompt_tokens": 1200,
        "output_tokens": 16,
        "concurrency_proven": 2,
        "ttft_p50_s": 0.06,
        "wave": {**WAVE, "sent": 5, "concurrency_proven": 5, "limit": 5, "prompt_tokens": 252},
    }
    asked = {"requests": 4, "context": 131072, "concurrent": 5}
    c = _verified(probe, {"max_model_len": 131072}, Figures(kv_cache_tokens=216032), asked)
    assert c is not None
    line = c.text()
    measured, computed = line.split("; computed: ")
    # what ran at once, each group with the size it had; nothing measured claims the context
    assert measured.startswith("measured: 5 request(s) at once of ~252 prompt tokens (")
    assert measured.endswith("), 2 at once of ~1,216 tokens")
    assert "131,072" not in measured
    # the context is the flags', and what the cache holds of it is computed from vLLM's figure
    assert computed.startswith("context 131,072 tokens, 1.65 such requests fit vLLM's 216,032-token KV cache")
    assert computed.endswith("(REDUCED: 2 request(s) at once of 4 asked)")
    # one TTFT, the wave's: the one the wave's own line and status's TTFT column give
    assert line.count("TTFT") == 1 and "TTFT p50 0.05s p95 0.09s" in line
    assert "TTFT p50 0.05s p95 0.09s" in ProbeResult.from_dict(probe).summary()


@pytest.mark.parametrize(
    ("record", "measured"),
    [
        # one group: the requests at once are the context requests, with their size
        (
            {"requests": 2, "context_requests": 2, "probe_tokens": 8036, "ttft_p50_s": 0.21},
            "measured: 2 request(s) at once of ~8,036 tokens (TTFT p50 0.21s)",
        ),
        # a record saved before the size was kept: said so, never the context in its place
        ({"requests": 2, "context_tokens": 8192}, "measured: 2 request(s) at once of a size not recorded"),
        ({"context_tokens": 8192}, "measured: requests at once not measured"),
    ],
)
def test_the_capacity_line_of_one_group_and_of_old_records(record: dict[str, Any], measured: str) -> None:
    c = capacity.Capacity.from_dict(record)
    assert c is not None
    assert c.text().split("; computed: ")[0] == measured


@pytest.mark.parametrize(
    ("wave", "asked_concurrent", "requests", "because"),
    [
        # the wave queued: 16 sent, 9 ran together (vLLM ran fewer than its own figures promised)
        (
            {**WAVE, "concurrency_proven": 9, "waiting_peak": 7, "limit": 9},
            16,
            9,
            ["9 request(s) at once of ~250 prompt tokens of 16 asked"],
        ),
        # max_num_seqs 2 (lowered from vLLM's default): the wave sent 2, both ran
        (
            {**WAVE, "sent": 2, "concurrency_proven": 2, "limit": 2},
            16,
            2,
            ["2 request(s) at once of ~250 prompt tokens of 16 asked"],
        ),
        # the user's own max_num_seqs 2: 2 were asked, 2 proven
        ({**WAVE, "sent": 2, "concurrency_proven": 2, "limit": 2}, 2, 2, []),
        # 16 sent, none waited, 5 seen together: requests too short to overlap prove 5, show no limit
        ({**WAVE, "concurrency_proven": 5, "waiting_peak": 0}, 16, 5, []),
        # no wave (vLLM runs one such request at once): the context requests' figure, held against the ask
        (
            {"requests": 1, "limit": 1, "skipped": "vLLM would run no more than one"},
            16,
            1,
            ["1 request(s) at once of ~8,020 prompt tokens of 16 asked"],
        ),
    ],
)
def test_fewer_requests_at_once_than_asked_is_reduced_and_says_their_size(
    wave: dict[str, Any], asked_concurrent: int, requests: int, because: list[str]
) -> None:

    probe = {**PASSED, "concurrency": 1, "concurrency_proven": 1, "wave": wave}
    asked = {"requests": 1, "context": 8192, "concurrent": asked_concurrent}
    c = _verified(probe, {"max_model_len": 8192}, None, asked)
    assert c is not None and c.requests == requests and c.context_requests == 1
    assert list(c.reduced_because) == because and c.reduced == bool(because)


def test_a_probe_without_a_wave_is_not_held_against_the_concurrency_asked() -> None:
    """A record from before the wave (or a probe that was not asked for one) proves what it proves."""

    c = _verified(PASSED, {"max_model_len": 8192}, None, {"requests": 2, "concurrent": 16})
    assert c is not None and c.requests == 2 and c.asked_concurrent is None and not c.reduced


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("yes", "capacity must be an object"),
        ({"requests": "4"}, "capacity.requests"),
        ({"requests": True}, "capacity.requests"),
        ({"context_tokens": -1}, "capacity.context_tokens"),
        ({"reduced": "no"}, "capacity.reduced"),
        ({"reduced_because": "less"}, "capacity.reduced_because"),
        ({"tokens": 1}, "unknown field(s): tokens"),
    ],
)
def test_a_malformed_capacity_is_rejected(bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        Profile.from_dict(_with(capacity=bad))
    assert fragment in str(info.value)


# --- values past the bounds a launch takes (issue 34) -------------------------------------------------


def _probed(**probe: Any) -> dict[str, Any]:
    data = _valid()
    data["probe"] = {"ok": True, "requests": 8, "concurrency": 4, "prompt_tokens": 900, "output_tokens": 16}
    data["probe"].update(probe)
    return data


def _tamper(data: dict[str, Any], section: str, name: str, value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    data[section][name] = value
    return data


# each stopped every start: an OverflowError in the memory model (exit 1), or a launch vLLM refuses (exit 4)
PAST_BOUNDS = [
    ("flags", "cpu_offload_gb", 1e300, "flags.cpu_offload_gb: must be <="),
    ("flags", "max_model_len", 10**12, "flags.max_model_len: must be <="),
    ("flags", "max_num_seqs", 2**40, "flags.max_num_seqs: must be <="),
    ("flags", "kv_cache_memory_bytes", 2**60, "flags.kv_cache_memory_bytes: must be <="),
    ("observations", "weights_gib", 1e308, "observations.weights_gib: 1e+308 is past"),
    ("observations", "kv_cache_gib", -1e300, "observations.kv_cache_gib"),
    ("observations", "gpu_blocks", 10**18, "observations.gpu_blocks"),
    ("flags", "max_model_len", 1, "flags.max_model_len 1 cannot hold the 900 + 16 tokens"),
    ("flags", "max_model_len", 915, "flags.max_model_len 915 cannot hold"),
    # a key with a line break or a terminal escape is named quoted, escaped: the reason stays one line
    (
        "flags",
        "max_model_len",
        {"\n\x1b[31m": 2**63},
        'flags.max_model_len."\\n\\u001b[31m": 9223372036854775808',
    ),
]


@pytest.mark.parametrize(("section", "name", "value", "fragment"), PAST_BOUNDS, ids=lambda v: str(v)[:20])
def test_a_profile_past_the_bounds_is_set_aside_with_one_line(
    tmp_path: Path, section: str, name: str, value: Any, fragment: str
) -> None:
    store = ProfileStore(tmp_path)
    good = _probed()
    path = store.path_for(good["key"])
    path.parent.mkdir(mode=0o700)
    path.write_text(json.dumps(_tamper(good, section, name, value)))
    with capture_logs() as logs:
        assert store.load(good["key"]) is None
    (event,) = events(logs, "state_file_set_aside")
    assert fragment in event["reason"] and "\n" not in event["reason"] and len(event["reason"]) < 200


def test_a_context_that_holds_what_the_probe_sent_is_kept() -> None:
    assert (
        Profile.from_dict(_tamper(_probed(), "flags", "max_model_len", 916)).engine_flags.max_model_len == 916
    )
    # a context of vLLM's default, and a probe whose prompt was estimated, ask only one token each way
    assert (
        Profile.from_dict(_tamper(_probed(), "flags", "max_model_len", None)).engine_flags.max_model_len
        is None
    )
    estimated = _tamper(_probed(prompt_tokens_estimated=True), "flags", "max_model_len", 2)
    assert Profile.from_dict(estimated).engine_flags.max_model_len == 2
    with pytest.raises(ValueError, match="one prompt token and one output token"):
        Profile.from_dict(_tamper(_probed(ok=False), "flags", "max_model_len", 1))


def test_every_flag_a_profile_may_hold_is_one_the_memory_model_computes_with() -> None:
    """At each [start] bound, the flags pass the profile reader and the memory model takes them."""
    from r1sup.core import config as cfg
    from r1sup.core import memmodel, modelarch

    arch = modelarch.arch_from_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "torch_dtype": "bfloat16",
        }
    )
    at_bounds = {
        "max_model_len": cfg.MAX_CONTEXT_TOKENS,
        "max_num_seqs": cfg.MAX_SEQS,
        "max_num_batched_tokens": cfg.MAX_CONTEXT_TOKENS,
        "kv_cache_memory_bytes": cfg.MAX_KV_CACHE_BYTES,
        "cpu_offload_gb": cfg.MAX_OFFLOAD_GIB,
    }
    flags = Profile.from_dict(_with(flags=at_bounds)).engine_flags
    assert memmodel.weights_bytes(arch, flags) >= 0


def test_a_profile_written_when_search_was_called_ladder_is_found_for_either_spelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile saved by r1sup 0.1, whose fingerprint names the config's [search] by its old name
    ("ladder"), is still the one found for the same wishes, written [search] or [ladder]: the fingerprint
    keeps that name, so renaming the section moves no key (and no fleet's shared profile)."""
    from r1sup.adapters import modelinfo
    from r1sup.core import config as cfg

    written = Path(__file__).parent / "fixtures" / "profiles" / "written-by-0.1-with-ladder.json"
    old_key = json.loads(written.read_text(encoding="utf-8"))["key"]
    store_dir = tmp_path / "state" / "profiles"
    store_dir.mkdir(parents=True, mode=0o700)
    (store_dir / f"{old_key}.json").write_bytes(written.read_bytes())
    (store_dir / f"{old_key}.json").chmod(0o600)
    model_config = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28}
    monkeypatch.setattr(modelinfo, "load_model_config", lambda name, revision=None: model_config)
    monkeypatch.setattr(preflight, "engine_versions", lambda config: {"vllm": "0.33.0", "torch": "2.9.0"})
    store = ProfileStore(tmp_path / "state")
    wishes = {"max_attempts": 4, "allow_weight_quantization": True}
    for section in ("search", "ladder"):
        body = {
            "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
            "target": {"concurrency": 8, "context": 4096},
            section: wishes,
        }
        fp = profiles.current_fingerprint(cfg.build(body, env={}), device=GPU_BOX)
        found = store.load(fingerprint_key(fp))
        assert found is not None and found.key == old_key, section
        assert (found.flags["max_model_len"], found.flags["kv_cache_dtype"]) == (4096, "fp8")
    other = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "target": {"concurrency": 8, "context": 4096}}
    assert (
        store.load(fingerprint_key(profiles.current_fingerprint(cfg.build(other, env={}), device=GPU_BOX)))
        is None
    )
