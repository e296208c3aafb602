"""Failure message families: which failure class a message names, how surely, and its numbers.

Pure: a message in, a :data:`Family` (class, priority, fixed phase, numbers) out. The classes are
``r1sup.core.failure``'s, with the out-of-memory markers whose class the phase decides. Every figure is
taken from a named group. :func:`gate` is the cheap word test a line passes before the families are
tried (a superset: tests check it on every line of the fixtures and the collected excerpts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from r1sup.core.failure import (
    CONFIG_ERROR,
    CUDA_ERROR,
    ENGINE_DEAD,
    FP8_UNSUPPORTED,
    FREE_MEM_BELOW_UTIL,
    HANG,
    HOST_OOM,
    KV_INSUFFICIENT,
    MODEL_NOT_FOUND,
    NO_KV_MEMORY,
    PHASE_KV_CACHE,
    PHASE_LOAD_WEIGHTS,
    PHASE_PROFILE,
    PHASE_STARTUP,
    PORT_IN_USE,
)
from r1sup.core.logparse.figures import number, unit_gib

# (class, priority, the phase the message fixes or None, the numbers it carries)
Family = tuple[str, int, str | None, dict[str, float]]

_P_FP8 = 100
_P_FREE = 95
_P_FREE_PROFILE = 92
_P_KV = 90
_P_NO_KV = 88
_P_PORT = 85
_P_MODEL = 80
_P_HOST_RAY = 72  # Ray's memory monitor killed a worker for host RAM: above the GPU OOM words it contains
_P_OOM = 70
_P_CONFIG = 60
_P_CUDA = 55
_P_HANG = 50  # a wait that timed out: below the CUDA/NCCL faults (a watchdog's abort is a cuda_error)
_P_CONFIG_WEAK = 45
_P_UNKNOWN_VALUE = 40
P_NATIVE = 30  # a native crash (segfault, abort): decided after the unexplained exceptions, by line order
P_HOST = 20
P_HOST_MAYBE = 15  # Ray's list of an actor's possible causes of death, the OOM killer first
P_DEAD = 10

OOM = "oom"  # class decided later from the phase
_OOM_FIXED_PROFILE = "oom:profile"
_OOM_FIXED_WEIGHTS = "oom:weights"

# (class, priority, fixed phase or None, pattern)
_FAMILIES: tuple[tuple[str, int, str | None, re.Pattern[str]], ...] = (
    (
        FP8_UNSUPPORTED,
        _P_FP8,
        None,
        re.compile(
            r"fp8e4nv[^.\n]{0,40}?not supported|not implemented for '?Float8|_scaled_mm is only supported|"
            r"(?i:\bfp8\w*\b[^.\n]{0,80}?(?:not supported|unsupported|not implemented|only supported|"
            r"requires))|"
            r"(?i:(?:not supported|unsupported|not implemented|does not support)[^.\n]{0,60}?\bfp8)"
        ),
    ),
    (
        FREE_MEM_BELOW_UTIL,
        _P_FREE,
        PHASE_STARTUP,
        re.compile(r"on startup\s+is\s+less\s+than\s+desired\s+(?:GPU|CPU)\s+memory\s+utilization"),
    ),
    (
        FREE_MEM_BELOW_UTIL,
        _P_FREE_PROFILE,
        PHASE_PROFILE,
        re.compile(r"Error in memory profiling\. Initial free memory"),
    ),
    (
        KV_INSUFFICIENT,
        _P_KV,
        PHASE_KV_CACHE,
        re.compile(
            r"To serve at least one request with the models?(?:'s)?\s+max\s+seq\s+len|"
            r"is larger than the maximum number of tokens that can be stored in KV cache"
        ),
    ),
    (NO_KV_MEMORY, _P_NO_KV, PHASE_KV_CACHE, re.compile(r"No available memory for the cache blocks")),
    (
        # EADDRINUSE as the C library (Linux 98, macOS 48), Windows (10048), ZMQ ("Address in use" on
        # Windows), torch's c10d store ("errno: 98", "code: -98") and Docker's port publishing print it
        PORT_IN_USE,
        _P_PORT,
        PHASE_STARTUP,
        re.compile(
            r"(?i:address (?:already )?in use)|EADDRINUSE|\[Errno (?:98|48|10048)\]|WinError 10048|"
            r"(?i:only one usage of each socket address)|errno: 98\b|code: -98\b|"
            r"port is already allocated|(?i:port \d+ is already in use)"
        ),
    ),
    (
        MODEL_NOT_FOUND,
        _P_MODEL,
        PHASE_STARTUP,
        re.compile(
            r"Invalid repository ID or local directory|Repo id must be in the form|Repository Not Found|"
            r"RepositoryNotFoundError|GatedRepoError|Cannot access gated repo|is a gated repo|"
            r"access a gated repo|"
            r"No supported config format found|"
            r"(?:401|403|404) Client Error|Unauthorized for url|is not a local folder and is not a valid "
            r"model identifier|"
            r"does not appear to have a file named config\.json|Can't load the configuration of|"
            r"Model path does not exist|"
            r"LocalEntryNotFoundError|HFValidationError|couldn't connect to 'https://huggingface\.co'|"
            r"Cannot find the requested files in the local cache|OfflineModeIsEnabled|Incorrect "
            r"path_or_model_id|"
            r"RevisionNotFoundError|No such file or directory: '[^']*(?:config|params)\.json'|"
            r"Cannot find any model weights"
        ),
    ),
    (
        # Ray's memory monitor names host RAM itself ("ray.exceptions.OutOfMemoryError: Task was killed due
        # to the node running low on memory", "Ray killed this worker ..."): not the GPU
        HOST_OOM,
        _P_HOST_RAY,
        None,
        re.compile(
            r"ray\.exceptions\.OutOfMemoryError|Task was killed due to the node running low on memory|"
            r"Ray killed this worker|killed due to memory pressure \(OOM\)|exceeds the memory usage threshold"
        ),
    ),
    (_OOM_FIXED_PROFILE, _P_OOM, PHASE_PROFILE, re.compile(r"out of memory occurred when warming up")),
    (
        _OOM_FIXED_WEIGHTS,
        _P_OOM,
        PHASE_LOAD_WEIGHTS,
        re.compile(r"Failed to load model - not enough GPU memory"),
    ),
    (
        OOM,
        _P_OOM,
        None,
        re.compile(
            r"(?i:out of memory)(?!: Kill)|OutOfMemoryError|cudaErrorMemoryAllocation|"
            r"CUBLAS_STATUS_ALLOC_FAILED|"
            r"OOM when allocating|RESOURCE_EXHAUSTED"
        ),
    ),
    (
        CONFIG_ERROR,
        _P_CONFIG,
        None,
        re.compile(
            r"is greater than the derived max_model_len|Model architectures? \[[^\]]{0,1000}\] (?:are|"
            r"is) not supported|"
            r"failed to be inspected|Error in inspecting model architecture|Cannot find model module|"
            r"Bfloat16 is only supported|only supported on GPUs with compute capability|"
            r"trust_remote_code|trust-remote-code|contains custom code which must be executed|"
            r"requires you to execute the (?:configuration|tokenizer) file|Failed to load the tokenizer|"
            r"Failed to load the model config|Tokenizer class \w+ does not exist|Couldn't instantiate the "
            r"backend tokenizer|"
            r"Can't load tokenizer|Unrecognized model in|does not recognize this architecture|"
            r"Unknown quantization method|Unknown (?:dtype|data type)|is not supported for quantization|"
            r"is smaller than max_model_len|must be divisible by|is not divisible by|"
            r": error: (?:argument|unrecognized arguments|the following arguments are required)|"
            r"unrecognized arguments:|invalid choice:|validation errors? for \w+|Value error, |"
            r"\[type=value_error|"
            # an address that is not this host's or a port it may not bind: the host settings are wrong
            r"(?i:cannot assign requested address)|EADDRNOTAVAIL|error while attempting to bind on address"
        ),
    ),
    (
        CUDA_ERROR,
        _P_CUDA,
        None,
        re.compile(
            r"(?i:CUDA error)[: ]|CUDA driver error: |DeferredCudaCallError|(?i:NCCL error)|"
            r"NCCL communicator|"
            r"illegal memory access|cudaError\w+|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|"
            r"device-side assert|AcceleratorError|no kernel image is available|unhandled cuda error|"
            r"nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidUsage|RemoteError)|NCCL WARN|"
            r"Cuda failure|(?i:cuda runtime error)|CUDARuntimeError|Triton Error \[CUDA\]|"
            r"HIP error: |hipError\w+|"
            r"Found no NVIDIA driver|No CUDA GPUs are available|CUDA driver version is insufficient|"
            r"CUDA driver initialization failed|unspecified launch failure|misaligned address|"
            r"uncorrectable ECC error|CUDA-capable device\(s\) is/are busy or unavailable|"
            r"Unexpected error from cudaGetDeviceCount|fallen off the bus|NVRM: Xid|"
            r"Watchdog caught collective operation timeout|"
            # NCCL: its error codes, its watchdog (a collective that never finished, a hung NCCL/CUDA call)
            r"NCCL_ERROR_\w+|NCCL watchdog thread terminated|watchdog got stuck for|"
            r"Heartbeat monitor timed out|"
            r"Some NCCL operations have failed or timed out|"
            # a kernel's own assertion ("...IndexKernel.cu:92: operator(): block: [0,0,0], thread: [0,0,0]
            # Assertion `...` failed.")
            r"\.cu:\d+: [^\n]{0,200}?Assertion `|"
            r"OutOfResources|out of resource: shared memory"
        ),
    ),
    (
        # A hang the log itself shows: a wait between the engine's processes that timed out, or vLLM's
        # message queue reporting its readers stuck. Stable parts of the messages of Gloo
        # (unbound_buffer.cc, pair.cc), torch's TCPStore rendezvous, vLLM's engine client, RPC and
        # shm_broadcast.py (V0: "No available block found in 60 second", V1: "No available shared memory
        # broadcast block found in 60 seconds"). A timeout NCCL's watchdog aborts on stays a cuda_error.
        HANG,
        _P_HANG,
        None,
        re.compile(
            r"Timed out waiting \d+ ?ms for (?:send|recv) operation|Application timeout caused pair closure|"
            r"Timed out waiting for engines? to send|RPC call to \w+ timed out|"
            r"Timed out after \d+ seconds waiting for clients|"
            r"No available (?:shared memory broadcast )?block found in \d+ seconds?"
        ),
    ),
    (
        CONFIG_ERROR,
        _P_CONFIG_WEAK,
        None,
        re.compile(
            r"\b[Uu]nsupported\b|\bnot supported\b|NotImplementedError|\bis not implemented\b|"
            r"not implemented for|\bonly supports\b"
        ),
    ),
    (
        # a native crash of the engine (a segfault or abort in a kernel, NCCL, a C++ exception): the
        # non-memory device fault r1sup can only retry
        CUDA_ERROR,
        P_NATIVE,
        None,
        re.compile(
            r"Segmentation fault|Aborted \(core dumped\)|Bus error \(core dumped\)|"
            r"SIGSEGV(?! or other unexpected errors)|SIGABRT|"  # (not in Ray's list of possible causes)
            r"SIGBUS|Fatal Python error: (?:Segmentation fault|Aborted|Bus error)|Segfault encountered|"
            r"terminate called after throwing an instance of|terminate called without an active exception|"
            # a worker killed by SIGABRT (an abort in CUDA or NCCL code), as vLLM's process monitor prints it
            r"died, exit code:? -6\b|exitcode=-6\b|^Aborted\s*$"
        ),
    ),
    (
        HOST_OOM,
        P_HOST,
        None,
        re.compile(
            r"^Killed\s*$|^\S.{0,200}?:\s+\d+\s+Killed\b|"
            r"Out of memory: Kill(?:ed)? process|oom-kill|OOMKilled|"
            r"invoked oom-killer|(?:^|\s)MemoryError\b|Cannot allocate memory|std::bad_alloc|"
            r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)|"
            r"exit ?code[:=]? ?-9\b|exited with code 137|exit status 137"
        ),
    ),
    (
        # Ray's generic actor death lists the OOM killer first among the possible causes ("(1) The process
        # is killed by SIGKILL by OOM killer ... (3) ... SIGSEGV ..."): host memory when nothing else in the
        # log explains the death
        HOST_OOM,
        P_HOST_MAYBE,
        None,
        re.compile(r"killed by SIGKILL by OOM killer"),
    ),
    (
        ENGINE_DEAD,
        P_DEAD,
        None,
        re.compile(
            r"EngineDeadError|Engine core initialization failed|Engine process failed to start|"
            r"EngineCore failed to start|Got fatal signal from worker processes|"
            r"Background loop has errored already|"
            r"Engine loop has died|died unexpectedly|EngineCore encountered a fatal error|"
            r"MQLLMEngine is already dead|Engine loop is not running|"
            r"Engine core proc \S+ died|Background loop is not running|core dumped|"
            r"Fatal Python error|Engine background task failed|Task finished unexpectedly"
        ),
    ),
)


def _literal_trie(words: Iterable[str]) -> str:
    """One regex matching any of ``words``, nested by common prefixes so a search tries few branches."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        if "" in node:
            return ""  # a shorter word ends here: it already makes the match
        alts = [re.escape(ch) + build(sub) for ch, sub in sorted(node.items())]
        return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"

    return build(trie)


