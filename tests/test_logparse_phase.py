"""The reader on logs people paste: the run's phase from its own traffic, the cause printed after the death
notice, the CUDA error inside a WARNING, NCCL and host-memory failures (issue 24).

The lines are written from vLLM's, torch's and Ray's message formats (their stamps and wording), each
case with the failure it must give; the real excerpts of each kind are measured by
``benchmarks/eval_classifier.py``.
"""

from __future__ import annotations

import pytest

from r1sup.core import failure as fl
from r1sup.core.logparse import LogReader, diagnose_text
from r1sup.core.logparse.phase import traffic

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "23.57 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 22.50 GiB memory in "
    "use."
)
STARTUP = [
    "INFO 05-02 10:00:01 [gpu_model_runner.py:1329] Starting to load model /models/qwen...",
    "INFO 05-02 10:00:09 [gpu_model_runner.py:1347] Model loading took 14.25 GiB and 7.1 seconds",
    "INFO 05-02 10:00:21 [kv_cache_utils.py:634] GPU KV cache size: 61,440 tokens",
    "INFO 05-02 10:00:40 [core.py:159] init engine (profile, create kv cache, warmup model) took 31.2 "
    "seconds",
]


def verdict(lines: list[str]) -> fl.Failure:
    return diagnose_text(lines)[0]


# --------------------------------------------------------------------------------------------
# The phase from request traffic


@pytest.mark.parametrize(
    "line",
    [
        'INFO:     10.0.0.7:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        'INFO:     10.0.0.7:51234 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error',
        "INFO 02-14 08:44:26 engine.py:275] Added request chatcmpl-4fb99a59.",
        "INFO 06-01 12:00:00 [logger.py:41] Received request cmpl-9d1e: prompt: 'hi', params: ...",
        "INFO 06-01 12:00:10 [loggers.py:116] Engine 000: Avg prompt throughput: 812.3 tokens/s, Avg "
        "generation throughput: 40.1 tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 12.0%",
    ],
)
def test_a_runtime_oom_after_traffic_is_oom_runtime(line: str) -> None:
    # the excerpt keeps no start-up milestone and no frame: the traffic alone says the server was serving
    failure = verdict([line, OOM])
    assert (failure.cls, failure.phase) == (fl.OOM_RUNTIME, fl.PHASE_SERVING)
    assert failure.numbers.tried_to_allocate_mib == 2048


def test_idle_statistics_are_not_traffic() -> None:
    idle = (
        "INFO 06-01 12:00:10 [loggers.py:116] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg "
        "generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%"
    )
    assert not traffic(idle.split("] ", 1)[1])
    assert verdict([idle, OOM]).cls == fl.OOM_WEIGHTS  # no milestone, no frame, no traffic: the first step


def test_the_request_answered_500_after_the_oom_places_it_in_serving() -> None:
    lines = [
        '  File "/usr/lib/python3/site-packages/vllm/model_executor/layers/quantization/awq.py", line 169, '
        "in apply",
        "    out = ops.awq_dequantize(qweight, scales, qzeros, 0, 0, 0)",
        OOM,
        'INFO:     10.1.2.3:41576 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    ]
    assert verdict(lines).cls == fl.OOM_RUNTIME


def test_traffic_after_a_start_up_step_in_the_ooms_traceback_does_not_move_it() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "/opt/vllm/v1/worker/gpu_worker.py", line 212, in load_model',
        "    self.model_runner.load_model()",
        OOM,
        'INFO:     10.1.2.3:41576 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    ]
    assert verdict(lines).cls == fl.OOM_WEIGHTS


def test_a_new_start_up_after_the_traffic_is_a_start_up_again() -> None:
    lines = [
        "INFO 02-14 08:44:26 engine.py:275] Added request chatcmpl-1.",
        *STARTUP[:2],
        "Traceback (most recent call last):",
        '  File "/opt/vllm/v1/worker/gpu_model_runner.py", line 1811, in profile_run',
        "    hidden_states = self._dummy_run(self.max_num_tokens)",
        OOM,
    ]
    assert verdict(lines).cls == fl.OOM_PROFILE


def test_an_oom_in_execute_model_frames_is_runtime_without_readiness() -> None:
    lines = [
        "ERROR 06-13 07:35:59 [core.py:517] Traceback (most recent call last):",
        'ERROR 06-13 07:35:59 [core.py:517]   File "/usr/vllm/v1/engine/core.py", line 535, in run_busy_loop',
        "ERROR 06-13 07:35:59 [core.py:517]     self._process_engine_step()",
        'ERROR 06-13 07:35:59 [core.py:517]   File "/usr/vllm/v1/worker/gpu_model_runner.py", line 1200, in '
        "execute_model",
        "ERROR 06-13 07:35:59 [core.py:517]     logits = self.model.compute_logits(sample_hidden_states, "
        "None)",
        f"ERROR 06-13 07:35:59 [core.py:517] {OOM}",
    ]
    assert verdict(lines).cls == fl.OOM_RUNTIME


def test_a_vllm_serving_chat_frame_is_serving() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "/usr/vllm/entrypoints/openai/serving_chat.py", line 306, in '
        "chat_completion_stream_generator",
        "    async for res in result_generator:",
        OOM,
    ]
    assert verdict(lines).cls == fl.OOM_RUNTIME


