"""Message texts as vLLM 0.32 and torch print them (read from vllm/v1/worker/*.py, v1/core/kv_cache_utils.py,
config/*.py and torch's CUDACachingAllocator). Pure string building; the numbers come from :mod:`memory`.
"""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20

DOCS_CONSERVING = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"
PYDANTIC_DOCS = "https://errors.pydantic.dev/2.12/v/"


def format_gib(n: int | float) -> str:
    """vllm.utils.mem_utils.format_gib: ``round(bytes / GiB, 2)`` printed by str()."""
    return f"{round(n / GIB, 2)}"


def format_size(n: int) -> str:
    """torch's format_size (c10/cuda/CUDACachingAllocator.cpp): fixed two decimals, binary units."""
    n = max(0, int(n))
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


def torch_oom(
    *,
    tried: int,
    device: int,
    total: int,
    free: int,
    others: int,
    other_pid: int,
    in_use: int,
    allocated: int,
    private_pools: int,
    reserved_unallocated: int,
) -> str:
    """The message of torch.OutOfMemoryError (torch 2.4 and newer), without the exception name."""
    procs = f"Process {other_pid} has {format_size(others)} memory in use. " if others > 0 else ""
    return (
        f"CUDA out of memory. Tried to allocate {format_size(tried)}. GPU {device} has a total capacity of "
        f"{format_size(total)} of which {format_size(free)} is free. {procs}Including non-PyTorch memory, "
        f"this process has {format_size(in_use)} memory in use. Of the allocated memory "
        f"{format_size(allocated)} is allocated by PyTorch, with {format_size(private_pools)} allocated in "
        f"private pools (e.g., CUDA Graphs), and {format_size(reserved_unallocated)} is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        "Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-"
        "with-pytorch-cuda-alloc-conf)"
    )


CUDA_ERROR_TRAILER = (
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
)


def free_memory_below_util(device: str, free: int, total: int, util: float, requested: int) -> str:
    return (
        f"Free memory on device {device} ({format_gib(free)}/{format_gib(total)} GiB) on startup is less "
        f"than desired GPU memory utilization ({util}, {format_gib(requested)} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def load_failed_hint() -> str:
    return (
        "Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory "
        "for weights, increasing --tensor-parallel-size, or using --quantization. See "
        f"{DOCS_CONSERVING} for more tips."
    )


def sampler_oom(num_reqs: int) -> str:
    return (
        f"CUDA out of memory occurred when warming up sampler with {num_reqs} dummy requests. Please try "
        "lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine."
    )


def no_kv_memory() -> str:
    return (
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
        "the engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). "
        f"See {DOCS_CONSERVING} for more details."
    )


def kv_insufficient(max_model_len: int, needed: int, available: int, estimate: int) -> str:
    estimated = (
        f"Based on the available memory, the estimated maximum model length is {estimate}. "
        if estimate > 0
        else ""
    )
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({format_gib(available)} GiB). {estimated}Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        f"See {DOCS_CONSERVING} for more details."
    )


def auto_fit_impossible() -> str:
    return (
        "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. "
        "Try increasing `gpu_memory_utilization`."
    )


def auto_fit_reduced(original: int, new: int, available: int) -> str:
    return (
        f"Auto-fit max_model_len: reduced from {original} to {new} to fit in available KV cache memory "
        f"({format_gib(available)} GiB GPU)"
    )


def auto_fit_full(original: int, available: int) -> str:
    return (
        f"Auto-fit max_model_len: full model context length {original} fits in available KV cache memory "
        f"({format_gib(available)} GiB GPU)"
    )


def kv_cache_size(tokens: int, max_model_len: int, concurrency: float) -> str:
    return (
        f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
        "request: "
        f"{concurrency:.2f}x"
    )


def memory_breakdown(
    *,
    free: int,
    total: int,
    util: float,
    requested: int,
    consumed: int,
    peak: int,
    cudagraph: int,
    kv_in_use: int,
) -> str:
    """gpu_worker.compile_or_warm_up_model's summary (with its 150 MiB redundancy buffer)."""
    buffer = 150 * MIB
    non_kv = consumed + peak + cudagraph
    to_gpu = free - non_kv - buffer
    to_requested = requested - non_kv - buffer
    return (
        f"Free memory on device ({format_gib(free)}/{format_gib(total)} GiB) on startup. Desired GPU memory "
        f"utilization is ({util}, {format_gib(requested)} GiB). Actual usage is {format_gib(consumed)} GiB "
        "for "
        f"consumed memory (weights + non-torch), {format_gib(peak)} GiB for peak activation, and "
        f"{format_gib(cudagraph)} GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
        f"`--kv-cache-memory={to_requested}` ({format_gib(to_requested)} GiB) to fit into requested memory, "
        "or "
        f"`--kv-cache-memory={to_gpu}` ({format_gib(to_gpu)} GiB) to fully utilize gpu memory. Current kv "
        "cache "
        f"memory in use is {format_gib(kv_in_use)} GiB."
    )