# Any line a family could match holds one of these, in any case (the cheap gate before the families;
# tests check it against every family on every line of the fixtures and the real excerpts).
GATE_WORDS = (
    # fp8
    "fp8", "float8", "scaled_mm",
    # free memory, KV cache
    "desired", "memory profiling", "at least one request", "stored in kv cache", "cache blocks",
    # port
    "in use", "eaddrinuse", "errno", "winerror", "socket address", "code: -98", "already allocated",
    # model not found
    "repository", "repo id", "gatedrepo", "gated", "config format", "client error", "unauthorized",
    "valid model identifier", "config.json", "load the configuration", "model path", "entrynotfound",
    "localentrynotfound",
    "hfvalidation", "huggingface", "local cache", "offlinemode", "path_or_model_id", "revisionnotfound",
    "no such file", "model weights",
    # out of memory
    "out of memory", "not enough gpu memory", "outofmemory", "memoryallocation", "alloc_failed", "oom when",
    "resource_exhausted",
    # configuration
    "derived max_model_len", "model architecture", "failed to be inspected", "model module", "bfloat16",
    "compute capability", "trust_remote_code", "trust-remote-code", "custom code", "execute the",
    "tokenizer", "model config", "unrecognized model", "recognize this architecture", "unknown quantization",
    "unknown d", "for quantization", "smaller than max_model_len", "divisible by", ": error: ",
    "unrecognized arguments", "invalid choice", "validation error", "value error", "value_error",
    "assign requested", "eaddrnotavail", "bind on address",
    # CUDA, NCCL, native crashes
    "cuda error", "cuda driver error", "deferredcuda", "nccl error", "nccl communicator",
    "illegal memory access", "cudaerror", "cublas_status", "cudnn_status", "device-side assert",
    "acceleratorerror", "no kernel image", "unhandled cuda", "ncclunhandled", "ncclsystem", "ncclinternal",
    "ncclinvalid", "ncclremote", "nccl warn", "cuda failure", "cuda runtime error", "cudaruntimeerror",
    "triton error", "hip error", "hiperror", "no nvidia driver", "no cuda gpus", "cuda driver version",
    "cuda driver initialization", "launch failure", "misaligned address", "ecc error", "cuda-capable device",
    "cudagetdevicecount", "fallen off the bus", "nvrm: xid", "collective operation timeout",
    "outofresources", "out of resource", "segmentation fault", "aborted (core dumped)", "bus error (core",
    "sigsegv", "sigabrt", "sigbus", "fatal python error", "segfault", "terminate called",
    "nccl_error", "nccl watchdog", "watchdog got stuck", "heartbeat monitor", "some nccl operations",
    "assertion `", "exit code", "exitcode", "aborted",
    # hang
    "timed out waiting", "application timeout", "rpc call to", "no available",
    # weak configuration
    "unsupported", "not supported", "notimplemented", "not implemented", "only supports",
    # host memory
    "killed", "oom-kill", "oomkilled", "memoryerror", "cannot allocate memory", "bad_alloc",
    "defaultcpuallocator", "exit code", "exitcode", "exited with code", "exit status",
    "ray.exceptions.outofmemory", "running low on memory", "ray killed", "memory pressure",
    "memory usage threshold", "oom killer",
    # engine death
    "enginedead", "asyncenginedead", "mqenginedead", "engine core initialization", "engine process failed",
    "enginecore failed", "fatal signal",
    "background loop", "engine loop", "died unexpectedly", "enginecore encountered", "engine core proc",
    "core dumped", "engine background task", "task finished unexpectedly", "mqllmengine", "already dead",
    "engine loop is not running",
)  # fmt: skip


