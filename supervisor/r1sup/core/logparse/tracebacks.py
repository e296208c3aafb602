"""Traceback tracking: which start-up step a traceback is in, from its frames and source lines.

Pure: frames and source lines in, phases out. vLLM's own function names (``load_model``,
``profile_run``, ``initialize_kv_cache``, ``capture_model``, ``execute_model`` ..., V0 and V1) say the
step; the deepest step named decides a traceback's phase, the weak ones (a warm-up that includes the
capture, a KV set-up that includes the profile) only when nothing else does. A :class:`Traceback` is
the state of one process's open traceback; every phase it notes is also noted in ``seen``, the
phases of all the log's tracebacks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from r1sup.core.failure import (
    PHASE_CUDA_GRAPH,
    PHASE_KV_CACHE,
    PHASE_LOAD_WEIGHTS,
    PHASE_PROFILE,
    PHASE_SERVING,
)

# Traceback frames
FRAME_RE = re.compile(
    # File "path", line 12, in func (the faulthandler's dump has no comma before "in")
    r'\s*File\s+(?:"(?P<file>[^"]*)", line \d+,?'
    # Jupyter: File [path:12](url), in Class.func(...)
    r"|\[?(?P<jfile>[^\],]{0,400}?)(?::\d+)?\]?(?:\([^)]{0,400}\))?,)"
    r" in (?P<func>[\w<>.]+)"
)
# A frame anywhere in a line: behind a launcher's own prefix, several pasted on one line, or pytest's
# and rich's "path.py:12: in func" / "path.py:12 in func"
INLINE_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]{0,400})", line \d+,? in (?P<func>[\w<>.]+)'
    r"|(?P<pfile>[\w./~-]{1,400}\.pyx?):\d+:? in (?P<pfunc>[\w<>.]+)"
)
# A worker method named in the source line of an RPC ("collective_rpc("load_model")")
_RPC_RE = re.compile(r"(?:collective_rpc|_run_workers|execute_method|run_method)\(\s*['\"](?P<method>\w+)")
_CUDA_GRAPH_WEAK = "cuda_graph_weak"  # warm-up that includes the capture (or a sampler warm-up)
_KV_CACHE_WEAK = "kv_cache_weak"  # KV set-up that includes sizing, allocation and warm-up
# The deepest step named in a traceback decides its phase; the weak ones only when nothing else does.
PHASE_RANK = {
    PHASE_CUDA_GRAPH: 8,
    PHASE_PROFILE: 7,
    PHASE_KV_CACHE: 6,
    PHASE_LOAD_WEIGHTS: 5,
    _CUDA_GRAPH_WEAK: 4,
    _KV_CACHE_WEAK: 3,
    PHASE_SERVING: 1,
}
WEAK_PHASE = {_CUDA_GRAPH_WEAK: PHASE_CUDA_GRAPH, _KV_CACHE_WEAK: PHASE_KV_CACHE}
# Step names of vLLM 0.4 to 0.33: V0 worker.py / model_runner.py / cache_engine.py / llm_engine.py,
# V1 gpu_worker.py / gpu_model_runner.py / core.py, model runner V2 (v1/worker/gpu/), and torch's graphs.py.
FRAME_PHASE = {
    # CUDA graph capture (and its memory profiling)
    "capture_model": PHASE_CUDA_GRAPH,
    "_capture_cudagraphs": PHASE_CUDA_GRAPH,
    "_warmup_and_capture": PHASE_CUDA_GRAPH,
    "capture": PHASE_CUDA_GRAPH,
    "capture_graph": PHASE_CUDA_GRAPH,
    "_capture_graph": PHASE_CUDA_GRAPH,
    "graph_capture": PHASE_CUDA_GRAPH,
    "profile_cudagraph_memory": PHASE_CUDA_GRAPH,
    "capture_begin": PHASE_CUDA_GRAPH,  # torch/cuda/graphs.py
    "capture_end": PHASE_CUDA_GRAPH,
    "compile_or_warm_up_model": _CUDA_GRAPH_WEAK,  # V1: warm-up sizes, capture, sampler warm-up
    "_warm_up_model": _CUDA_GRAPH_WEAK,  # V0: the capture after the KV cache
    # profile / dummy runs / sampler warm-up
    "profile_run": PHASE_PROFILE,
    "_dummy_run": PHASE_PROFILE,
    "_dummy_sampler_run": PHASE_PROFILE,
    "_dummy_pooler_run": PHASE_PROFILE,
    "determine_available_memory": PHASE_PROFILE,
    "determine_num_available_blocks": PHASE_PROFILE,
    "profile_num_available_blocks": PHASE_PROFILE,
    "_init_minimal_kv_cache_for_profiling": PHASE_PROFILE,
    "kernel_warmup": PHASE_PROFILE,
    "warmup_kernels": PHASE_PROFILE,
    # KV cache sizing and allocation
    "initialize_kv_cache": PHASE_KV_CACHE,
    "_allocate_kv_cache": PHASE_KV_CACHE,
    "allocate_kv_cache": PHASE_KV_CACHE,
    "_allocate_kv_cache_tensors": PHASE_KV_CACHE,
    "_reshape_kv_cache_tensors": PHASE_KV_CACHE,
    "initialize_kv_cache_tensors": PHASE_KV_CACHE,
    "init_kv_cache": PHASE_KV_CACHE,
    "_init_cache_engine": PHASE_KV_CACHE,
    "raise_if_cache_size_invalid": PHASE_KV_CACHE,
    "allocate_gpu_cache": PHASE_KV_CACHE,  # vLLM 0.1-0.2 cache_engine.py
    "init_cache_engine": PHASE_KV_CACHE,  # vLLM 0.1-0.2 worker.py
    "_init_cache": _KV_CACHE_WEAK,  # vLLM 0.1-0.2 llm_engine.py: profile, then the cache engines
    "initialize_cache": _KV_CACHE_WEAK,  # V0 worker: allocation, then the warm-up and capture
    "initialize_from_config": _KV_CACHE_WEAK,
    "_initialize_kv_caches": _KV_CACHE_WEAK,  # both engines: profile, size, allocate
    # weights
    "load_model": PHASE_LOAD_WEIGHTS,
    "get_model": PHASE_LOAD_WEIGHTS,
    "load_weights": PHASE_LOAD_WEIGHTS,
    "process_weights_after_loading": PHASE_LOAD_WEIGHTS,
    "initialize_model": PHASE_LOAD_WEIGHTS,
    "_initialize_model": PHASE_LOAD_WEIGHTS,
    "download_model": PHASE_LOAD_WEIGHTS,
    # serving
    "execute_model": PHASE_SERVING,
    "execute_model_async": PHASE_SERVING,
    "execute_model_with_error_logging": PHASE_SERVING,
    "step_with_batch_queue": PHASE_SERVING,
    "run_busy_loop": PHASE_SERVING,
    "_process_engine_step": PHASE_SERVING,
    "engine_step": PHASE_SERVING,
    "step_async": PHASE_SERVING,
    "run_engine_loop": PHASE_SERVING,
    "output_handler": PHASE_SERVING,
    "_run_workers_async": PHASE_SERVING,
    "_log_task_completion": PHASE_SERVING,
    "start_worker_execution_loop": PHASE_SERVING,  # V0: a worker's loop of the driver's model steps
    "_run_engine": PHASE_SERVING,  # the offline LLM's loop over its requests (LLM.generate, LLM.chat ...)
}
REQUEST_FRAMES = frozenset(
    {
        "create_chat_completion",
        "create_completion",
        "create_embedding",
        "create_responses",
        "create_pooling",
        "create_score",
        "_preprocess_chat",
        "_preprocess_completion",
        "_tokenize_prompt_input_async",
        "_tokenize_prompt_inputs_async",
        "_validate_input",
        "_normalize_prompt_text_to_input",
        "render_chat_request",
        "render_completion_request",
    }
)
_CALL_RE = re.compile(r"(?P<call>\w+)\(")
HINT_RE = re.compile(
    r"logits|[Ss]ampler|sample\(|dummy|\bforward\b|compute_logits|model_executable|hidden_states"
)

# Ray/v0 workers name the method that failed: "Error executing method determine_num_available_blocks",
# "Exception in worker VllmWorkerProcess while processing method load_model".
_METHOD_RE = re.compile(r"(?:Error executing|while processing) method '?(?P<method>\w+)")


def method_phase(text: str) -> str | None:
    """The phase of the worker method an "Error executing method X" line names (None: no step)."""
    m = _METHOD_RE.search(text)
    return FRAME_PHASE.get(m.group("method")) if m is not None else None


def best_key(phases: Mapping[str, int]) -> str | None:
    """The highest-ranked phase key (weak keys included)."""
    if not phases:
        return None
    return max(phases.items(), key=lambda kv: kv[1])[0]


def best_phase(phases: Mapping[str, int]) -> str | None:
    """The phase of the highest-ranked key (a weak key stands for its phase)."""
    key = best_key(phases)
    return None if key is None else WEAK_PHASE.get(key, key)


def phase_rank(key: str | None) -> int:
    return 0 if key is None else PHASE_RANK[key]


@dataclass
class Traceback:
    """One process's traceback while it is read (from its header, or its first frame when the header
    was cut off, to its exception line)."""

    start_line: int
    phases: dict[str, int] = field(default_factory=dict)  # phase -> rank, from frames
    hint: bool = False  # the model was running a forward pass (sampler, logits, dummy run)
    request: bool = False  # a per-request handler (the server survives these)
    last_frame: str = ""
    process: str | None = None
    pid: int | None = None

    def note(self, phase: str, seen: dict[str, int]) -> None:
        """The traceback is in ``phase`` (a key of ``PHASE_RANK``)."""
        rank = PHASE_RANK[phase]
        self.phases[phase] = rank
        seen[phase] = rank

    def frame(self, func: str, file: str, text: str, seen: dict[str, int]) -> None:
        """A frame line (``text``) of function ``func`` in ``file``."""
        self.last_frame = text[:300]
        name = func.rsplit(".", 1)[-1]
        phase = FRAME_PHASE.get(name)
        if phase is None:
            if "CacheEngine" in func or (name == "__init__" and file.endswith("cache_engine.py")):
                phase = PHASE_KV_CACHE  # v0 allocates the KV cache in CacheEngine's constructor
            elif file.endswith("cuda/graphs.py"):
                phase = PHASE_CUDA_GRAPH  # torch.cuda.graph: only a capture goes through it
            elif "/serving_" in file and "entrypoints" in file:
                phase = PHASE_SERVING  # the OpenAI server's request handlers (serving_chat.py ...)
        if phase is not None:
            self.note(phase, seen)
        if name in REQUEST_FRAMES:
            self.request = True
            self.phases.setdefault(PHASE_SERVING, PHASE_RANK[PHASE_SERVING])
        if not self.hint and HINT_RE.search(text) is not None:
            self.hint = True

    def source_line(self, text: str, seen: dict[str, int]) -> None:
        """A source line under a frame: the call it makes tells the phase when the next frame is cut."""
        if not self.hint and HINT_RE.search(text) is not None:
            self.hint = True
        if "(" not in text:
            return
        names = [m.group("call") for m in _CALL_RE.finditer(text)]
        if "rpc" in text or "_run_workers" in text or "execute_method" in text or "run_method" in text:
            names += [m.group("method") for m in _RPC_RE.finditer(text)]  # the worker method an RPC runs
        if "cuda.graph(" in text:
            names.append("capture")  # "with torch.cuda.graph(...)": a capture
        for name in names:
            phase = FRAME_PHASE.get(name)
            if phase is not None:
                self.note(phase, seen)
