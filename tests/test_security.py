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
from r1sup.adapters import apikey, logs
from r1sup.adapters.health import Endpoint
from r1sup.cli.app import main
from r1sup.core import config as cfg
from r1sup.core.errors import ConfigError
from r1sup.core.figures import Figures
from r1sup.core.probing import ProbeResult
from r1sup_proc import R1sup, engine_processes, kill_engine_processes, write_config

FAKE_ENV = {"PYTHONPATH": f"{ROOT / 'tests' / 'fakenvml'}:{ROOT / 'tests'}"}


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
        st.sampled_from(
            ["model", "server", "start", "search", "ladder", "target", "probe", "daemon", "state", "x"]
        ),
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
    from r1sup.adapters import statefiles

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

    from r1sup.adapters import statefiles

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
        "import sys, time; from r1sup.adapters import statefiles; "
        f"statefiles.lock_state_dir({str(tmp_path / 'state')!r}, 'holder'); print('held', flush=True); "
        "time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
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

    from r1sup.adapters import launcher

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
    from r1sup.adapters import launcher

    me = os.getppid()  # alive, but started at another time than the mark says
    assert launcher.owner_alive(launcher.owner_mark(me))
    assert not launcher.owner_alive(f"{me}:12345.00")
    for bad in (None, "", "x", "0:0", "-1:5", f"{os.getpid()}:1", "99999999:1.0"):
        assert not launcher.owner_alive(bad)


# --- profiles, store entries, leases, status files and configs are untrusted input (issue 26) -------

# What vLLM 0.32/0.33 accepts for the flags r1sup manages, from its own declarations (CacheDType in
# vllm/config/cache.py, QuantizationMethods in vllm/model_executor/layers/quantization/__init__.py) and
# its argument types; stated here on its own, not taken from r1sup's checks.
VLLM_KV_DTYPES = {
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
}  # fmt: skip
VLLM_QUANTIZATIONS = {
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token", "mxfp8",
    # not in 0.32's list, but accepted by the earlier releases r1sup also supports, and in [start]'s choices
    "bitsandbytes",
}  # fmt: skip


INT_FLAGS = (
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--tensor-parallel-size",
    "--kv-cache-memory-bytes",
)


def vllm_refuses(argv: list[str]) -> str | None:
    """Why vLLM's argument parser would refuse these flags (the ones EngineFlags.to_argv writes)."""
    import math

    def positive_int(text: str) -> bool:
        return text.isdigit() and int(text) >= 1

    def number(text: str) -> float | None:
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) else None

    i = 0
    while i < len(argv):
        name = argv[i]
        if name == "--enforce-eager":
            i += 1
            continue
        value = argv[i + 1]
        i += 2
        if value.startswith("-"):
            return f"{name} {value}: a value that reads as a flag"
        if name == "--kv-cache-dtype" and value not in VLLM_KV_DTYPES:
            return f"{name} {value}"
        if name == "--quantization" and value not in VLLM_QUANTIZATIONS:
            return f"{name} {value}"
        if name in INT_FLAGS and not positive_int(value):
            return f"{name} {value}"
        if name == "--gpu-memory-utilization":
            util = number(value)
            if util is None or not 0 < util <= 1:
                return f"{name} {value}"
        if name == "--cpu-offload-gb":
            gb = number(value)
            if gb is None or gb < 0:
                return f"{name} {value}"
    return None


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        ["x", "", "fp8; touch /tmp/pwned", "--trust-remote-code", "fp8", "auto", "fp8_e5m2", "0"]
    ),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FLAG_NAMES = [
    "max_model_len", "gpu_memory_utilization", "kv_cache_dtype", "enforce_eager", "max_num_seqs",
    "max_num_batched_tokens", "quantization", "tensor_parallel_size", "kv_cache_memory_bytes",
    "cpu_offload_gb",
]  # fmt: skip
OBS_NAMES = [
    "kv_cache_tokens",
    "weights_gib",
    "kv_cache_gib",
    "max_concurrency",
    "peak_activation_gib",
    "note",
]
PROBE_NAMES = ["ok", "requests", "succeeded", "concurrency", "prompt_tokens", "sizing", "ttft_p50_s"]
TOP_NAMES = [
    "model",
    "served_name",
    "command",
    "attempts",
    "conditions",
    "imported",
    "r1sup_version",
    "extra",
]