def word_start_trie(words: Iterable[str]) -> re.Pattern[str]:
    """A regex finding any of ``words`` at a word start of a lowercased line with a space put before it.

    A word start follows a character other than a lowercase letter or a digit (an underscore, a dot,
    a bracket count: "torch._scaled_mm", "cublas_status_alloc_failed"); a word that begins with such a
    character stands for that boundary. The pattern then begins with a character class, which lets
    the regex engine skip every position inside a word.
    """
    return re.compile(
        r"[^a-z0-9](?:" + _literal_trie(w[1:] if not w[0].isalnum() else w for w in words) + ")"
    )


_GATE_RE = word_start_trie(GATE_WORDS)


def gate(text: str) -> bool:
    """Whether a family pattern could match ``text`` (cheap; a superset of ``match_families``)."""
    return _GATE_RE.search(" " + text.lower()) is not None


# The engine's configuration as it prints it (its config line, the API server's args): never a cause,
# whatever settings it names ("trust_remote_code=True"), when a paste lost its stamp
CONFIG_DUMP_RE = re.compile(
    r"LLM engine \(v[^)\s]{1,40}\) with config: |\bwith config: model=|\bargs: Namespace\(|"
    r"non-default args: \{"
)

# Deaths of an engine that was already running requests: what fails after them fails while serving.
SERVING_DEATH_RE = re.compile(
    r"EngineCore encountered a fatal error|Engine background task failed|Task finished unexpectedly|"
    r"Background loop has errored already|Engine loop has died|MQLLMEngine is already dead|"
    r"Engine loop is not running"
)
# Per-request errors: the server stays up (an over-long prompt, an unknown model name in a request).
BENIGN_RE = re.compile(
    r"maximum context length|is longer than the maximum model length|is too long to fit into the model|"
    r"[Pp]lease reduce the length of the|The model `[^`]{0,300}` does not exist|exceeds the max_model_len|"
    r"is too long and exceeds (?:the )?limit|Error in preprocessing prompt inputs|"
    r"Dumping (?:input data|scheduler)|out-of-memory error occurs|[Pp]rompt length of \d+ is longer"
)
EXC_HEADER_RE = re.compile(
    r"(?:[A-Za-z_]\w*\.)*(?P<name>[A-Z]\w*(?:Error|Exception|Exit|Interrupt))(?=:|\(|\s*$)"
)
NOT_A_CAUSE = frozenset(
    {
        "SystemExit",
        "KeyboardInterrupt",
        "CancelledError",
        "GeneratorExit",
        "StopIteration",
        "StopAsyncIteration",
        "BrokenPipeError",
        "ConnectionResetError",
        "EngineDeadError",
        "AsyncEngineDeadError",
        "EngineGenerateError",
    }
)
CONFIG_LIKE = frozenset({"ValueError", "TypeError", "ValidationError"})
# An unexplained exception that is a wait which ran out (vLLM's message queue raises it bare: "TimeoutError")
HANG_LIKE = frozenset({"TimeoutError"})