def cudagraph_profiling_enabled(util: float, equivalent: float, suggested: float) -> str:
    return (
        f"CUDA graph memory profiling is enabled (default since v0.21.0). The current "
        f"--gpu-memory-utilization={util:.4f} is equivalent to --gpu-memory-utilization={equivalent:.4f} "
        "without CUDA graph memory profiling. To maintain the same effective KV cache size as before, "
        "increase "
        f"--gpu-memory-utilization to {suggested:.4f}. To disable, set "
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0."
    )


def cudagraph_profiling_disabled(util: float, suggested: float) -> str:
    return (
        "CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, "
        "CUDA graph memory is not accounted for during KV cache allocation, which may require lowering "
        "--gpu-memory-utilization to avoid OOM. Consider re-enabling it (the default as of v0.21.0) and "
        f"increasing --gpu-memory-utilization from {util:.4f} to {suggested:.4f}."
    )


def kv_cache_memory_pinned(free: int, pinned: int) -> str:
    return (
        f"Initial free memory {format_gib(free)} GiB, reserved {format_gib(pinned)} GiB memory for KV Cache "
        "as "
        "specified by kv_cache_memory_bytes config and skipped memory profiling. This does not respect the "
        "gpu_memory_utilization config. Only use kv_cache_memory_bytes config when you want manual control "
        "of "
        "KV cache memory size. If OOM'ed, check the difference of initial free memory between the current "
        "run "
        "and the previous run where kv_cache_memory_bytes is suggested and update it correspondingly."
    )


def world_size_too_large(world: int, count: int) -> str:
    return (
        f"World size ({world}) is larger than the number of available GPUs ({count}) in this node. If this "
        "is "
        "intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n- "
        "multiprocessing, "
        "set '--nnodes' appropriately."
    )


def heads_not_divisible(heads: int, tp: int) -> str:
    return f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp})."


def max_model_len_too_long(user: int, derived: int) -> str:
    return (
        f"User-specified max_model_len ({user}) is greater than the derived max_model_len "
        f"(max_position_embeddings={derived} or model_max_length=None in model's config.json). To allow "
        "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN "
        "must be used with extreme caution. If the model uses relative position encoding (RoPE), positions "
        "exceeding derived_max_model_len lead to nan. If the model uses absolute position encoding, "
        "positions "
        "exceeding derived_max_model_len will cause a CUDA array out-of-bounds error."
    )


def quantization_capability(method: str, minimum: int, current: int) -> str:
    return (
        f"The quantization method {method} is not supported for the current GPU. Minimum capability: "
        f"{minimum}. "
        f"Current capability: {current}."
    )


def quantization_mismatch(checkpoint: str, flag: str) -> str:
    return (
        f"Quantization method specified in the model config ({checkpoint}) does not match the quantization "
        f"method specified in the `quantization` argument ({flag})."
    )


def quantization_config_missing(method: str) -> str:
    return f"Cannot find the config file for {method}"


def batched_below_seqs(batched: int, seqs: int) -> str:
    return f"max_num_batched_tokens ({batched}) must be greater than or equal to max_num_seqs ({seqs})."


def batched_below_len(batched: int, max_model_len: int) -> str:
    return (
        f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_model_len}). This "
        "effectively "
        "limits the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer "
        "sequences. "
        "Please increase max_num_batched_tokens or decrease max_model_len."
    )


def fp8_triton_arch(dtype: str = "fp8e4nv") -> str:
    supported = "('fp8e4b15', 'fp8e5')" if dtype == "fp8e4nv" else "('fp8e4b15',)"
    return f"type {dtype} not supported in this architecture. The supported fp8 dtypes are {supported}"


FP8_ASSERT = "fp8e4nv data type is not supported on CUDA arch < 89"
ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def pydantic_value_error(model: str, message: str, input_repr: str = "ArgsKwargs((), {...})") -> list[str]:
    """The lines of a pydantic ValidationError wrapping a ValueError raised in a config's validator."""
    first, *rest = message.split("\n")
    body = [f"  Value error, {first}"] + rest
    body[-1] += f" [type=value_error, input_value={input_repr}, input_type=ArgsKwargs]"
    return [
        f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {model}",
        *body,
        f"    For further information visit {PYDANTIC_DOCS}value_error",
    ]


def pydantic_bound_error(model: str, field_name: str, value: object, bound: str, limit: float) -> list[str]:
    """A pydantic field constraint error, e.g. ``less_than_equal`` for gpu_memory_utilization > 1."""
    words = {
        "less_than_equal": f"Input should be less than or equal to {limit}",
        "greater_than": f"Input should be greater than {limit}",
        "greater_than_equal": f"Input should be greater than or equal to {limit}",
    }[bound]
    return [
        f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {model}",
        field_name,
        f"  {words} [type={bound}, input_value={value!r}, input_type={type(value).__name__}]",
        f"    For further information visit {PYDANTIC_DOCS}{bound}",
    ]