# --------------------------------------------------------------------------------------------
# The cause wins over the death notice, wherever it is printed


@pytest.mark.parametrize(
    "death",
    [
        "CRITICAL 02-14 08:44:33 launcher.py:101] MQLLMEngine is already dead, terminating server process",
        "ERROR 05-05 12:36:59 [serving.py:1173] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
        "encountered an issue. See stack trace (above) for the root cause.",
        "vllm.engine.async_llm_engine.AsyncEngineDeadError: Task finished unexpectedly. This should never "
        "happen! Please open an issue on Github.",
    ],
)
def test_an_oom_printed_after_the_death_in_a_workers_lines_wins(death: str) -> None:
    lines = [
        'INFO:     172.16.18.69:52036 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
        death,
        "(VllmWorkerProcess pid=614) ERROR 02-14 08:44:33 multiproc_worker_utils.py:242] Exception in worker "
        "VllmWorkerProcess while processing method start_worker_execution_loop.",
        "(VllmWorkerProcess pid=614) ERROR 02-14 08:44:33 multiproc_worker_utils.py:242] Traceback (most "
        "recent call last):",
        f"(VllmWorkerProcess pid=614) ERROR 02-14 08:44:33 multiproc_worker_utils.py:242] {OOM}",
    ]
    failure = verdict(lines)
    assert (failure.cls, failure.phase) == (fl.OOM_RUNTIME, fl.PHASE_SERVING)
    assert failure.evidence.startswith("torch.OutOfMemoryError")


def test_the_death_alone_is_engine_dead() -> None:
    line = "CRITICAL 02-14 08:44:33 launcher.py:101] MQLLMEngine is already dead, terminating server process"
    failure = verdict([line])
    assert (failure.cls, failure.phase) == (fl.ENGINE_DEAD, fl.PHASE_SERVING)


def test_an_nccl_error_after_the_death_wins() -> None:
    lines = [
        "ERROR 06-13 07:35:59 [async_llm.py:420] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
        "encountered an issue. See stack trace (above) for the root cause.",
        "(VllmWorker rank=1 pid=291) ERROR 06-13 07:35:59 [multiproc_executor.py:527] RuntimeError: NCCL "
        "error: unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL_ERROR_SYSTEM_ERROR",
    ]
    assert verdict(lines).cls == fl.CUDA_ERROR


# --------------------------------------------------------------------------------------------
# CUDA and NCCL errors in unusual places


@pytest.mark.parametrize(
    ("error", "cls"),
    [
        ("CUDA error: an illegal memory access was encountered", fl.CUDA_ERROR),
        ("CUDA out of memory. Tried to allocate 20.00 MiB.", fl.OOM_RUNTIME),
    ],
)
def test_the_failed_step_warning_carries_its_error(error: str, cls: str) -> None:
    lines = [
        "WARNING 10-12 22:31:22 [model_runner_base.py:143] Failed to pickle inputs of failed execution: "
        + error,
        "WARNING 10-12 22:31:22 [model_runner_base.py:143] CUDA kernel errors might be asynchronously "
        "reported at some other API call, so the stacktrace below might be incorrect.",
    ]
    failure = verdict(lines)
    assert (failure.cls, failure.phase) == (cls, fl.PHASE_SERVING)
    assert failure.evidence.startswith(error.split(".")[0])
    reader = LogReader()  # the full path reads it alike
    for line in lines:
        reader.feed(line)
    assert reader.verdict().cls == cls