# Numbers carried by failure messages: each figure is a named group, its key in ``Failure.numbers``.
# A size with its unit printed beside it has the unit in ``<key>_unit`` and is converted to the key's
# unit (``_gib`` or ``_mib``).
_NUMC = r"\d+(?:,\d{3})*(?:\.\d+)?"
_UNIT = r"[KMGT]i?B"


def _n(key: str) -> str:
    return rf"(?P<{key}>{_NUMC})"


def _size(key: str, units: str = _UNIT) -> str:
    return rf"{_n(key)} ?(?P<{key}_unit>{units})"


_RX_KV_V1 = re.compile(
    rf"max\s+seq\s+len\s+\({_n('max_model_len')}\),?\s*\(\s*{_n('kv_needed_gib')}\s*GiB\s+KV\s*cache\s+is"
    rf"\s+needed,\s*which\s+is\s+larger\s+than\s+"
    rf"the\s+available\s+KV\s*cache\s+memory\s+\(\s*(?P<kv_available_gib>-?{_NUMC})\s*GiB\)"
)
_RX_KV_EST = re.compile(rf"estimated\s+maximum\s+model\s+length\s+is\s+{_n('estimated_max_model_len')}")
_RX_KV_V0 = re.compile(
    rf"max seq len \({_n('max_model_len')}\) is larger than the maximum number of tokens that can be "
    rf"stored in KV cache \({_n('kv_capacity_tokens')}\)"
)
_RX_FREE = re.compile(
    rf"\({_n('free_gib')}/{_n('total_gib')}\s*GiB\)\s+on\s+startup\s+is\s+less\s+than\s+desired\s+"
    rf"(?:GPU|CPU)\s+memory\s+utilization\s+"
    rf"\({_n('gpu_memory_utilization')},\s*{_n('requested_gib')}\s*GiB\)"
)
_RX_FREE_PROFILE = re.compile(
    rf"Initial free memory {_n('initial_free_gib')} ?GiB, current free memory {_n('free_gib')} ?GiB"
)
_RX_TRIED = re.compile(rf"Tried to allocate {_size('tried_to_allocate_mib', r'[KMGT]i?B|bytes?')}")
_RX_CAP24 = re.compile(
    rf"GPU (?P<device_index>\d+) has a total capac(?:i)?ty of {_size('device_total_gib')} of which "
    rf"{_size('device_free_mib', r'[KMGT]i?B|bytes')} is free"
)
_RX_CAP20 = re.compile(
    rf"\(GPU (?P<device_index>\d+); {_size('device_total_gib')} total capacity; "
    rf"{_size('device_allocated_gib')} already allocated; {_size('device_free_mib')} free"
)
_RX_INUSE = re.compile(rf"(?:this process|Process \d+) has {_size('process_in_use_gib')} memory in use")
# torch's breakdown after its OOM message (2.1 on)
_RX_TORCH_HELD = re.compile(
    rf"Of the allocated memory {_size('allocated_by_pytorch_gib')} is allocated by PyTorch, "
    rf"(?:with {_size('private_pools_mib')} allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    rf"and {_size('reserved_unallocated_mib')} is reserved by PyTorch but unallocated"
)
# Ray's memory monitor: "... was running was 12.49GB / 13.15GB (0.950003), which exceeds ..."
_RX_RAY_NODE = re.compile(rf"was running was {_n('host_used_gb')} ?GB / {_n('host_total_gb')} ?GB")
_RX_SAMPLER = re.compile(r"warming up (?:sampler|pooler) with (?P<dummy_requests>\d+) dummy requests")
_RX_DERIVED = re.compile(
    rf"User-specified max_model_len \({_n('max_model_len')}\) is greater than the derived max_model_len "
    rf"\((?:\w+=)?{_n('derived_max_model_len')}"
)
# uvicorn, docker, torch.distributed's TCPStore, ZMQ: one alternative matches, its group is the port
_RX_PORT = re.compile(
    r"bind on address \(?'?[^',)]*'?,\s*(?P<port_bind>\d+)\)|Bind for \S*:(?P<port_docker>\d+) failed|"
    r"\bport: (?P<port_store>\d+), useIpv6|\(addr='\w+://[^']*:(?P<port_zmq>\d+)'\)"
)
_RX_CC = re.compile(r"(?:has compute capability|Current capability:) (?P<compute_capability>\d+(?:\.\d+)?)")