def _a_valid_profile() -> dict:
    from r1sup.state.profiles import Profile

    fp = {"backend": "cuda", "model": {"id": "org/m"}, "tensor_parallel_size": 1}
    profile = Profile.create(
        fingerprint=fp,
        model="org/m",
        served_name="m",
        flags={"max_model_len": 8192, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"},
        command=["python", "-m", "vllm.entrypoints.openai.api_server"],
        probe={"ok": True, "requests": 8, "succeeded": 8, "concurrency": 4, "prompt_tokens": 100},
        observations=Figures(kv_cache_tokens=40000, weights_gib=14.2, kv_cache_gib=3.1),
    )
    data = profile.to_dict()
    data.update(created_at="2026-01-01T00:00:00Z", updated_at="2026-01-01T00:00:00Z")
    return data


EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flags", "observations", "probe", None]),
        st.sampled_from(FLAG_NAMES + OBS_NAMES + PROBE_NAMES + TOP_NAMES),
        HOSTILE,
    ),
    min_size=1,
    max_size=4,
)


def _use_profile(profile) -> None:
    """What r1sup does with a profile it accepted: build vLLM's command line and compute with its figures."""
    from r1sup.adapters import probe
    from r1sup.core import flags as flagmod
    from r1sup.core import memmodel, modelarch

    engine = profile.engine_flags
    argv = engine.to_argv()
    assert vllm_refuses(argv) is None, (vllm_refuses(argv), profile.flags)
    flagmod.short(profile.flags)
    arch = modelarch.arch_from_config(
        {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
         "torch_dtype": "bfloat16", "max_position_embeddings": 4096}
    )  # fmt: skip
    memmodel.kv_bytes_per_token(arch, engine.kv_cache_dtype, engine.tensor_parallel_size)
    obs = profile.observations
    probe.short_prompt_tokens(1000, obs.kv_cache_tokens, 50000.0)
    probe.probe_requests(16, 4, 100, ProbeResult.from_dict(profile.probe))
    obs.memory_in_use_gib()


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(edits=EDITS)
def test_no_profile_or_store_entry_crashes_r1sup_or_reaches_vllm_refused(tmp_path_factory, edits):
    from r1sup.state.fleet import DirectoryStore
    from r1sup.state.profiles import ProfileStore

    data = _a_valid_profile()
    for section, name, value in edits:
        (data[section] if section else data)[name] = value
    text = json.dumps(data, allow_nan=True, default=str)
    root = tmp_path_factory.mktemp("p")
    key = data["key"]
    for directory in (root / "state" / "profiles", root / "store" / "profiles"):
        directory.mkdir(parents=True)
        (directory / f"{key}.json").write_text(text)
    local = ProfileStore(root / "state").load(key)
    shared = DirectoryStore(root / "store", tell=lambda event: None).lookup(key)
    assert (local is None) == (shared is None)  # one validation for both
    for profile in (local, shared):
        if profile is not None:
            _use_profile(profile)
    if local is None:  # set aside with its reason, never left to fail the next start
        assert not (root / "state" / "profiles" / f"{key}.json").exists()
        assert list((root / "state" / "profiles").glob(f"{key}.json.bad-*"))


def test_the_issues_profiles_are_refused_with_the_field_named():
    from r1sup.state.profiles import Profile

    for section, name, value in [
        ("observations", "kv_cache_tokens", "x"),
        ("flags", "kv_cache_dtype", "fp8; touch /tmp/x"),
        ("flags", "quantization", "--trust-remote-code"),
        ("observations", "weights_gib", float("nan")),
        ("flags", "tensor_parallel_size", 0),
        ("flags", "gpu_memory_utilization", 0.0),
        ("flags", "gpu_memory_utilization", float("inf")),
        ("flags", "max_model_len", -5),
        ("flags", "max_num_seqs", 2**80),
    ]:
        data = _a_valid_profile()
        data[section][name] = value
        with pytest.raises(ValueError, match=name):
            Profile.from_dict(json.loads(json.dumps(data, allow_nan=True)))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    record=st.fixed_dictionaries(
        {},
        optional={
            "owner": HOSTILE,
            "host": HOSTILE,
            "pid": HOSTILE,
            "boot_id": HOSTILE,
            "pid_ns": HOSTILE,
            "expires_at": HOSTILE,
            "key": HOSTILE,
        },
    )
)
def test_no_lease_record_crashes_a_replica_or_holds_forever(tmp_path_factory, record):
    import math
    import time

    from r1sup.state.fleet import DirectoryStore, Holder, Lease

    root = tmp_path_factory.mktemp("lease")
    (root / "leases").mkdir()
    key = "0123456789abcdef"
    (root / "leases" / f"{key}.lease").write_text(json.dumps(record, allow_nan=True, default=str))
    got = DirectoryStore(root, tell=lambda event: None).try_acquire(key, 30.0)
    if isinstance(got, Lease):
        got.release()
    elif isinstance(got, Holder):  # it stands: a record a live holder could have written
        assert math.isfinite(got.expires_at) and got.pid >= 1
        assert got.expires_at + 5.0 >= time.time()