@pytest.mark.parametrize(
    "line",
    [
        "(RayWorkerWrapper pid=291, ip=10.0.0.168) ERROR 06-13 07:35:59 [worker_base.py:620] "
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited "
        "or there was a network error, NCCL version 2.21.5 ... NCCL_ERROR_SYSTEM_ERROR",
        "[rank0]:[E ProcessGroupNCCL.cpp:563] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600086 ms",
        "[rank0]:[F ProcessGroupNCCL.cpp:1169] [PG 2 Rank 0] ProcessGroupNCCL's watchdog got stuck for 600 "
        "seconds without making progress in monitoring enqueued collectives.",
        "(RayWorkerVllm pid=5304) [E ProcessGroupNCCL.cpp:916] [Rank 7] NCCL watchdog thread terminated with "
        "exception: CUDA error: unknown error",
        "ERROR 10-30 11:56:48 multiproc_worker_utils.py:120] Worker VllmWorkerProcess pid 198 died, exit "
        "code: -6",
        "/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:92: operator(): block: [0,0,0], thread: [0,0,0] "
        'Assertion `-sizes[i] <= index && index < sizes[i] && "index out of bounds"` failed.',
    ],
)
def test_nccl_failures_and_aborts_are_cuda_errors(line: str) -> None:
    failure = verdict([line])
    assert failure.cls == fl.CUDA_ERROR
    assert not failure.memory


def test_an_nccl_shared_memory_failure_is_not_a_memory_class() -> None:
    line = (
        "(VllmWorkerProcess pid=87) ERROR 07-19 10:59:03 multiproc_worker_utils.py:226] Error while creating "
        "shared memory segment /dev/shm/nccl-bWHyCi (size 9637888), ncclSystemError: System call (e.g. "
        "socket, malloc) or external library call failed or device error."
    )
    assert verdict([line]).cls == fl.CUDA_ERROR


# --------------------------------------------------------------------------------------------
# Host memory


@pytest.mark.parametrize(
    "line",
    [
        "ERROR 03-21 17:27:44 [core.py:340] ray.exceptions.OutOfMemoryError: Task was killed due to the node "
        "running low on memory.",
        "Memory on the node (IP: 10.0.0.2, ID: 708c7b) where the task (actor ID: 0dab4a, name=RayWorkerVllm."
        "__init__, pid=308, memory used=11.15GB) was running was 12.49GB / 13.15GB (0.950003), which exceeds "
        "the memory usage threshold of 0.95. Ray killed this worker (ID: 79a553) because it was the most "
        "recently scheduled task",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
        "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some "
        "potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.",
    ],
)
def test_ray_host_memory_failures_are_host_oom(line: str) -> None:
    assert verdict([line]).cls == fl.HOST_OOM


def test_rays_list_of_possible_causes_loses_to_a_cause_in_the_log() -> None:
    lines = [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
        "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some "
        "potential root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage.",
    ]
    assert verdict(lines).cls == fl.CUDA_ERROR


def test_a_gpu_oom_message_wins_over_rays_possible_causes() -> None:
    lines = [
        OOM,
        "The actor is dead because its worker process has died. (1) The process is killed by SIGKILL by OOM "
        "killer due to high memory usage.",
    ]
    assert verdict(lines).cls == fl.OOM_WEIGHTS


# --------------------------------------------------------------------------------------------
# Every printed figure of the failure


def test_torchs_breakdown_after_its_oom_message() -> None:
    line = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 524.00 MiB. GPU 0 has a total "
        "capacity of 15.77 GiB of which 137.12 MiB is free. Process 6513 has 15.63 GiB memory in use. Of the "
        "allocated memory 13.81 GiB is allocated by PyTorch, with 106.00 MiB allocated in private pools "
        "(e.g., CUDA Graphs), and 121.43 MiB is reserved by PyTorch but unallocated."
    )
    numbers = verdict([line]).numbers
    assert numbers.allocated_by_pytorch_gib == 13.81
    assert numbers.private_pools_mib == 106
    assert numbers.reserved_unallocated_mib == 121.43
    assert numbers.process_in_use_gib == 15.63


def test_rays_node_memory() -> None:
    line = (
        "ERROR 03-21 17:27:44 [core.py:340] Memory on the node (IP: 10.0.0.4, ID: 3486ef) where the task "
        "(actor ID: 46c8d4, name=RayWorkerWrapper.__init__, pid=13378, memory used=3.37GB) was running was "
        "2152.43GB / 2265.25GB (0.950196), which exceeds the memory usage threshold of 0.95. Ray killed this "
        "worker (ID: 5dd7c3) because it was the most recently scheduled task"
    )
    failure = verdict([line])
    assert failure.cls == fl.HOST_OOM
    assert (failure.numbers.host_used_gb, failure.numbers.host_total_gb) == (2152.43, 2265.25)