# the patterns tried on a message of each class, in order (a later figure of the same key wins)
_NUMBERS_BY_CLASS: dict[str, tuple[re.Pattern[str], ...]] = {
    KV_INSUFFICIENT: (_RX_KV_V1, _RX_KV_EST, _RX_KV_V0),
    FREE_MEM_BELOW_UTIL: (_RX_FREE, _RX_FREE_PROFILE),
    OOM: (_RX_TRIED, _RX_CAP24, _RX_CAP20, _RX_INUSE, _RX_TORCH_HELD, _RX_SAMPLER),
    HOST_OOM: (_RX_RAY_NODE,),
    CONFIG_ERROR: (_RX_DERIVED, _RX_CC),
    FP8_UNSUPPORTED: (_RX_CC,),
}


def _figures(m: re.Match[str]) -> dict[str, float]:
    """The figures of a match by their group names, sizes converted to the unit their key names."""
    groups = m.groupdict()
    out: dict[str, float] = {}
    for key, value in groups.items():
        if value is None or key.endswith("_unit"):
            continue
        unit = groups.get(key + "_unit")
        if unit is None:
            out[key] = number(value)
        else:
            gib = unit_gib(number(value), unit)
            out[key] = round(gib * 1024 if key.endswith("_mib") else gib, 3)
    return out