def test_a_lease_with_a_nan_or_infinite_expiry_or_pid_0_is_expired():
    import time

    from r1sup.state.fleet import Holder, stale

    now = time.time()
    for record in (
        Holder("o", "node-a", 5, None, None, float("nan")),
        Holder("o", "node-a", 5, None, None, float("inf")),
        Holder("o", "node-a", 0, None, None, now + 100),
        Holder("o", "node-a", -3, None, None, now + 100),
    ):
        assert stale(record, now, HERE_FOR_LEASES, lambda pid: True) is not None, record
    assert (
        stale(Holder("o", "node-a", 5, None, None, now + 100), now, HERE_FOR_LEASES, lambda pid: True) is None
    )


HERE_FOR_LEASES = __import__("r1sup.state.fleet", fromlist=["Here"]).Here("node-b", 1, None, None)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(status=st.dictionaries(st.sampled_from([
    "schema_version", "state", "pid", "child_pid", "updated_at", "flags", "served_model", "port", "url",
    "max_model_len", "kv_cache_tokens", "memory_gib", "progress", "degraded", "last_failure", "since",
]), HOSTILE, max_size=10))  # fmt: skip
def test_no_status_file_crashes_r1sup_status(tmp_path_factory, status):
    from r1sup.cli.commands.status import collect, render

    root = tmp_path_factory.mktemp("status")
    status.setdefault("schema_version", 1)
    (root / "status.json").write_text(json.dumps(status, allow_nan=True, default=str))
    report = collect(root)
    render(report)
    json.dumps(report, default=str)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(start=st.dictionaries(st.sampled_from(FLAG_NAMES), HOSTILE, max_size=4))
def test_no_config_start_section_reaches_vllm_refused(start):
    from r1sup.core.flags import EngineFlags

    try:
        config = cfg.build({"model": {"name": "m"}, "start": start}, env={})
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    argv = EngineFlags.from_start(config.start).to_argv()
    assert vllm_refuses(argv) is None, (vllm_refuses(argv), start)


def test_the_key_is_masked_when_vllm_prints_it_escaped(tmp_path: Path):
    """vLLM logs its arguments as a Python repr, and JSON escapes: a key with quotes and backslashes
    must be masked in those forms too, not only as typed in the key file."""
    key = "sk-" + secrets.token_hex(6) + "\"q'uo\\te\\\\d"
    key_file = tmp_path / "api.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    config = cfg.build({"model": {"name": "m"}, "server": {"api_key_file": str(key_file)}}, env={})
    loaded = apikey.load_api_key(config, environ={})
    assert loaded == key
    out = io.StringIO()
    logs.configure(fmt="json", stream=out, secrets=apikey.secret_values(config, loaded))
    printed = [
        f"non-default args: {{'model': 'm', 'api_key': {key!r}}}",  # vLLM's own arguments line
        f"args: Namespace(api_key={key!r}, host='127.0.0.1')",
        "request " + json.dumps({"authorization": f"Bearer {key}"}),  # JSON-escaped
        f"raw {key} end",
    ]
    for text in printed:
        logs.get_logger().info("vllm", source="vllm", text=text)
    logs.get_logger().error("fatal_failure", evidence=printed[0])
    rendered = out.getvalue()
    for form in (key, repr(key)[1:-1], json.dumps(key)[1:-1]):
        assert form not in rendered, form
        for text in printed:
            assert form not in logs.mask(text)
    assert rendered.count("***") >= len(printed) + 1
    assert "non-default args" in rendered and "Bearer ***" in rendered
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    fifo_config = cfg.build({"model": {"name": "m"}, "server": {"api_key_file": str(fifo)}}, env={})
    with pytest.raises(ConfigError, match="not a regular file"):  # refused without blocking on it
        apikey.load_api_key(fifo_config, environ={})