def test_the_port_holder_vllm_names() -> None:
    lines = [
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 44319): address "
        "already in use",
        "DEBUG 09-04 17:38:34 launcher.py:64] port 44319 is used by process psutil.Process(pid=60914, "
        "name='pt_main_thread', status='sleeping') launched with command:",
    ]
    failure = verdict(lines)
    assert failure.cls == fl.PORT_IN_USE
    assert (failure.numbers.figures.port, failure.numbers.figures.holder_pid) == (44319, 60914)


def test_rays_repeat_count_and_nccls_driver_version() -> None:
    lines = [
        "(RayWorkerWrapper pid=11934) ERROR 08-27 05:12:18 worker_base.py:382] Error executing method "
        "init_device. This might cause deadlock in distributed execution. [repeated 6x across cluster]",
        "node-1:213:213 [1] NCCL INFO cudaDriverVersion 12080",
        "(RayWorkerWrapper pid=11305) ERROR 08-27 05:12:18 worker_base.py:382] RuntimeError: NCCL error: "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    ]
    failure = verdict(lines)
    assert failure.cls == fl.CUDA_ERROR
    assert (failure.numbers.figures.repeated_across_cluster, failure.numbers.figures.cuda_driver_version) == (
        6,
        12080,
    )


def test_a_message_broken_at_each_sentence_keeps_all_its_figures() -> None:
    lines = [
        "torch.OutOfMemoryError: CUDA out of memory.",
        "Tried to allocate 252.00 MiB. GPU 0 has a total capacity of 10.57 GiB of which 163.12 MiB is free.",
        "Process 2073789 has 10.41 GiB memory in use.",
        "Of the allocated memory 9.67 GiB is allocated by PyTorch,",
        "and 26.44 MiB is reserved by PyTorch but unallocated.",
    ]
    numbers = verdict(lines).numbers
    assert (numbers.process_in_use_gib, numbers.reserved_unallocated_mib) == (10.41, 26.44)


def test_the_method_a_worker_names_is_the_step() -> None:
    line = (
        "(VllmWorkerProcess pid=214) ERROR 09-27 05:20:38 multiproc_worker_utils.py:233] Exception in worker "
        "VllmWorkerProcess while processing method determine_num_available_blocks: CUDA out of memory. Tried "
        "to allocate 19.63 GiB."
    )
    assert verdict([line]).cls == fl.OOM_PROFILE


def test_an_oom_creating_the_kv_cache_blocks_of_an_early_release() -> None:
    lines = [
        "INFO 09-12 10:00:00 llm_engine.py:72] Initializing an LLM engine with config: model='/m', "
        "tokenizer='/m', dtype=torch.float16, max_seq_len=4096, tensor_parallel_size=1, seed=0)",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3/site-packages/vllm/worker/worker.py", line 119, in init_cache_engine',
        "    self.cache_engine = CacheEngine(self.cache_config, self.model_config, self.parallel_config)",
        '  File "/usr/lib/python3/site-packages/vllm/worker/cache_engine.py", line 91, in allocate_gpu_cache',
        "    key_blocks = torch.empty(",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.10 GiB (GPU 0; 23.69 GiB total "
        "capacity; 21.78 GiB already allocated; 1.02 GiB free; 21.98 GiB reserved in total by PyTorch)",
    ]
    failure = verdict(lines)
    assert (failure.cls, failure.phase) == (fl.OOM_KV_ALLOC, fl.PHASE_KV_CACHE)
    assert failure.numbers.device_allocated_gib == 21.78


RAY_ACTOR_DEATH = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
    "detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential "
    "root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop "
    "--force is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors."
)


@pytest.mark.parametrize(
    ("before", "cls"),
    [
        ([], fl.HOST_OOM),  # Ray's likeliest cause: its list names the OOM killer first
        (
            ["ray.exceptions.RayActorError: The actor died unexpectedly before finishing this task."],
            fl.HOST_OOM,
        ),
        (["vllm.engine.async_llm_engine.AsyncEngineDeadError: Task finished unexpectedly."], fl.HOST_OOM),
        (["Fatal Python error: Segmentation fault"], fl.CUDA_ERROR),  # a crash the log shows wins
        (["RuntimeError: CUDA error: an illegal memory access was encountered"], fl.CUDA_ERROR),
        ([OOM], fl.OOM_WEIGHTS),
    ],
)
def test_rays_actor_death_with_its_whole_list_of_causes(before: list[str], cls: str) -> None:
    assert verdict([*before, RAY_ACTOR_DEATH]).cls == cls