def failure_numbers(cls: str, text: str) -> dict[str, float]:
    """The numbers a message of class ``cls`` carries (canonical keys of ``Failure.numbers``)."""
    out: dict[str, float] = {}
    if cls == PORT_IN_USE:
        m = _RX_PORT.search(text)
        if m:
            out["port"] = next(number(v) for v in m.groupdict().values() if v is not None)
        return out
    for rx in _NUMBERS_BY_CLASS.get(OOM if cls.startswith(OOM) else cls, ()):
        m = rx.search(text)
        if m:
            out.update(_figures(m))
    if "compute_capability" in out and out["compute_capability"] >= 10:
        out["compute_capability"] /= 10  # "75" means 7.5
    if "requested_gib" in out and "free_gib" in out and cls == FREE_MEM_BELOW_UTIL:
        out["shortfall_gib"] = round(out["requested_gib"] - out["free_gib"], 3)  # what was missing
    return out


def specificity(fam: Family) -> tuple[int, bool, int]:
    """How surely a family names the failure: priority, a fixed phase, how many numbers it carries."""
    return fam[1], fam[2] is not None, len(fam[3])


def match_families(text: str) -> Family | None:
    """The most specific family ``text`` belongs to: (class, priority, fixed phase, numbers)."""
    best: tuple[str, int, str | None] | None = None
    for cls, prio, phase, rx in _FAMILIES:
        if (best is None or prio > best[1]) and rx.search(text):
            best = (cls, prio, phase)
    if best is None:
        return None
    cls, prio, phase = best
    return cls, prio, phase, failure_numbers(cls, text)
