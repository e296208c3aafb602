"""Progress and figures: what vLLM's success-path lines say (numbers, milestones, the engine's identity).

Pure: the message of a line that starts with a progress keyword in, :class:`Progress` values and the
figures gathered so far out. :class:`FigureCollector` keeps the numbers of one launch (weights, KV
cache, the memory breakdown ...; handed out as the frozen :class:`r1sup.core.figures.Figures`), the start-up
milestone reached (``r1sup.core.failure.STARTUP_MILESTONES``), where
the server became ready or began to shut down, and the engine's version, arguments and device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from r1sup.core.failure import milestone
from r1sup.core.logparse.heads import EVIDENCE_CHARS, LogLine
from r1sup.core.logparse.phase import TRAFFIC_TAILS, traffic
from r1sup.core.memmodel import CUDA_BLOCK_SIZE


@dataclass(frozen=True)
class Progress:
    """A success-path milestone with its numbers (canonical keys)."""

    kind: str
    numbers: Mapping[str, float]
    text: str


_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_GAP = r".{0,300}?"  # a bounded gap inside one message (no unbounded .* on long lines)


def number(s: str) -> float:
    """A number as vLLM printed it: an int when it has no decimals (token and block counts, lengths)."""
    s = s.replace(",", "")
    return float(s) if "." in s else int(s)


def unit_gib(value: float, unit: str) -> float:
    unit = unit.upper().replace("I", "")
    scale = {"B": 1 / 2**30, "BYTES": 1 / 2**30, "KB": 1 / 2**20, "MB": 1 / 2**10, "GB": 1.0, "TB": 1024.0}
    return value * scale.get(unit, 1.0)


# (kind, a literal every match contains, pattern): the pattern's named groups are the numbers
# gpu_worker.py compile_or_warm_up_model's memory breakdown (0.20 on), up to the figures that changed
_BREAKDOWN_HEAD = (
    rf"Free memory on device \((?P<free_gib>{_NUM})/(?P<total_gib>{_NUM}) GiB\) on startup\. "
    rf"Desired GPU memory utilization is \((?P<gpu_memory_utilization>{_NUM}), "
    rf"(?P<requested_gib>{_NUM}) GiB\)\. "
)
PROGRESS_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    (
        "weights_loaded",
        "took",
        re.compile(
            rf"(?:Model loading|Loading model weights) took (?P<weights_gib>{_NUM}) ?(?:GiB|GB)"
            rf"(?: memory)?(?: and (?P<weights_load_s>{_NUM}) ?s)?"
        ),
    ),
    (
        "weights_loaded",
        "Loading weights took",
        re.compile(rf"Loading weights took (?P<weights_load_s>{_NUM}) ?s"),
    ),
    (
        "kv_cache_available",
        "Available KV cache memory",
        re.compile(rf"Available KV cache memory: (?P<kv_cache_gib>{_NUM}) ?GiB"),
    ),
    (
        # vLLM >= 0.18 (GPUModelRunner.profile_cudagraph_memory), printed before the KV cache is sized
        "cudagraph_estimate",
        "Estimated CUDA graph memory",
        re.compile(rf"Estimated CUDA graph memory: (?P<cudagraph_estimated_gib>{_NUM}) ?GiB total"),
    ),
    (
        # MemoryProfilingResult at DEBUG: 0.19-0.26 print the non-torch increase, 0.27 on the free-memory drop
        "memory_profile",
        "Memory profiling takes",
        re.compile(
            rf"Memory profiling takes {_NUM} seconds\. "
            rf"Total non KV cache memory: (?P<non_kv_total_gib>{_NUM}) ?GiB; "
            rf"torch peak memory increase: (?P<peak_activation_gib>{_NUM}) ?GiB; "
            rf"(?:non-torch forward increase memory: (?P<non_torch_gib>{_NUM}) ?GiB|"
            rf"total consumed \(from mem_get_info\): (?P<consumed_gib>{_NUM}) ?GiB); "
            rf"weights memory: (?P<weights_gib>{_NUM}) ?GiB"
        ),
    ),
    (
        # Worker.init_device at DEBUG: memory taken before vLLM's snapshot (CUDA context, NCCL) is cuda_memory
        "memory_snapshot",
        "worker init memory snapshot",
        re.compile(
            rf"worker init memory snapshot: .{{0,200}}?free_memory=(?P<init_free_gib>{_NUM}) ?GiB, "
            rf"total_memory=(?P<total_gib>{_NUM}) ?GiB, cuda_memory=(?P<init_cuda_gib>{_NUM}) ?GiB"
        ),
    ),
    (
        "engine_config",
        "Chunked prefill is enabled",
        re.compile(
            rf"Chunked prefill is enabled with max_num_batched_tokens=(?P<max_num_batched_tokens>{_NUM})"
        ),
    ),
    (
        "kv_cache_size",
        "KV cache size: ",
        re.compile(
            rf"KV cache size: (?P<kv_cache_tokens>{_NUM}) tokens"
            rf"(?:, Maximum concurrency for (?P<max_model_len>{_NUM}) tokens per request: "
            rf"(?P<max_concurrency>{_NUM})x)?"
        ),
    ),
    (
        "kv_cache_size",
        "Maximum concurrency for ",
        re.compile(
            rf"^Maximum concurrency for (?P<max_model_len>{_NUM}) tokens per request: "
            rf"(?P<max_concurrency>{_NUM})x"
        ),
    ),
    (
        "kv_blocks",
        " blocks: ",
        re.compile(
            rf"# (?:GPU|gpu|cuda|CUDA|\w+) blocks: (?P<gpu_blocks>{_NUM})(?:, # CPU blocks: "
            rf"(?P<cpu_blocks>{_NUM}))?"
        ),
    ),
    (
        "kv_cache_available",
        "Explicitly set (",
        re.compile(
            rf"Explicitly set \((?P<kv_cache_gib>{_NUM})/(?P<node_total_gib>{_NUM})\) GiB for KV cache"
        ),
    ),
    (
        "cudagraph_memory",
        "Graph capturing finished",
        re.compile(
            rf"Graph capturing finished in (?P<cudagraph_capture_s>{_NUM}) secs?(?:, took "
            rf"(?P<cudagraph_gib>{_NUM}) ?GiB)?"
        ),
    ),
    (
        "cudagraph_memory",
        "CUDA graph pool memory: ",
        re.compile(
            rf"CUDA graph pool memory: (?P<cudagraph_gib>{_NUM}) ?GiB \(actual\), "
            rf"(?P<cudagraph_estimated_gib>{_NUM}) ?GiB \(estimated\)"
        ),
    ),
    (
        # vLLM >= 0.21 (gpu_worker.py determine_available_memory): the utilization that would give the same
        # KV cache without the CUDA-graph estimate; (U - E) x total is that estimate (see _derive)
        "cudagraph_estimate",
        "is equivalent to --gpu-memory-utilization",
        re.compile(
            rf"The current --gpu-memory-utilization=(?P<profiled_gpu_memory_utilization>{_NUM}) is "
            rf"equivalent to --gpu-memory-utilization=(?P<equivalent_gpu_memory_utilization>{_NUM}) "
            r"without CUDA graph memory profiling"
        ),
    ),
    (
        # 0.20-0.26 (gpu_worker.py compile_or_warm_up_model): weights, activation and non-torch apart
        "memory_breakdown",
        "Free memory on device (",
        re.compile(
            _BREAKDOWN_HEAD
            + rf"Actual usage is (?P<weights_gib>{_NUM}) GiB for weight, (?P<peak_activation_gib>{_NUM}) GiB "
            rf"for peak activation, (?P<non_torch_gib>{_NUM}) GiB for non-torch memory, and "
            rf"(?P<cudagraph_gib>{_NUM}) GiB for CUDAGraph memory\."
        ),
    ),
    (
        # 0.27 on: the "peak activation" figure includes the CUDA-graph estimate charged to the budget
        "memory_breakdown",
        "Free memory on device (",
        re.compile(
            _BREAKDOWN_HEAD
            + rf"Actual usage is (?P<consumed_gib>{_NUM}) GiB for consumed memory \(weights \+ non-torch\), "
            rf"(?P<breakdown_activation_gib>{_NUM}) GiB for peak activation, and "
            rf"(?P<cudagraph_gib>{_NUM}) GiB for CUDAGraph memory\."
            rf"(?: Replace gpu_memory_utilization config with `?--kv-cache-memory="
            rf"(?P<suggested_kv_cache_memory_bytes>{_NUM})`?{_GAP}`?--kv-cache-memory="
            rf"(?P<suggested_kv_cache_memory_bytes_full>{_NUM}))?"
            rf"(?:{_GAP}Current kv cache memory in use is (?P<kv_cache_gib>{_NUM}) GiB)?"
        ),
    ),
    (
        "memory_profile",
        "total_gpu_memory (",
        re.compile(
            rf"total_gpu_memory \((?P<total_gib>{_NUM}) ?GiB\) x gpu_memory_utilization "
            rf"\((?P<gpu_memory_utilization>{_NUM})\) = (?P<requested_gib>{_NUM}) ?GiB"
        ),
    ),
    (
        "memory_profile",
        "model weights take",
        re.compile(
            rf"model weights take (?P<weights_gib>{_NUM}) ?GiB; non_torch_memory takes "
            rf"(?P<non_torch_gib>{_NUM}) ?GiB; "
            rf"PyTorch activation peak memory takes (?P<peak_activation_gib>{_NUM}) ?GiB; "
            rf"the rest of the memory reserved for KV Cache is (?P<kv_cache_gib>{_NUM}) ?GiB"
        ),
    ),
    (
        "memory_profile",
        "Memory profiling results:",
        re.compile(
            rf"Memory profiling results:{_GAP}total_gpu_memory=(?P<total_gib>{_NUM}) ?GiB{_GAP}"
            rf"peak_torch_memory=(?P<peak_activation_gib>{_NUM}) ?GiB{_GAP}"
            rf"non_torch_memory=(?P<non_torch_gib>{_NUM}) ?GiB{_GAP}"
            rf"kv_cache_size=(?P<kv_cache_gib>{_NUM}) ?GiB{_GAP}"
            rf"gpu_memory_utilization=(?P<gpu_memory_utilization>{_NUM})"
        ),
    ),
    (
        "engine_init",
        "init engine (profile",
        re.compile(
            rf"init engine \(profile, create kv cache, warmup model\) took (?P<engine_init_s>{_NUM}) ?s"
        ),
    ),
    (
        "auto_fit",
        "Auto-fit max_model_len",
        re.compile(
            rf"Auto-fit max_model_len: reduced from (?P<original_max_model_len>{_NUM}) to "
            rf"(?P<max_model_len>{_NUM})"
        ),
    ),
    (
        "engine_config",
        "max_seq_len=",
        re.compile(r"max_seq_len=(?P<max_model_len>\d+)"),  # in "Initializing a[n] [V1 ]LLM engine ..."
    ),
    (
        "engine_config",
        "Using max model len ",
        re.compile(rf"Using max model len (?P<max_model_len>{_NUM})"),
    ),
    # Loading progress (phases and vLLM's own percent; read by r1sup.core.progress). The shard bar is
    # weight_utils.py's tqdm ("{desc}: {percentage:3.0f}% Completed | {n}/{total} [...]"), the graph bar
    # gpu_model_runner.py's ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|...| 34/67").
    ("weights_start", "Starting to load model", re.compile(r"^Starting to load model")),
    (
        "weights_progress",
        "% Completed | ",
        re.compile(
            r"^(?:Multi-thread )?[Ll]oading [\w ]{1,40}?(?:checkpoint shards|using [\w ]{1,40})"
            r"(?: \(\w+\))?: *(?P<weights_percent>\d{1,3})% Completed \| "
            r"(?P<shards_done>\d+)/(?P<shards_total>\d+)"
        ),
    ),
    ("profiling_start", "Warming up model", re.compile(r"^Warming up model")),
    (
        "graph_capture",
        "Capturing CUDA graphs",
        re.compile(
            r"^Capturing CUDA graphs[^:]{0,120}: *(?P<graphs_percent>\d{1,3})%\|[^|]{0,200}\| *"
            r"(?P<graphs_done>\d+)/(?P<graphs_total>\d+)"
        ),
    ),
    ("api_start", "Starting vLLM ", re.compile(r"^Starting vLLM (?:API )?server")),
    (
        # the API server names who holds its port (launcher.py, at DEBUG) after uvicorn failed to bind
        "port_holder",
        "is used by process",
        re.compile(r"^port (?P<port>\d+) is used by process psutil\.Process\(pid=(?P<holder_pid>\d+)"),
    ),
)
# progress kinds whose numbers describe the loading itself, not the engine (kept out of observations)
_LOADING_KINDS = frozenset({"weights_progress", "graph_capture"})
# The rules a keyword's line can match, by the keyword's last four characters (the keywords that vary,
# "GPU KV cache size", "# CUDA blocks", end alike), their order kept so that the first that matches is
# the one trying them all would find; a keyword not here tries every rule.
RULES_BY_KEYWORD = {
    tail: tuple(rule for rule in PROGRESS_RULES if rule[0] in kinds)
    for tail, kinds in {
        "took": ("weights_loaded",),  # Model loading took, Loading [model ]weights took
        "odel": ("weights_start", "profiling_start"),  # Starting to load model, Warming up model
        "ards": ("weights_progress",),  # Loading safetensors checkpoint shards
        "ing ": ("weights_progress",),  # Loading weights using ...
        "rver": ("api_start",),  # Starting vLLM API server
        # Available KV cache memory, CUDA graph pool memory, Estimated CUDA graph memory
        "mory": ("kv_cache_available", "cudagraph_estimate", "cudagraph_memory"),
        "size": ("kv_cache_size",),
        "ency": ("kv_cache_size",),  # Maximum concurrency
        "ocks": ("kv_blocks",),
        "shed": ("cudagraph_memory",),  # Graph capturing finished
        "bled": ("cudagraph_estimate", "engine_config"),  # ... profiling is enabled, Chunked prefill ...
        "shot": ("memory_snapshot",),  # worker init memory snapshot
        "args": (),  # non-default args (read by _progress itself)
        "ce (": ("memory_breakdown",),  # Free memory on device (
        "file": ("engine_init",),  # init engine (profile
        "gine": ("engine_config",),  # Initializing a[n] [V1 ]LLM engine
        " len": ("engine_config",),  # Using max model len
        "_len": ("auto_fit",),  # Auto-fit max_model_len
        "ling": ("memory_profile",),  # Memory profiling
        "ance": ("memory_profile",),  # the current vLLM instance
        "take": ("memory_profile",),  # model weights take
        "et (": ("kv_cache_available",),  # Explicitly set (
        "lete": (),  # Application startup complete
        "g on": (),  # Uvicorn running on
        "down": (),  # Shutting down
        "own]": (),  # [shutdown]
        "ring": ("graph_capture",),  # Capturing
        "gnal": (),  # Received signal
        "cess": ("port_holder",),  # port N is used by process
        # request traffic (read by FigureCollector.read itself, phase.TRAFFIC_TAILS): Added/Received/
        # Aborted/Finished request, Avg prompt throughput, Writing input of failed execution
        "uest": (),
        "hput": (),
        "tion": (),
    }.items()
}


# The start-up milestone each kind of progress line marks (the phase after each: r1sup.core.failure)
KIND_MILESTONE = {
    "weights_start": milestone("weights_started"),
    "weights_progress": milestone("weights_started"),
    "weights_loaded": milestone("weights_loaded"),
    "profiling_start": milestone("weights_loaded"),
    "kv_cache_available": milestone("kv_sized"),
    "kv_cache_size": milestone("kv_sized"),
    "kv_blocks": milestone("kv_sized"),
    "memory_profile": milestone("kv_sized"),
    "auto_fit": milestone("kv_sized"),
    "graph_capture": milestone("capture_started"),
    "cudagraph_memory": milestone("captured"),
}
_CAPTURE_STARTED = milestone("capture_started")

# The numbers FigureCollector._derive reads, and the kinds of progress line that carry them
_DERIVE_INPUTS = frozenset(
    {"profiled_gpu_memory_utilization", "equivalent_gpu_memory_utilization", "total_gib"}
)
_DERIVING_KINDS = frozenset(kind for kind, _, rx in PROGRESS_RULES if _DERIVE_INPUTS & rx.groupindex.keys())
# The keyword tails of the lines that may start the capture, the serving or the shutdown
_MILESTONE_TAILS = frozenset({"ring", "lete", "g on", "down", "own]", "gnal"})
# The engine's identity: its version ("Initializing a V1 LLM engine (v0.19.0)"), the arguments it was
# given ("non-default args: {...}") and its device ("device_config=cuda")
_IDENTITY_TAILS = frozenset({"gine", "args"})
_ENGINE_VERSION_RE = re.compile(r"LLM engine \(v(?P<version>\d+\.\d+\.\d+[\w.+]*)")
_ARGS_RE = re.compile(r"non-default args: (?P<args>\{.{0,4000}\})")
# The engine's config line ("Initializing an LLM engine (v0.6.3) with config: model=..., kv_cache_dtype=fp8,
# ...") names the memory flags too: read where no "non-default args" line does (older releases print none)
_CONFIG_ARG_RE = re.compile(
    r"(?<![\w.])(?P<key>kv_cache_dtype|quantization|tensor_parallel_size|enforce_eager|max_seq_len)="
    r"(?P<value>[\w.+-]{1,40})"
)
_CONFIG_ARG_NAMES = {"max_seq_len": "max_model_len"}
_DEVICE_RE = re.compile(r"\bdevice_config=(?P<device>\w+)")
_ARGS_CHARS = 4000


def _literal_args(text: str) -> dict[str, object] | None:
    """The dict vLLM printed with "non-default args:", read as literals (never evaluated as code)."""
    import ast

    m = _ARGS_RE.search(text[: _ARGS_CHARS + 200])
    if m is None:
        return None
    try:
        value = ast.literal_eval(m.group("args"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _config_args(text: str) -> dict[str, object]:
    """The memory flags of the engine's config line, as vLLM's argument names (plain values only)."""
    out: dict[str, object] = {}
    for m in _CONFIG_ARG_RE.finditer(text[:_ARGS_CHARS]):
        key, value = m.group("key"), m.group("value")
        if value == "None" or key in out:
            continue
        name = _CONFIG_ARG_NAMES.get(key, key)
        if value in ("True", "False"):
            out[name] = value == "True"
        elif value.isdigit():
            out[name] = int(value)
        else:
            out[name] = value
    return out


_READY_RE = re.compile(r"Application startup complete|Uvicorn running on")
_SHUTDOWN_RE = re.compile(r"\[shutdown\]|Shutting down|Received signal|received signal")
_CAPTURE_START_RE = re.compile(r"Capturing (?:CUDA|cuda|the model for CUDA)")
_BLOCK_SIZE_RE = re.compile(
    r"block_size=(?P<block_size>\d+)"
)  # a literal first: searched fast (word start checked)


class FigureCollector:
    """The success path of one launch as its log shows it: numbers, milestones, identity.

    Fed the messages that start with a progress keyword (:meth:`read`); bounded: one value per
    number, the first readiness and shutdown lines, the first identity seen.
    """

    def __init__(self) -> None:
        self.obs: dict[str, float] = {}  # success-path numbers (canonical keys)
        self.reached = milestone("launched")  # the last start-up milestone passed (its position)
        self.matched = False  # a progress rule matched a line: the input is vLLM's output
        self.ready_line: int | None = None  # "Application startup complete" (or uvicorn's running line)
        self.ready_text: str | None = None
        self.shutdown_line: int | None = None
        self.blocks_line: int | None = None  # where v0 printed "# GPU blocks"
        self.block_size = CUDA_BLOCK_SIZE  # vLLM's default, until the log prints its own
        self.engine_version: str | None = None  # "Initializing a V1 LLM engine (v0.19.0)"
        self.engine_args: dict[str, object] | None = None  # "non-default args: {...}"
        self.config_args: dict[str, object] = {}  # the memory flags of the engine's config line
        self._config_read = False
        self.engine_device: str | None = None  # "device_config=cpu" of the engine's config line
        # the first line showing request traffic since the last start-up began (r1sup.core.logparse.phase)
        self.traffic_line: int | None = None
        self._estimate_logged = False  # vLLM printed its CUDA-graph estimate itself (CUDA graph pool memory)

    def read(self, text: str, events: list[LogLine | Progress] | None, kw: str, line_no: int) -> bool:
        """A message starting with the progress keyword ``kw`` (on input line ``line_no``): its numbers
        and milestones, appended to ``events`` as :class:`Progress` when given. True when this line
        says the server became ready (the first time)."""
        tail = kw[-4:]
        if tail in TRAFFIC_TAILS:
            self.saw_traffic(text, line_no)
            return False
        if tail == "odel" and self.traffic_line is not None and text.startswith("Starting"):
            self.traffic_line = None  # "Starting to load model": a new start-up after the traffic
        for kind, literal, rx in RULES_BY_KEYWORD.get(tail, PROGRESS_RULES):
            if literal not in text:
                continue
            m = rx.search(text)
            if m is None:
                continue
            numbers: dict[str, float] = {}
            for key, value in m.groupdict().items():
                if value is not None:
                    numbers[key] = number(value)
            self.matched = True
            if kind == "kv_blocks" and "gpu_blocks" in numbers:
                numbers["kv_cache_tokens"] = numbers["gpu_blocks"] * self.block_size
                self.blocks_line = line_no
            elif "cudagraph_estimated_gib" in numbers:  # the pool line, or "Estimated CUDA graph memory"
                self._estimate_logged = True
            elif kind == "engine_config" and "block_size=" in text:
                for bm in _BLOCK_SIZE_RE.finditer(text):
                    start = bm.start()
                    if start == 0 or not (text[start - 1].isalnum() or text[start - 1] == "_"):
                        self.block_size = int(bm.group("block_size"))
                        break
            if kind not in _LOADING_KINDS:
                self.obs.update(numbers)
            if kind in _DERIVING_KINDS:  # (only these change what _derive reads)
                derived = self._derive()
                if kind == "cudagraph_estimate":
                    numbers.update(derived)
            reached = KIND_MILESTONE.get(kind, 0)
            if reached > self.reached:
                self.reached = reached
            if events is not None:
                events.append(Progress(kind=kind, numbers=numbers, text=text[:EVIDENCE_CHARS]))
            break
        if tail in _IDENTITY_TAILS:
            if tail == "gine":
                self.traffic_line = None  # the engine's config line: a new run starts
            self._identity(text, tail)
        if tail not in _MILESTONE_TAILS:
            return False
        if tail == "ring" and self.reached < _CAPTURE_STARTED and _CAPTURE_START_RE.search(text) is not None:
            self.reached = _CAPTURE_STARTED
        if (
            tail in ("down", "own]", "gnal")
            and self.shutdown_line is None
            and _SHUTDOWN_RE.search(text) is not None
        ):
            self.shutdown_line = line_no
        if tail in ("lete", "g on") and self.ready_line is None and _READY_RE.search(text) is not None:
            self.ready_line = line_no
            self.ready_text = text.strip()[:EVIDENCE_CHARS]
            if events is not None:
                events.append(Progress(kind="server_ready", numbers={}, text=self.ready_text))
            return True
        return False

    def saw_traffic(self, text: str, line_no: int) -> None:
        """A line that may show request traffic: the first one since the start-up is remembered."""
        if self.traffic_line is None and traffic(text):
            self.traffic_line = line_no

    def _identity(self, text: str, tail: str) -> None:
        """The engine's version, arguments and device, from the lines that print them (first seen wins)."""
        if tail == "args":
            if self.engine_args is None:
                self.engine_args = _literal_args(text)
            return
        if self.engine_version is None:
            vm = _ENGINE_VERSION_RE.search(text)
            if vm is not None:
                self.engine_version = vm.group("version")
        if self.engine_device is None and tail == "gine":
            dm = _DEVICE_RE.search(text)
            if dm is not None:
                self.engine_device = dm.group("device")
        if tail == "gine" and not self._config_read:
            self._config_read = True  # (the first config line: a log may repeat it at every restart)
            self.config_args = _config_args(text)

    def arguments(self) -> dict[str, object]:
        """The engine's arguments: "non-default args" (or r1sup's launch flags) over the config line's."""
        return {**self.config_args, **(self.engine_args or {})}

    def _derive(self) -> dict[str, float]:
        """Observations computed from figures of different lines of the same run; the new ones.

        ``cudagraph_estimated_gib``: vLLM's CUDA-graph estimate taken out of the KV budget, from
        "The current --gpu-memory-utilization=U is equivalent to --gpu-memory-utilization=E" and the
        device's total memory: ``(U - E) x total``. vLLM's own "CUDA graph pool memory: ... (estimated)"
        figure, when logged, is more precise and is kept.
        """
        obs = self.obs
        u = obs.get("profiled_gpu_memory_utilization")
        e = obs.get("equivalent_gpu_memory_utilization")
        total = obs.get("total_gib")
        if self._estimate_logged or u is None or e is None or not total:
            return {}
        value = round(max(0.0, u - e) * total, 3)
        if obs.get("cudagraph_estimated_gib") == value:
            return {}
        obs["cudagraph_estimated_gib"] = value
        return {"cudagraph_estimated_gib": value}
