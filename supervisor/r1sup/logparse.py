"""Read vLLM's output: relay lines, success-path numbers, and one verdict (a :class:`Failure`).

Pure: lines in, typed values out; no ``os``, no clock, no subprocess. Streaming: the reader keeps a
bounded state (per-process traceback frames, the best finding per class, numbers) and never the log.

How a verdict is reached:

* Every line is cleaned of its wrappers (docker/k8s/CI prefixes, vLLM's ``(EngineCore_DP0 pid=..)``
  process tag, the logger stamp, ANSI colours, ``^M``, Ray's ``[repeated Nx across cluster]``).
* Lines that vLLM logged at INFO/DEBUG/WARNING are *quiet*: they can only carry progress (numbers on
  the success path), never a failure, so ``If out-of-memory error occurs ...`` is harmless.
* Other lines (ERROR, CRITICAL, raw stderr) are matched against the message families of each failure
  class. Every match is kept (earliest per class) and the verdict takes the most specific class, not
  the last line: ``Engine core initialization failed`` or ``EngineDeadError`` only decide the class
  when nothing else explains the failure.
* The phase comes from the traceback frames of the finding (``load_model``, ``profile_run``,
  ``capture_model`` ...), from frames seen anywhere in the log, from whether readiness was reached,
  and last from the progress milestones already passed.

Most lines of a log change nothing: :meth:`LogReader.feed_chunks` and :meth:`LogReader.feed_lines` read
the commonest ones (quiet records, Python warnings and the source lines under them, progress bars,
short raw lines holding no word the reader looks for) in one loop, and only the others through the
full path; tests check that both read every fixture and collected excerpt alike.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from r1sup.failure import (
    CONFIG_ERROR,
    CUDA_ERROR,
    ENGINE_DEAD,
    FP8_UNSUPPORTED,
    FREE_MEM_BELOW_UTIL,
    HOST_OOM,
    KV_INSUFFICIENT,
    MODEL_NOT_FOUND,
    NO_KV_MEMORY,
    NONE,
    OOM_CUDAGRAPH,
    OOM_KV_ALLOC,
    OOM_PROFILE,
    OOM_RUNTIME,
    OOM_WEIGHTS,
    PHASE_CUDA_GRAPH,
    PHASE_KV_CACHE,
    PHASE_LOAD_WEIGHTS,
    PHASE_PROFILE,
    PHASE_SERVING,
    PHASE_STARTUP,
    PORT_IN_USE,
    Failure,
)

__all__ = [
    "Diagnosis",
    "LogLine",
    "LogReader",
    "Progress",
    "diagnose_text",
    "lines_from_chunks",
]

DEFAULT_MAX_LINE_CHARS = 65536
EVIDENCE_CHARS = 2000  # longest evidence kept in a verdict
JOIN_CHARS = 4096  # longest exception message rebuilt from continuation lines
JOIN_LINES = 8  # continuation lines followed after an exception line
PENDING_WINDOW = 12  # lines after which an open exception message is closed whatever comes
WRAP_MIN_WIDTH = 72  # a line this long followed by an unprefixed piece may have been hard-wrapped
COLLAPSED_TAIL = 20  # text after a frame's function name beyond this: more records on the same line
COLLAPSED_LONG = 400  # a line this long may hold several records (frames are scanned inside it)
_BATCH_LINES = 4096  # lines LogReader.feed_lines gathers before reading them in one loop
MAX_PROCESSES = 256  # per-process states kept (oldest dropped)
BLOCK_SIZE = 16  # vLLM's default KV block size, used to round context lengths

# ----------------------------------------------------------------------------------------------
# Public value types


@dataclass(frozen=True)
class LogLine:
    """One relayed vLLM line with its prefixes parsed out."""

    text: str
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    level: str | None = None


@dataclass(frozen=True)
class Progress:
    """A success-path milestone with its numbers (canonical keys)."""

    kind: str
    numbers: Mapping[str, float]
    text: str


@dataclass(frozen=True)
class Diagnosis:
    """A verdict with where it comes from: what ``r1sup diagnose`` reports."""

    failure: Failure
    line: int | None  # 1-based line of the input holding the evidence; None when no line carries it
    vllm_log: bool  # a line was recognised as vLLM output, or the verdict names a failure
    lines: int  # lines read


# ----------------------------------------------------------------------------------------------
# Line cleaning

_LEVELS = "DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"
# Progress lines start their message with one of these (after the level stamp and vLLM's
# ``[file.py:123]`` source); a quiet line without one cannot change the reader's state.
_PROGRESS_KEYWORDS = (
    r"Model loading took|Loading (?:model )?weights took|Available KV cache memory|"
    r"[A-Z][A-Z][A-Z](?: \+ host)? KV cache size|"
    r"Maximum concurrency|# \w+ blocks|Graph capturing finished|CUDA graph pool memory|"
    r"CUDA graph memory profiling is enabled|"
    r"Free memory on device \(|"
    r"init engine \(profile|Application startup complete|Uvicorn running on|"
    r"Initializing an? (?:V1 )?LLM engine|"
    r"Using max model len|Auto-fit max_model_len|Shutting down|\[shutdown\]|Memory profiling|"
    r"the current vLLM instance|model weights take|Capturing|Received signal|Explicitly set \(|"
    r"Starting to load model|Multi-thread [Ll]oading [\w ]{1,40}?(?:checkpoint shards|using )|"
    r"[Ll]oading [\w ]{1,40}?(?:checkpoint shards|using )|"
    r"Warming up model|Starting vLLM (?:API )?server|"
    r"Estimated CUDA graph memory|worker init memory snapshot|Chunked prefill is enabled|non-default args"
)
# A level stamp as vLLM's logger (LEVEL MM-DD HH:MM:SS [file.py:123]) or uvicorn (LEVEL:   ) writes it,
# with the progress keyword that may start the message. The first stamp of a line tells whether
# vLLM logged it quietly (INFO/DEBUG/WARNING: progress only) or as a possible failure.
# The stamp counts at the start of a line or after a prefix's last character (a space, "|", ">", ")",
# "]"). The group that matched last tells it all (``m.lastindex``): up to ``_QUIET_LAST`` a quiet level
# without a progress keyword (a line that cannot change the reader's state), beyond it an error level,
# ``_KW_GROUP`` a progress keyword (after a quiet level when the match starts with D, I or W).
# (Each level is its own alternative with an empty group after it, and the start check follows the
# level: the pattern then begins with plain letters, which lets the regex engine skip to the candidates.)
_STAMP_RE = re.compile(
    "(?:"
    + "|".join(
        rf"{level}(?<![^ \t|>)\]]{level})(?P<{group}>)"
        for level, group in (
            ("DEBUG", "q"),
            ("INFO", "qi"),
            ("WARNING", "qw"),
            ("ERROR", "e"),
            ("CRITICAL", "ec"),
        )
    )
    + r")(?::\s+| \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? (?:\[[^\]\s]{1,120}\] ?|[^\]\s]{1,120}\] ?)?)"
    rf"(?P<kw>{_PROGRESS_KEYWORDS})?"
)
_QUIET_LAST = _STAMP_RE.groupindex["qw"]  # m.lastindex <= this: a quiet level and no progress keyword
_KW_GROUP = _STAMP_RE.groupindex["kw"]
_QUIET_INITIALS = "DIW"  # the first letters of the quiet levels
_STAMP_WINDOW = 320  # characters searched for the stamp
# In a quiet line longer than COLLAPSED_LONG, these mean more records were pasted onto it.
_COLLAPSED_ALERT_RE = re.compile(r" ERROR \d\d-\d\d |ERROR: |Traceback \(most recent call last\)")
_RAW_PROGRESS_RE = re.compile(rf"\s*(?P<kw>{_PROGRESS_KEYWORDS})")

_ANSI_RE = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_REPEATED_RE = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_CARET_M_RE = re.compile(r"(?:\^M)+\s*$")

_TS = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_OUTER_RE = re.compile(
    r"(?:"
    r"\s*>[ \t]?"  # markdown quote
    r"|[ \t]*\|[ \t]"  # CI (buildkite) pipe
    r"|\[rank\d+\]:(?![IWEF]\d{4})[ \t]?"  # torch.distributed rank tag
    rf"|\[{_TS}\][ \t]*"  # [2024-09-05T00:38:34Z]
    rf"|{_TS}[ \t]+\|[ \t]+(?P<fc>{_LEVELS})[ \t]+\|[ \t]+[\w.-]+[ \t]+\|[ \t]?"  # fastchat re-logging
    rf"|{_TS}[ \t]+-[ \t]+(?P<pl>{_LEVELS})[ \t]+-[ \t]+"  # python logging "ts - LEVEL - "
    rf"|{_TS}[ \t]+(?:(?:stdout|stderr)[ \t]+[FP][ \t]+)?(?=\S)(?!(?:{_LEVELS})\b)(?!\d+[ \t])"  # docker/k8s
    r"|[A-Z][a-z]{2}[ \t]+\d{1,2}[ \t]\d\d:\d\d:\d\d[ \t]\S+[ \t][\w.@/-]+(?:\[\d+\])?:[ \t]"  # syslog
    r"|[\w.-]+[ \t]+\|[ \t]"  # docker compose "vllm-1  | "
    r"|\[(?:pod|deployment|statefulset|job|daemonset)/[\w.-]+/[\w.-]+\][ \t]"  # kubectl logs --prefix
    r"|[ \t]*[\u2502\u2503][ \t]?"  # a box-drawing frame of a log viewer
    # a harness relaying the output through rich's logging handler: "[05/05/25 16:31:14] INFO     "
    r"|[ \t]*(?:\[\d\d/\d\d/\d\d[ \t]\d\d:\d\d:\d\d\][ \t]+)?"
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[ \t]{2,}(?=\S)"
    r")"
)
_PROC_RE = re.compile(
    r"\(?(?P<proc>[A-Za-z_][\w.-]*?)(?:[ \t]+rank=(?P<rank>\d+))?[ \t]+pid=(?P<pid>\d+)"
    r"(?:,[ \t]*ip=[\w.:-]+)?\)[ \t]?"
)
_LOGGER_RE = re.compile(
    rf"(?P<v>{_LEVELS})[ \t]+\d\d-\d\d[ \t]+\d\d:\d\d:\d\d(?:\.\d+)?[ \t]+\[?[\w./-]+:\d+\][ \t]?"
    rf"|{_TS}[ \t]+(?:[\w.]+[ \t]+)?(?P<c>{_LEVELS})[ \t]+(?:\d+[ \t]+)?(?:\[[\w./-]+:\d+\][ \t]?)?"
    rf"|(?P<u>{_LEVELS}):(?:[\w.]+:|[ \t]+)"
    r"|(?:\[rank\d+\]:)?(?P<g>[IWEF])\d{4}[ \t]+[\d:.]+[ \t]+(?:\d+[ \t]+)?[\w./-]+:\d+\][ \t]?"
    r"|\[(?P<w>[IWEF])\d{4}[ \t]+[\d:.]+[ \t]+[\w./-]+:\d+\][ \t]?"
)
_VLLM_STAMP_RE = re.compile(  # the first form of _LOGGER_RE alone: vLLM's own logger
    rf"(?P<v>{_LEVELS})[ \t]+\d\d-\d\d[ \t]+\d\d:\d\d:\d\d(?:\.\d+)?[ \t]+\[?[\w./-]+:\d+\][ \t]?"
)
_GLOG_LEVEL = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
_RANK_IN_NAME_RE = re.compile(r"(?:TP|-)(\d+)$")


def _norm_level(level: str | None) -> str | None:
    if level is None:
        return None
    if level == "WARN":
        return "WARNING"
    if level == "FATAL":
        return "CRITICAL"
    return level


_UNSTAMPED = 0  # no vLLM/uvicorn level stamp: raw stderr, or a line from elsewhere
_STAMPED = 1  # vLLM or uvicorn logged it at ERROR/CRITICAL: it may carry a failure
_QUIET_LINE = 2  # logged at INFO/DEBUG/WARNING: no failure, no progress keyword
_QUIET_PROGRESS = 3  # logged at INFO/DEBUG/WARNING, the message starts with a progress keyword


def _kind_of(m: re.Match[str] | None) -> tuple[int, str | None]:
    """What the first level stamp of a line (``_STAMP_RE.search(line, 0, _STAMP_WINDOW)``) says,
    ``_UNSTAMPED`` ... ``_QUIET_PROGRESS``, and the progress keyword that starts its message.

    A line is quiet when its first level stamp is INFO/DEBUG/WARNING: vLLM logs progress at those
    levels and failures at ERROR (or as raw stderr), so a quiet line can only carry progress.
    """
    if m is None:
        return _UNSTAMPED, None
    last = m.lastindex or 0
    if last <= _QUIET_LAST:
        return _QUIET_LINE, None
    if last == _KW_GROUP and m.string[m.start()] in _QUIET_INITIALS:
        return _QUIET_PROGRESS, m.group(last)
    return _STAMPED, None


def _message(segment: str, start: int) -> str:
    """The message of a stamped line from ``start``, cleaned as :func:`parse_line` cleans a line."""
    text = segment[start:]
    if "^M" in text:
        text = _CARET_M_RE.sub("", text)
    if "across cluster]" in text:
        text = _REPEATED_RE.sub("", text)
    return text.rstrip()


def _segments(raw: str) -> list[str]:
    """A raw line split at carriage returns (progress bars, pasted CR), empty pieces dropped."""
    if raw.endswith("\n"):
        raw = raw[:-1]
    if "\x1b" in raw:
        raw = _ANSI_RE.sub("", raw)
    if "\x00" in raw:
        raw = raw.replace("\x00", "")
    if "\r" not in raw:
        return [raw]
    parts = [p for p in raw.split("\r") if p.strip()]
    return parts or [""]


def parse_line(segment: str) -> LogLine:
    """Strip docker/k8s/CI wrappers, vLLM's process tag and the logger stamp from one line."""
    text = segment
    if "^M" in text:
        text = _CARET_M_RE.sub("", text)
    if "across cluster]" in text:
        text = _REPEATED_RE.sub("", text)
    level: str | None = None
    for _ in range(6):
        if text[:1] == "(":
            break  # vLLM's process tag comes next: no wrapper left
        m = _OUTER_RE.match(text)
        if m is None or m.end() == 0:
            break
        level = level or m.group("fc") or m.group("pl")
        text = text[m.end() :]
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    m = _PROC_RE.match(text)
    if m is not None:
        process = m.group("proc")
        pid = int(m.group("pid"))
        if m.group("rank") is not None:
            rank = int(m.group("rank"))
        elif "orker" in process:
            rm = _RANK_IN_NAME_RE.search(process)
            rank = int(rm.group(1)) if rm else None
        text = text[m.end() :]
    m = _LOGGER_RE.match(text)
    if m is None and text[:1] == " " and text.lstrip()[:1].isupper():
        # a stamp after stray indentation (lines pasted with their newlines collapsed)
        unindented = text.lstrip()
        m = _LOGGER_RE.match(unindented)
        if m is not None:
            text = unindented
    if m is not None:
        g = m.group("g") or m.group("w")
        level = _norm_level(m.group("v") or m.group("c") or m.group("u") or (_GLOG_LEVEL[g] if g else None))
        text = text[m.end() :]
    return LogLine(text=text.rstrip(), process=process, rank=rank, pid=pid, level=_norm_level(level))


def _fast_line(segment: str, start: int) -> LogLine | None:
    """:func:`parse_line` of a line that is an optional process tag, then vLLM's stamp at ``start``
    (the common case, read without trying every wrapper); None for any other line."""
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    if start:
        if segment[0] != "(":
            return None
        pm = _PROC_RE.match(segment)
        if pm is None or pm.end() != start:
            return None
        process = pm.group("proc")
        pid = int(pm.group("pid"))
        if pm.group("rank") is not None:
            rank = int(pm.group("rank"))
        elif "orker" in process:
            rm = _RANK_IN_NAME_RE.search(process)
            rank = int(rm.group(1)) if rm else None
    vm = _VLLM_STAMP_RE.match(segment, start)
    if vm is None:
        return None
    return LogLine(
        text=_message(segment, vm.end()),
        process=process,
        rank=rank,
        pid=pid,
        level=_norm_level(vm.group("v")),
    )


# ----------------------------------------------------------------------------------------------
# Progress (success path)

_NUM = r"-?\d+(?:,\d{3})*(?:\.\d+)?"
_GAP = r".{0,300}?"  # a bounded gap inside one message (no unbounded .* on long lines)


def _f(s: str) -> float:
    """A number as vLLM printed it: an int when it has no decimals (token and block counts, lengths)."""
    s = s.replace(",", "")
    return float(s) if "." in s else int(s)


def _unit_gib(value: float, unit: str) -> float:
    unit = unit.upper().replace("I", "")
    scale = {"B": 1 / 2**30, "BYTES": 1 / 2**30, "KB": 1 / 2**20, "MB": 1 / 2**10, "GB": 1.0, "TB": 1024.0}
    return value * scale.get(unit, 1.0)


# How far a start-up got, from its progress lines
_STAGE_NONE = 0
_STAGE_WEIGHTS = 1
_STAGE_KV = 2
_STAGE_CAPTURE = 3
_STAGE_CAPTURED = 4

# (kind, a literal every match contains, pattern): the pattern's named groups are the numbers
# gpu_worker.py compile_or_warm_up_model's memory breakdown (0.20 on), up to the figures that changed
_BREAKDOWN_HEAD = (
    rf"Free memory on device \((?P<free_gib>{_NUM})/(?P<total_gib>{_NUM}) GiB\) on startup\. "
    rf"Desired GPU memory utilization is \((?P<gpu_memory_utilization>{_NUM}), "
    rf"(?P<requested_gib>{_NUM}) GiB\)\. "
)
_PROGRESS_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = (
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
    # Loading progress (phases and vLLM's own percent; read by r1sup.progress). The shard bar is
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
)
# progress kinds whose numbers describe the loading itself, not the engine (kept out of observations)
_LOADING_KINDS = frozenset({"weights_progress", "graph_capture"})
# The rules a keyword's line can match, by the keyword's last four characters (the keywords that vary,
# "GPU KV cache size", "# CUDA blocks", end alike), their order kept so that the first that matches is
# the one trying them all would find; a keyword not here tries every rule.
_RULES_BY_KEYWORD = {
    tail: tuple(rule for rule in _PROGRESS_RULES if rule[0] in kinds)
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
    }.items()
}


# The milestone each kind of progress line marks
_KIND_STAGE = {
    "weights_loaded": _STAGE_WEIGHTS,
    "kv_cache_available": _STAGE_KV,
    "kv_cache_size": _STAGE_KV,
    "kv_blocks": _STAGE_KV,
    "memory_profile": _STAGE_KV,
    "cudagraph_memory": _STAGE_CAPTURED,
}
# The numbers LogReader._derive reads, and the kinds of progress line that carry them
_DERIVE_INPUTS = frozenset(
    {"profiled_gpu_memory_utilization", "equivalent_gpu_memory_utilization", "total_gib"}
)
_DERIVING_KINDS = frozenset(kind for kind, _, rx in _PROGRESS_RULES if _DERIVE_INPUTS & rx.groupindex.keys())
# The keyword tails of the lines that may start the capture, the serving or the shutdown
_MILESTONE_TAILS = frozenset({"ring", "lete", "g on", "down", "own]", "gnal"})
# The engine's identity: its version ("Initializing a V1 LLM engine (v0.19.0)"), the arguments it was
# given ("non-default args: {...}") and its device ("device_config=cuda")
_IDENTITY_TAILS = frozenset({"gine", "args"})
_ENGINE_VERSION_RE = re.compile(r"LLM engine \(v(\d+\.\d+\.\d+[\w.+]*)")
_ARGS_RE = re.compile(r"non-default args: (\{.{0,4000}\})")
_DEVICE_RE = re.compile(r"\bdevice_config=(\w+)")
_ARGS_CHARS = 4000


def _literal_args(text: str) -> dict[str, object] | None:
    """The dict vLLM printed with "non-default args:", read as literals (never evaluated as code)."""
    import ast

    m = _ARGS_RE.search(text[: _ARGS_CHARS + 200])
    if m is None:
        return None
    try:
        value = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


_READY_RE = re.compile(r"Application startup complete|Uvicorn running on")
_SHUTDOWN_RE = re.compile(r"\[shutdown\]|Shutting down|Received signal|received signal")
_CAPTURE_START_RE = re.compile(r"Capturing (?:CUDA|cuda|the model for CUDA)")
_BLOCK_SIZE_RE = re.compile(r"block_size=(\d+)")  # a literal first: searched fast (word start checked)

# ----------------------------------------------------------------------------------------------
# Failure message families

_P_FP8 = 100
_P_FREE = 95
_P_FREE_PROFILE = 92
_P_KV = 90
_P_NO_KV = 88
_P_PORT = 85
_P_MODEL = 80
_P_OOM = 70
_P_CONFIG = 60
_P_CUDA = 55
_P_CONFIG_WEAK = 45
_P_UNKNOWN_VALUE = 40
_P_NATIVE = 30  # a native crash (segfault, abort): decided after the unexplained exceptions, by line order
_P_HOST = 20
_P_DEAD = 10

_OOM = "oom"  # class decided later from the phase
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
    (_OOM_FIXED_PROFILE, _P_OOM, PHASE_PROFILE, re.compile(r"out of memory occurred when warming up")),
    (
        _OOM_FIXED_WEIGHTS,
        _P_OOM,
        PHASE_LOAD_WEIGHTS,
        re.compile(r"Failed to load model - not enough GPU memory"),
    ),
    (
        _OOM,
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
            r"OutOfResources|out of resource: shared memory"
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
        _P_NATIVE,
        None,
        re.compile(
            r"Segmentation fault|Aborted \(core dumped\)|Bus error \(core dumped\)|SIGSEGV|SIGABRT|"
            r"SIGBUS|Fatal Python error: (?:Segmentation fault|Aborted|Bus error)|Segfault encountered|"
            r"terminate called after throwing an instance of"
        ),
    ),
    (
        HOST_OOM,
        _P_HOST,
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
        ENGINE_DEAD,
        _P_DEAD,
        None,
        re.compile(
            r"EngineDeadError|Engine core initialization failed|Engine process failed to start|"
            r"EngineCore failed to start|Got fatal signal from worker processes|"
            r"Background loop has errored already|"
            r"Engine loop has died|died unexpectedly|EngineCore encountered a fatal error|"
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
_GATE_WORDS = (
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
    # weak configuration
    "unsupported", "not supported", "notimplemented", "not implemented", "only supports",
    # host memory
    "killed", "oom-kill", "oomkilled", "memoryerror", "cannot allocate memory", "bad_alloc",
    "defaultcpuallocator", "exit code", "exitcode", "exited with code", "exit status",
    # engine death
    "enginedead", "asyncenginedead", "mqenginedead", "engine core initialization", "engine process failed",
    "enginecore failed", "fatal signal",
    "background loop", "engine loop", "died unexpectedly", "enginecore encountered", "engine core proc",
    "core dumped", "engine background task", "task finished unexpectedly",
)  # fmt: skip


def _word_start_trie(words: Iterable[str]) -> re.Pattern[str]:
    """A regex finding any of ``words`` at a word start of a lowercased line with a space put before it.

    A word start follows a character other than a lowercase letter or a digit (an underscore, a dot,
    a bracket count: "torch._scaled_mm", "cublas_status_alloc_failed"); a word that begins with such a
    character stands for that boundary. The pattern then begins with a character class, which lets
    the regex engine skip every position inside a word.
    """
    return re.compile(
        r"[^a-z0-9](?:" + _literal_trie(w[1:] if not w[0].isalnum() else w for w in words) + ")"
    )


_GATE_RE = _word_start_trie(_GATE_WORDS)


def _gate(text: str) -> bool:
    """Whether a family pattern could match ``text`` (cheap; a superset of ``_match_families``)."""
    return _GATE_RE.search(" " + text.lower()) is not None


# Deaths of an engine that was already running requests: what fails after them fails while serving.
_SERVING_DEATH_RE = re.compile(
    r"EngineCore encountered a fatal error|Engine background task failed|Task finished unexpectedly|"
    r"Background loop has errored already|Engine loop has died"
)
# Ray/v0 workers name the method that failed: "Error executing method determine_num_available_blocks".
_METHOD_RE = re.compile(r"Error executing method '?(\w+)")
# Per-request errors: the server stays up (an over-long prompt, an unknown model name in a request).
_BENIGN_RE = re.compile(
    r"maximum context length|is longer than the maximum model length|is too long to fit into the model|"
    r"[Pp]lease reduce the length of the|The model `[^`]{0,300}` does not exist|exceeds the max_model_len|"
    r"is too long and exceeds (?:the )?limit|Error in preprocessing prompt inputs|"
    r"Dumping (?:input data|scheduler)|out-of-memory error occurs|[Pp]rompt length of \d+ is longer"
)
_EXC_HEADER_RE = re.compile(
    r"(?:[A-Za-z_]\w*\.)*(?P<name>[A-Z]\w*(?:Error|Exception|Exit|Interrupt))(?=:|\(|\s*$)"
)
_NOT_A_CAUSE = frozenset(
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
_CONFIG_LIKE = frozenset({"ValueError", "TypeError", "ValidationError"})

# Traceback frames
_FRAME_RE = re.compile(
    # File "path", line 12, in func (the faulthandler's dump has no comma before "in")
    r'\s*File\s+(?:"(?P<file>[^"]*)", line \d+,?'
    # Jupyter: File [path:12](url), in Class.func(...)
    r"|\[?(?P<jfile>[^\],]{0,400}?)(?::\d+)?\]?(?:\([^)]{0,400}\))?,)"
    r" in (?P<func>[\w<>.]+)"
)
# A frame anywhere in a line: behind a launcher's own prefix, several pasted on one line, or pytest's
# and rich's "path.py:12: in func" / "path.py:12 in func"
_INLINE_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]{0,400})", line \d+,? in (?P<func>[\w<>.]+)'
    r"|(?P<pfile>[\w./~-]{1,400}\.pyx?):\d+:? in (?P<pfunc>[\w<>.]+)"
)
# A worker method named in the source line of an RPC ("collective_rpc("load_model")")
_RPC_RE = re.compile(r"(?:collective_rpc|_run_workers|execute_method|run_method)\(\s*['\"](\w+)")
_CUDA_GRAPH_WEAK = "cuda_graph_weak"  # warm-up that includes the capture (or a sampler warm-up)
_KV_CACHE_WEAK = "kv_cache_weak"  # KV set-up that includes sizing, allocation and warm-up
# The deepest step named in a traceback decides its phase; the weak ones only when nothing else does.
_PHASE_RANK = {
    PHASE_CUDA_GRAPH: 8,
    PHASE_PROFILE: 7,
    PHASE_KV_CACHE: 6,
    PHASE_LOAD_WEIGHTS: 5,
    _CUDA_GRAPH_WEAK: 4,
    _KV_CACHE_WEAK: 3,
    PHASE_SERVING: 1,
}
_WEAK_PHASE = {_CUDA_GRAPH_WEAK: PHASE_CUDA_GRAPH, _KV_CACHE_WEAK: PHASE_KV_CACHE}
# Step names of vLLM 0.4 to 0.33: V0 worker.py / model_runner.py / cache_engine.py / llm_engine.py,
# V1 gpu_worker.py / gpu_model_runner.py / core.py, model runner V2 (v1/worker/gpu/), and torch's graphs.py.
_FRAME_PHASE = {
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
}
_REQUEST_FRAMES = frozenset(
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
_CALL_RE = re.compile(r"(\w+)\(")
_HINT_RE = re.compile(
    r"logits|[Ss]ampler|sample\(|dummy|\bforward\b|compute_logits|model_executable|hidden_states"
)

# What else makes an unstamped line matter to the reader: an exception line (its name ends in Error,
# Exception, Exit or Interrupt), a traceback, a frame (behind any prefix), a process tag, a request
# handler, a worker method, a forward pass, a progress keyword. A line holding none of these nor a gate
# word changes nothing but, when it is long, the wrap candidate it opens. Gate and trigger words are
# searched at word starts of the lowercased line (after a character other than a letter or digit; a
# leading non-letter of a word stands for that boundary), which lets the search skip most positions.
_QUICK_HEADERS = ("Error", "Exception", "Exit", "Interrupt", "Traceback", "File")  # searched case-sensitively
# A progress bar as tqdm draws it ("desc:  50%|█████     | 34/67 [00:03<00:03, 10.9it/s]") or as vLLM's
# weight loading formats it ("desc:  50% Completed | 4/8 [00:03<00:03,  1.10it/s]"), alone on its line
_BAR_RE = re.compile(
    r"(?:[^%|]{1,200}:)?\s*\d{1,3}%(?:\|[^|]{0,200}\||\s+Completed \|)\s*[\d.]+[kMG]?/[\d.]+[kMG]?\s+"
    r"\[[^\]]{0,120}\]\s*$"
)
# torch's glog records at INFO/WARNING ("[W1129 18:43:13.213727611 utils.cpp:68] ...", "I0101 ...")
_GLOG_QUIET_RE = re.compile(r"(?:\[rank\d+\]:)?\[?[IW]\d{4} \d\d:\d\d:\d\d")
_QUICK_WORDS = (
    *_GATE_WORDS,
    "during handling", "the above exception", "py", "pid=", "serving", "executing method",
    "logits", "sampler", "sample(", "dummy", "forward", "model_executable", "hidden_states",
    # the progress keywords (_PROGRESS_KEYWORDS), each by one of its words
    "took", "memory", "kv cache", "concurrency", "blocks", "graph", "startup complete", "uvicorn running",
    "initializing", "max model len", "max_model_len", "shutting down", "shutdown", "vllm instance",
    "capturing", "received signal", "explicitly set", "init engine", "starting to load", "loading",
    "warming up", "starting vllm", "chunked prefill", "non-default args",
)  # fmt: skip
_QUICK_RE = _word_start_trie(_QUICK_WORDS)


_BORING_MEMO = 4096  # short unstamped lines whose test a reader remembers


def _boring_text(text: str) -> bool:
    """Whether an unstamped line holds none of the words that make it matter to the reader."""
    return not any(word in text for word in _QUICK_HEADERS) and _QUICK_RE.search(" " + text.lower()) is None


# Numbers carried by failure messages
_NUMC = r"\d+(?:,\d{3})*(?:\.\d+)?"
_N = f"({_NUMC})"
_RX_KV_V1 = re.compile(
    rf"max\s+seq\s+len\s+\({_N}\),?\s*\(\s*{_N}\s*GiB\s+KV\s*cache\s+is\s+needed,"
    rf"\s*which\s+is\s+larger\s+than\s+"
    rf"the\s+available\s+KV\s*cache\s+memory\s+\(\s*(-?{_NUMC})\s*GiB\)"
)
_RX_KV_EST = re.compile(rf"estimated\s+maximum\s+model\s+length\s+is\s+{_N}")
_RX_KV_V0 = re.compile(
    rf"max seq len \({_N}\) is larger than the maximum number of tokens that can be stored in KV cache "
    rf"\({_N}\)"
)
_RX_FREE = re.compile(
    rf"\({_N}/{_N}\s*GiB\)\s+on\s+startup\s+is\s+less\s+than\s+desired\s+(?:GPU|"
    rf"CPU)\s+memory\s+utilization\s+"
    rf"\({_N},\s*{_N}\s*GiB\)"
)
_RX_FREE_PROFILE = re.compile(rf"Initial free memory {_N} ?GiB, current free memory {_N} ?GiB")
_RX_TRIED = re.compile(rf"Tried to allocate {_N} ?([KMGT]i?B|bytes?)")
_RX_CAP24 = re.compile(
    rf"GPU (\d+) has a total capac(?:i)?ty of {_N} ?([KMGT]i?B) of which {_N} ?([KMGT]i?B|bytes) is free"
)
_RX_CAP20 = re.compile(
    rf"\(GPU (\d+); {_N} ?([KMGT]i?B) total capacity; {_N} ?([KMGT]i?B) already allocated; {_N} ?([KMGT]i?B) "
    rf"free"
)
_RX_INUSE = re.compile(rf"(?:this process|Process \d+) has {_N} ?([KMGT]i?B) memory in use")
_RX_SAMPLER = re.compile(r"warming up (?:sampler|pooler) with (\d+) dummy requests")
_RX_DERIVED = re.compile(
    rf"User-specified max_model_len \({_N}\) is greater than the derived max_model_len \((?:\w+=)?{_N}"
)
_RX_PORT = re.compile(  # uvicorn, docker, torch.distributed's TCPStore, ZMQ
    r"bind on address \(?'?[^',)]*'?,\s*(\d+)\)|Bind for \S*:(\d+) failed|\bport: (\d+), useIpv6|"
    r"\(addr='\w+://[^']*:(\d+)'\)"
)
_RX_CC = re.compile(r"(?:has compute capability|Current capability:) (\d+(?:\.\d+)?)")


def _failure_numbers(cls: str, text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if cls == KV_INSUFFICIENT:
        m = _RX_KV_V1.search(text)
        if m:
            out["max_model_len"] = _f(m.group(1))
            out["kv_needed_gib"] = _f(m.group(2))
            out["kv_available_gib"] = _f(m.group(3))
        m = _RX_KV_EST.search(text)
        if m:
            out["estimated_max_model_len"] = _f(m.group(1))
        m = _RX_KV_V0.search(text)
        if m:
            out["max_model_len"] = _f(m.group(1))
            out["kv_capacity_tokens"] = _f(m.group(2))
    elif cls == FREE_MEM_BELOW_UTIL:
        m = _RX_FREE.search(text)
        if m:
            out["free_gib"] = _f(m.group(1))
            out["total_gib"] = _f(m.group(2))
            out["gpu_memory_utilization"] = _f(m.group(3))
            out["requested_gib"] = _f(m.group(4))
        m = _RX_FREE_PROFILE.search(text)
        if m:
            out["initial_free_gib"] = _f(m.group(1))
            out["free_gib"] = _f(m.group(2))
    elif cls.startswith(_OOM):
        m = _RX_TRIED.search(text)
        if m:
            out["tried_to_allocate_mib"] = round(_unit_gib(_f(m.group(1)), m.group(2)) * 1024, 3)
        m = _RX_CAP24.search(text)
        if m:
            out["device_index"] = int(m.group(1))
            out["device_total_gib"] = round(_unit_gib(_f(m.group(2)), m.group(3)), 3)
            out["device_free_mib"] = round(_unit_gib(_f(m.group(4)), m.group(5)) * 1024, 3)
        m = _RX_CAP20.search(text)
        if m:
            out["device_index"] = int(m.group(1))
            out["device_total_gib"] = round(_unit_gib(_f(m.group(2)), m.group(3)), 3)
            out["device_allocated_gib"] = round(_unit_gib(_f(m.group(4)), m.group(5)), 3)
            out["device_free_mib"] = round(_unit_gib(_f(m.group(6)), m.group(7)) * 1024, 3)
        m = _RX_INUSE.search(text)
        if m:
            out["process_in_use_gib"] = round(_unit_gib(_f(m.group(1)), m.group(2)), 3)
        m = _RX_SAMPLER.search(text)
        if m:
            out["dummy_requests"] = _f(m.group(1))
    elif cls == CONFIG_ERROR:
        m = _RX_DERIVED.search(text)
        if m:
            out["max_model_len"] = _f(m.group(1))
            out["derived_max_model_len"] = _f(m.group(2))
        _capability(text, out)
    elif cls == PORT_IN_USE:
        m = _RX_PORT.search(text)
        if m:
            out["port"] = int(next(g for g in m.groups() if g is not None))
    elif cls == FP8_UNSUPPORTED:
        _capability(text, out)
    return out


def _capability(text: str, out: dict[str, float]) -> None:
    m = _RX_CC.search(text)
    if m:
        value = _f(m.group(1))
        out["compute_capability"] = value / 10 if value >= 10 else value  # "75" means 7.5


def _specificity(fam: tuple[str, int, str | None, dict[str, float]]) -> tuple[int, bool, int]:
    return fam[1], fam[2] is not None, len(fam[3])


def _match_families(text: str) -> tuple[str, int, str | None, dict[str, float]] | None:
    """The most specific family ``text`` belongs to: (class, priority, fixed phase, numbers)."""
    best: tuple[str, int, str | None] | None = None
    for cls, prio, phase, rx in _FAMILIES:
        if (best is None or prio > best[1]) and rx.search(text):
            best = (cls, prio, phase)
    if best is None:
        return None
    cls, prio, phase = best
    return cls, prio, phase, _failure_numbers(cls, text)


# ----------------------------------------------------------------------------------------------
# Reader state


@dataclass
class _Traceback:
    start_line: int
    phases: dict[str, int] = field(default_factory=dict)  # phase -> rank, from frames
    hint: bool = False  # the model was running a forward pass (sampler, logits, dummy run)
    request: bool = False  # a per-request handler (the server survives these)
    last_frame: str = ""
    process: str | None = None
    pid: int | None = None


@dataclass
class _Finding:
    cls: str  # a class, an OOM marker (phase decides), or an exception name for unexplained ones
    prio: int
    fixed_phase: str | None
    text: str
    numbers: dict[str, float]
    line_no: int
    process: str | None
    pid: int | None
    frame_phase: str | None
    hint: bool
    request: bool
    after_ready: bool
    after_shutdown: bool
    stage: int  # progress milestone reached when it was seen (_STAGE_*)
    header: bool  # the line was the exception line itself (preferred as evidence)


@dataclass
class _Pending:
    """An exception message that may continue on the next lines (multi-line or hard-wrapped)."""

    finding: _Finding | None
    text_space: str
    text_tight: str
    lines: int
    opened_at: int
    tb: _Traceback | None = None  # the traceback the exception line ended
    indent: int = 0  # indentation of the exception line; deeper lines are source, not message
    wrapped: bool = False  # continued by hard-wrapped pieces: join them without spaces
    # a long line that is neither an exception nor a known cause: only the very next line can
    # continue it (a terminal's wrap), until a cause shows in the joined text
    speculative: bool = False
    last_line: int = 0  # the line that last joined it


@dataclass
class _Proc:
    tb: _Traceback | None = None
    pending: _Pending | None = None
    method_phase: str | None = None  # from "Error executing method X", for the traceback that follows
    warning_line: int = -1  # the line of its last Python warning (the warning's source line follows it)


_NO_PROCESS: tuple[str | None, int | None] = (None, None)  # the key of lines without a process tag
_NO_PROCESS_LINE = LogLine(text="")

_REQUESTED_STOP_EXITS = frozenset({0, -15, 143, -2, 130})


def _rank(finding: _Finding) -> tuple[int, bool, int]:
    """Priority, then the more specific message of a class (a fixed phase), then the earliest."""
    return finding.prio, finding.fixed_phase is not None, -finding.line_no


def _best_key(phases: Mapping[str, int]) -> str | None:
    """The highest-ranked phase key (weak keys included)."""
    if not phases:
        return None
    return max(phases.items(), key=lambda kv: kv[1])[0]


def _best_phase(phases: Mapping[str, int]) -> str | None:
    key = _best_key(phases)
    return None if key is None else _WEAK_PHASE.get(key, key)


# Python's warnings module: "path.py:12: DeprecationWarning: ..." (never a failure)
_PYWARN_RE = re.compile(r"\S+:\d+: [A-Z]\w*Warning: ")


def _phase_rank(key: str | None) -> int:
    return 0 if key is None else _PHASE_RANK[key]


def _phase_from_stage(stage: int) -> str:
    if stage >= _STAGE_CAPTURED:
        return PHASE_PROFILE  # the sampler warm-up follows graph capture
    if stage == _STAGE_CAPTURE:
        return PHASE_CUDA_GRAPH
    if stage == _STAGE_KV:
        return PHASE_KV_CACHE
    if stage == _STAGE_WEIGHTS:
        return PHASE_PROFILE
    return PHASE_STARTUP


_OOM_BY_PHASE = {
    PHASE_LOAD_WEIGHTS: OOM_WEIGHTS,
    PHASE_PROFILE: OOM_PROFILE,
    PHASE_KV_CACHE: OOM_KV_ALLOC,
    PHASE_CUDA_GRAPH: OOM_CUDAGRAPH,
    PHASE_SERVING: OOM_RUNTIME,
}


class LogReader:
    """Streaming reader of vLLM output (stdout and stderr merged): relay lines, progress, verdict.

    State is bounded whatever the input: one finding per class, the first unexplained exception,
    per-process traceback frames (at most ``MAX_PROCESSES`` processes) and the numbers seen.
    """

    def __init__(self, max_line_chars: int = DEFAULT_MAX_LINE_CHARS) -> None:
        if max_line_chars < 256:
            raise ValueError("max_line_chars must be at least 256")
        self._max = max_line_chars
        self._line_no = 0
        self._procs: dict[tuple[str | None, int | None], _Proc] = {}
        self._pending_count = 0  # open messages, speculative ones included
        self._spec_count = 0  # of which speculative
        self._spec_line = 0  # the last line a speculative message was opened or continued on
        self._findings: dict[str, _Finding] = {}
        self._unknown: _Finding | None = None
        self._all_phases: dict[str, int] = {}
        self._obs: dict[str, float] = {}
        self._ready_text: str | None = None
        self._ready_line: int | None = None
        self._marked_ready_line: int | None = None
        self._shutdown_line: int | None = None
        self._stage = _STAGE_NONE
        self._recognised = False  # a line was recognised as vLLM's (a level stamp, a process tag)
        self._blocks_line: int | None = None  # where v0 printed "# GPU blocks"
        self._block_size = BLOCK_SIZE
        self._cudagraph_estimate_logged = False  # vLLM printed its estimate itself (CUDA graph pool memory)
        self._engine_version: str | None = None  # "Initializing a V1 LLM engine (v0.19.0)"
        self._engine_args: dict[str, object] | None = None  # "non-default args: {...}"
        self._engine_device: str | None = None  # "device_config=cpu" of the engine's config line
        self._last_pending: tuple[_Proc, int, int] | None = None  # (process, line, its width)
        self._serving_death_line: int | None = None
        self._boring: dict[str, bool] = {}  # short unstamped lines read: whether _boring_text holds
        # a hard-wrapped "File ..." line: (process, line, text so far, wrap width)
        self._partial_frame: tuple[_Proc, int, str, int] | None = None

    # -- public API ---------------------------------------------------------------------------

    def feed(self, raw_line: str) -> list[LogLine | Progress]:
        """Read one raw line (it may hold carriage returns); return its relay line and any progress."""
        self._line_no += 1
        if len(raw_line) > self._max:
            raw_line = raw_line[: self._max]
        events: list[LogLine | Progress] = []
        last = LogLine(text="")
        for seg in _segments(raw_line):
            last = parse_line(seg)
            self._handle(seg, last, events)
        events.insert(0, last)
        return events

    def feed_lines(self, raw_lines: Iterable[str]) -> None:
        """Read many lines without building relay values (``diagnose`` and replays use this).

        The state changes are those of :meth:`feed` on each line.
        """
        batch: list[str] = []
        for raw in raw_lines:
            if "\r" in raw or "\x1b" in raw or "\x00" in raw or raw.endswith("\n") or len(raw) > self._max:
                if batch:
                    self._feed_plain(batch)
                    batch = []
                self._line_no += 1
                for seg in _segments(raw[: self._max]):
                    self._handle(seg, None, None)
                continue
            batch.append(raw)
            if len(batch) >= _BATCH_LINES:
                self._feed_plain(batch)
                batch = []
        if batch:
            self._feed_plain(batch)

    def feed_chunks(self, chunks: Iterable[bytes]) -> None:
        """Read a byte stream in chunks (invalid UTF-8 replaced), as :meth:`feed_lines` reads its lines."""
        for lines, plain in _line_batches(chunks, self._max):
            if plain:
                self._feed_plain(lines)
            else:
                self.feed_lines(lines)

    def _feed_plain(self, raw_lines: list[str]) -> None:
        """:meth:`feed_lines` of lines without a carriage return, an escape, a NUL or a newline, none
        longer than the line limit.

        The loop reads the commonest lines itself, as ``_handle`` would: a quiet (INFO/DEBUG/WARNING)
        vLLM line that no progress pattern matches changes nothing; a Python warning, the source line
        printed under it and a short unstamped line holding no word the reader looks for change only the
        entry of unprefixed lines (the tests in ``_handle``, repeated here to spare a call per line).
        """
        stamp = _STAMP_RE.search
        window = _STAMP_WINDOW
        quiet_last = _QUIET_LAST
        kw_group = _KW_GROUP
        quiet_initials = _QUIET_INITIALS
        progress = self._progress
        pywarn = _PYWARN_RE.match
        seen = self._boring.get
        procs = self._procs
        handle = self._handle
        first = self._line_no + 1
        n = first - 1
        read = 0  # lines not skipped as quiet
        for n, raw in enumerate(raw_lines, first):
            m = stamp(raw, 0, window)
            if m is not None:
                last = m.lastindex
                if last <= quiet_last:  # type: ignore[operator]
                    if len(raw) <= COLLAPSED_LONG:
                        continue
                elif last == kw_group and raw[m.start()] in quiet_initials and len(raw) <= COLLAPSED_LONG:
                    self._line_no = n
                    self._recognised = True
                    progress(_message(raw, m.start(last)), None, m.group(last))
                    continue
            elif "Warning: " in raw and pywarn(raw) is not None:
                read += 1
                np = procs.get(_NO_PROCESS)
                if np is None:
                    np = self._proc(_NO_PROCESS_LINE)
                np.warning_line = n
                continue
            elif raw[:2] == "  " and (np := procs.get(_NO_PROCESS)) is not None and np.warning_line == n - 1:
                if raw[2:3].strip():  # the source line Python prints under a warning
                    read += 1
                    continue
            elif (
                len(raw) < WRAP_MIN_WIDTH
                and self._pending_count == self._spec_count
                and self._spec_line != n - 1
                and self._partial_frame is None
                and ((boring := seen(raw)) or (boring is None and self._learn_boring(raw)))
                and ((np := procs.get(_NO_PROCESS)) is None or np.tb is None)
            ):
                read += 1
                if np is None:
                    self._proc(_NO_PROCESS_LINE)
                elif np.pending is not None:
                    self._drop_pending(np)
                continue
            read += 1
            self._line_no = n
            handle(raw, None, None, m)
        self._line_no = n
        if n - first + 1 > read:
            self._recognised = True  # a line was skipped as a quiet vLLM line

    def mark_ready(self) -> None:
        """The supervisor saw readiness (health 200 and the model listed): later failures are serving."""
        if self._marked_ready_line is None:
            self._marked_ready_line = self._line_no
            self._forget_survived()

    def _forget_survived(self) -> None:
        """vLLM became ready: what it logged before did not stop it, and frees the slot of its class."""
        self._findings = {cls: f for cls, f in self._findings.items() if f.line_no >= self._line_no}
        if self._unknown is not None and self._unknown.line_no < self._line_no:
            self._unknown = None

    @property
    def ready_seen(self) -> bool:
        """vLLM printed ``Application startup complete.`` (or uvicorn's running line)."""
        return self._ready_line is not None

    @property
    def observations(self) -> dict[str, float]:
        """Success-path numbers gathered so far (weights_gib, kv_cache_gib, kv_cache_tokens, ...)."""
        return dict(self._obs)

    @property
    def engine_version(self) -> str | None:
        """The vLLM version the log printed ("Initializing a V1 LLM engine (v0.19.0)")."""
        return self._engine_version

    @property
    def engine_device(self) -> str | None:
        """``cuda`` or ``cpu`` as the engine's config line printed it (None: not seen)."""
        return self._engine_device

    @property
    def engine_args(self) -> dict[str, object]:
        """The arguments vLLM printed as "non-default args: {...}" (plain literals only; {} if none)."""
        return dict(self._engine_args or {})

    def verdict(self, exit_code: int | None = None) -> Failure:
        """The failure class (or ``none``), phase, evidence and numbers. Callable mid-stream."""
        return self._decide(exit_code)[0]

    def diagnose(self, exit_code: int | None = None) -> Diagnosis:
        """The verdict with the line of its evidence and whether the input was vLLM output at all."""
        failure, line = self._decide(exit_code)
        return Diagnosis(
            failure=failure,
            line=line,
            vllm_log=self._recognised or failure.cls != NONE,
            lines=self._line_no,
        )

    def _decide(self, exit_code: int | None) -> tuple[Failure, int | None]:
        """The verdict and the 1-based input line of its evidence (None when no line carries it)."""
        specific = self._best(lambda f: f.prio > _P_NATIVE)
        if specific is not None:
            return self._build(specific, specific.cls), specific.line_no
        host = self._best(lambda f: f.cls == HOST_OOM)
        if host is not None:
            return self._build(host, HOST_OOM), host.line_no
        if exit_code in (-9, 137):
            return self._bare(
                HOST_OOM,
                f"exit status {exit_code} (SIGKILL) and no other cause in the log",
                "killed by SIGKILL: on Linux usually the kernel's OOM killer (host RAM)",
            ), None
        native = self._best(lambda f: f.prio == _P_NATIVE and not f.after_shutdown)
        dead = self._best(lambda f: f.cls == ENGINE_DEAD and not f.after_shutdown)
        unknown = self._unknown
        if unknown is not None and self._ready_before(unknown.line_no) is not None:
            unknown = None  # vLLM became ready after it: it was not fatal
        cut = self._cut_traceback()
        requested_stop = self._shutdown_line is not None and exit_code in _REQUESTED_STOP_EXITS
        nonzero = exit_code is not None and exit_code != 0 and not requested_stop
        startup_unknown = unknown is not None and not unknown.after_ready and not self._is_ready()
        if native is None and dead is None and not nonzero and not startup_unknown and cut is None:
            failure = Failure(
                NONE,
                phase=PHASE_SERVING if self._is_ready() else PHASE_STARTUP,
                evidence=self._ready_text or "",
                numbers=self.observations,
            )
            return failure, self._ready_line if self._ready_text else None
        inferred = self._infer_v0_kv()
        if inferred is not None:
            return inferred, self._blocks_line
        if native is not None and (unknown is None or native.line_no < unknown.line_no):
            return self._build(native, CUDA_ERROR), native.line_no  # the earliest unexplained event
        if unknown is not None:
            if unknown.cls in _CONFIG_LIKE and not unknown.after_ready:
                return self._build(unknown, CONFIG_ERROR), unknown.line_no
            return self._build(unknown, ENGINE_DEAD), unknown.line_no
        if dead is not None:
            return self._build(dead, ENGINE_DEAD), dead.line_no
        if cut is not None:
            phase = _best_phase(cut.phases) or _best_phase(self._all_phases) or _phase_from_stage(self._stage)
            where = (cut.process or "main") + (f" pid {cut.pid}" if cut.pid is not None else "")
            failure = Failure(
                ENGINE_DEAD,
                phase=phase,
                evidence=f"the log ends inside a traceback; last frame: {cut.last_frame}",
                numbers=self.observations,
                detail=f"{where}, traceback from line {cut.start_line}",
            )
            return failure, cut.start_line
        return self._bare(ENGINE_DEAD, f"exit status {exit_code} and no cause in the log", ""), None

    def _cut_traceback(self) -> _Traceback | None:
        """A start-up traceback that never reached its exception line (a cut or truncated log)."""
        if self._is_ready() or self._shutdown_line is not None:
            return None
        cut: _Traceback | None = None
        for proc in self._procs.values():
            tb = proc.tb
            if tb is None or tb.request or not tb.last_frame:
                continue
            if cut is None or tb.start_line < cut.start_line:
                cut = tb
        return cut

    # -- line handling ------------------------------------------------------------------------

    def _is_ready(self) -> bool:
        return self._ready_line is not None or self._marked_ready_line is not None

    def _ready_before(self, line_no: int) -> int | None:
        """The line where readiness was reached after ``line_no`` (None when it was not)."""
        for ready in (self._ready_line, self._marked_ready_line):
            if ready is not None and ready > line_no:
                return ready
        return None

    def _handle(
        self,
        seg: str,
        line: LogLine | None,
        events: list[LogLine | Progress] | None,
        stamp: re.Match[str] | None | bool = False,
    ) -> None:
        """One line (a segment of one) with its stamp search, when the caller already made it."""
        m = _STAMP_RE.search(seg, 0, _STAMP_WINDOW) if stamp is False else stamp
        kind, kw = _kind_of(m if isinstance(m, re.Match) else None)
        if kind != _UNSTAMPED:
            self._recognised = True
            if kind != _STAMPED and (
                len(seg) <= COLLAPSED_LONG
                or (
                    ("ERROR" not in seg and "Traceback" not in seg) or _COLLAPSED_ALERT_RE.search(seg) is None
                )
            ):  # a long quiet line may hold more records pasted onto it: an error after the quiet first
                if kw is not None:
                    assert isinstance(m, re.Match)
                    self._progress(_message(seg, m.start("kw")), events, kw)
                return
        elif "Warning: " in seg and _PYWARN_RE.match(seg) is not None:
            # a Python warning: never the failure, whatever words it holds (the entry of unprefixed
            # lines made as the full path makes it)
            warned = self._procs.get(_NO_PROCESS) or self._proc(_NO_PROCESS_LINE)
            warned.warning_line = self._line_no
            return
        elif (
            seg[:2] == "  "
            and seg[2:3].strip()
            and (unprefixed := self._procs.get(_NO_PROCESS)) is not None
            and unprefixed.warning_line == self._line_no - 1
        ):
            return  # the source line Python prints under a warning, indented by two spaces: the warning's
        elif " NCCL INFO " in seg or (seg[:1] in "[IW" and _GLOG_QUIET_RE.match(seg) is not None):
            return  # torch's own INFO/WARNING records and NCCL's: as quiet as vLLM's
        elif "%" in seg and len(seg) <= COLLAPSED_LONG and _BAR_RE.match(seg) is not None:
            self._bar(seg, events)
            return
        elif (
            self._pending_count == self._spec_count
            and self._spec_line != self._line_no - 1
            and self._partial_frame is None
            and ((np := self._procs.get(_NO_PROCESS)) is None or np.tb is None)
            and _boring_text(seg)
        ):
            # nothing the reader looks for, and no open message or traceback the line could continue:
            # it changes only what the full path would (see _boring_line)
            self._boring_line(seg, line, np)
            return
        if line is None:
            if kind == _STAMPED:
                assert isinstance(m, re.Match)
                line = _fast_line(seg, m.start())
            if line is None:
                line = parse_line(seg)
        if line.process is not None:
            self._recognised = True
        text = line.text
        stripped = text.lstrip()
        if line.level is None:
            pm = _RAW_PROGRESS_RE.match(text)
            if pm is not None:  # progress bars and v0's multi-line summaries come unstamped
                self._progress(text, events, pm.group("kw"))
        proc = self._proc(line)
        if "Warning: " in stripped and _PYWARN_RE.match(stripped) is not None:
            proc.warning_line = self._line_no
            return  # a Python warning: never the failure, whatever words it holds
        if proc.warning_line == self._line_no - 1 and text[:2] == "  " and text[2:3].strip():
            return  # the warning's source line
        if self._pending_count:
            self._expire_pending()
        if self._partial_frame is not None and self._wrapped_frame(proc, stripped, line, len(seg)):
            return
        if self._continued(proc, stripped, line, len(seg)):
            return
        if not stripped:
            return
        first = stripped[0]
        collapsed = False  # a whole traceback on one line (pasted with its newlines turned to spaces)
        if first == "F" and stripped.startswith("File"):
            fm = _FRAME_RE.match(stripped)
            if fm is not None:
                self._frame(proc, fm.group("func"), fm.group("file") or "", stripped, line)
                if len(stripped) - fm.end() <= COLLAPSED_TAIL:
                    return
                collapsed = True
            elif len(seg) >= WRAP_MIN_WIDTH:
                self._partial_frame = (proc, self._line_no, stripped[:JOIN_CHARS], len(seg))
                return
        elif ('File "' in stripped or ".py:" in stripped) and (
            fm := _INLINE_FRAME_RE.search(stripped)
        ) is not None:
            # a frame behind another prefix, or pytest's and rich's form: the rest of the line tells
            # whether it is only a frame or records pasted together
            self._frame(
                proc,
                fm.group("func") or fm.group("pfunc"),
                fm.group("file") or fm.group("pfile"),
                stripped,
                line,
            )
            if len(stripped) - fm.end() <= COLLAPSED_TAIL:
                return
            collapsed = True
        elif first == "T" and stripped.startswith(("Traceback", "The above exception")):
            if stripped[1] == "r":
                fresh = _Traceback(
                    self._line_no, last_frame=stripped[:300], process=line.process, pid=line.pid
                )
                if proc.method_phase is not None:
                    fresh.phases[proc.method_phase] = _PHASE_RANK[proc.method_phase]
                    proc.method_phase = None
                proc.tb = fresh
            if len(stripped) <= COLLAPSED_TAIL + 35:
                return
            collapsed = True
        if collapsed or len(stripped) > COLLAPSED_LONG:
            self._inline_frames(proc, stripped, line)
        elif first == "D" and stripped.startswith("During handling of the above"):
            return
        header = _EXC_HEADER_RE.match(stripped) if first.isalpha() else None
        if (
            header is None
            and not collapsed
            and len(text) - len(stripped) >= 4
            and len(stripped) <= COLLAPSED_LONG
            and not stripped.startswith(("raise ", "assert "))
        ):
            # a source line of a traceback: it may show a forward pass or the call of the next frame
            if proc.tb is not None:
                self._source_line(proc.tb, text)
            elif text.startswith("    ") and _HINT_RE.search(text) is not None:
                proc.tb = _Traceback(
                    self._line_no, hint=True, process=line.process, pid=line.pid
                )  # header cut off
            return
        gate = _gate(text)
        if (gate or header is not None) and _BENIGN_RE.search(text) is not None:
            if proc.tb is not None:
                proc.tb.request = True  # a per-request error: the server stays up
            return
        if "[serving" in seg[:400]:  # logged by an OpenAI request handler (serving_chat.py ...)
            if proc.tb is None:
                proc.tb = _Traceback(self._line_no, request=True, process=line.process, pid=line.pid)
            else:
                proc.tb.request = True
        fam = _match_families(text) if gate else None
        if fam is None and header is None:
            if "executing method" in text:
                mm = _METHOD_RE.search(text)
                phase = _FRAME_PHASE.get(mm.group(1)) if mm is not None else None
                if phase is not None:
                    proc.method_phase = phase
                    self._all_phases[phase] = _PHASE_RANK[phase]
            if len(seg) >= WRAP_MIN_WIDTH:
                # a long message line: a terminal may have wrapped it, the next piece completes it
                self._open_pending(proc, None, stripped, None, 0, len(seg), speculative=True)
            return
        if (
            fam is not None
            and fam[0] == ENGINE_DEAD
            and self._serving_death_line is None
            and _SERVING_DEATH_RE.search(text) is not None
        ):
            self._serving_death_line = self._line_no
        tb = proc.tb
        finding: _Finding | None = None
        if fam is not None:
            cls, prio, fixed, numbers = fam
            finding = self._new_finding(cls, prio, fixed, stripped, numbers, line, tb, header is not None)
            self._record(finding)
        elif header is not None:
            name = header.group("name")
            if name == "KeyboardInterrupt" and self._shutdown_line is None:
                self._shutdown_line = self._line_no  # stopped from the terminal
            if (
                self._unknown is None
                and name not in _NOT_A_CAUSE
                and not (tb is not None and tb.request)
                and self._shutdown_line is None
            ):
                self._unknown = self._new_finding(name, 0, None, stripped, {}, line, tb, True)
        if header is not None:
            proc.tb = None  # the exception line ends its traceback
        self._open_pending(proc, finding, stripped, tb, len(text) - len(stripped), len(seg))

    def _learn_boring(self, text: str) -> bool:
        """:func:`_boring_text`, remembered by the text: tools print the same raw lines over and over (once
        per process, rank or restart), and the test costs several times a search for the stamp. At most
        ``_BORING_MEMO`` texts are kept."""
        boring = _boring_text(text)
        if len(self._boring) >= _BORING_MEMO:
            self._boring.clear()
        self._boring[text] = boring
        return boring

    def _bar(self, seg: str, events: list[LogLine | Progress] | None) -> None:
        """A progress bar: a milestone when its description names one. No message goes on in a bar (a
        terminal does not wrap into one) and none starts in it: the open one of its process ends."""
        pm = _RAW_PROGRESS_RE.match(seg)
        if pm is not None:  # the bar alone on its line
            proc = self._procs.get(_NO_PROCESS) or self._proc(_NO_PROCESS_LINE)
            text = _message(seg, 0)
        else:  # behind a process tag or another wrapper
            line = parse_line(seg)
            if line.process is not None:
                self._recognised = True
            proc = self._proc(line)
            text = line.text
            pm = _RAW_PROGRESS_RE.match(text)
        if self._pending_count:
            self._expire_pending()
        self._partial_frame = None
        self._drop_pending(proc)
        if pm is not None:
            self._progress(text, events, pm.group("kw"))

    def _boring_line(self, seg: str, line: LogLine | None, proc: _Proc | None) -> None:
        """What the full path does with an unprefixed line holding no word the reader looks for.

        It makes the entry of unprefixed lines and ends their stale speculative message; a long one
        (not a source line) opens the speculative message a terminal's wrap may continue.
        """
        if len(seg) < WRAP_MIN_WIDTH:
            if proc is None:
                self._proc(_NO_PROCESS_LINE)
            elif proc.pending is not None:
                self._drop_pending(proc)
            return
        if line is None:
            line = parse_line(seg)
        text = line.text
        stripped = text.lstrip()
        proc = self._proc(line)
        if "Warning: " in stripped and _PYWARN_RE.match(stripped) is not None:
            proc.warning_line = self._line_no
            return
        if proc.pending is not None:
            self._drop_pending(proc)
        if not stripped:
            return
        if (
            len(text) - len(stripped) >= 4
            and len(stripped) <= COLLAPSED_LONG
            and not stripped.startswith(("raise ", "assert "))
        ):
            if text.startswith("    ") and _HINT_RE.search(text) is not None:
                proc.tb = _Traceback(self._line_no, hint=True, process=line.process, pid=line.pid)
            return
        self._open_pending(proc, None, stripped, None, 0, len(seg), speculative=True)

    def _open_pending(
        self,
        proc: _Proc,
        finding: _Finding | None,
        stripped: str,
        tb: _Traceback | None,
        indent: int,
        width: int,
        speculative: bool = False,
    ) -> None:
        if proc.pending is not None:
            self._drop_pending(proc)
        self._pending_count += 1
        proc.pending = _Pending(
            finding,
            stripped,
            stripped,
            0,
            self._line_no,
            tb,
            indent,
            speculative=speculative,
            last_line=self._line_no,
        )
        if speculative:
            self._spec_count += 1
            self._spec_line = self._line_no
        self._last_pending = (proc, self._line_no, width)

    def _drop_pending(self, proc: _Proc) -> None:
        pending = proc.pending
        if pending is None:
            return
        proc.pending = None
        self._pending_count -= 1
        if pending.speculative:
            self._spec_count -= 1

    def _inline_frames(self, proc: _Proc, stripped: str, line: LogLine) -> None:
        """Frames inside one long line (a collapsed paste) still tell the phase."""
        if 'File "' not in stripped and ".py:" not in stripped:
            return
        for fm in _INLINE_FRAME_RE.finditer(stripped):
            if proc.tb is None:
                proc.tb = _Traceback(self._line_no, process=line.process, pid=line.pid)
            self._frame(
                proc,
                fm.group("func") or fm.group("pfunc"),
                fm.group("file") or fm.group("pfile"),
                fm.group(0),
                line,
            )

    def _wrapped_frame(self, proc: _Proc, stripped: str, line: LogLine, width: int) -> bool:
        """Rejoin a frame line that a terminal hard-wrapped; True when this line was a piece of it."""
        assert self._partial_frame is not None
        owner, at, head, wrap_width = self._partial_frame
        self._partial_frame = None
        if at != self._line_no - 1 or not (line.process is None or owner is proc) or not stripped:
            return False
        joined = head + stripped
        if width == wrap_width and line.process is None and line.level is None and len(joined) < JOIN_CHARS:
            self._partial_frame = (owner, self._line_no, joined, wrap_width)  # full width: the line goes on
            return True
        fm = _FRAME_RE.match(joined)
        if fm is None:
            return False
        self._frame(owner, fm.group("func"), fm.group("file") or "", joined, line)
        return True

    def _continued(self, proc: _Proc, stripped: str, line: LogLine, width: int) -> bool:
        """Join the line to an open exception message when it continues one (multi-line or wrapped)."""
        if line.process is None and line.level is None and self._last_pending is not None:
            # a hard-wrapped piece of the previous (full-width) line carries no prefix: it continues it
            owner, at, prev_width = self._last_pending
            if (
                at == self._line_no - 1
                and prev_width >= WRAP_MIN_WIDTH
                and owner.pending is not None
                and self._continues(line.text, stripped, owner.pending, wrapped=True)
            ):
                owner.pending.wrapped = True
                self._extend(owner.pending, stripped, line)
                self._last_pending = (owner, self._line_no, width)
                return True
        pending = proc.pending
        if pending is None:
            return False
        if (not pending.speculative or pending.last_line == self._line_no - 1) and self._continues(
            line.text, stripped, pending
        ):
            self._extend(pending, stripped, line)
            self._last_pending = (proc, self._line_no, width)
            return True
        self._drop_pending(proc)
        return False

    def _proc(self, line: LogLine) -> _Proc:
        key = (line.process, line.pid)
        proc = self._procs.get(key)
        if proc is None:
            if len(self._procs) >= MAX_PROCESSES:
                self._drop_pending(self._procs.pop(next(iter(self._procs))))
            proc = self._procs[key] = _Proc()
        return proc

    def _frame(self, proc: _Proc, func: str, file: str, stripped: str, line: LogLine) -> None:
        if proc.tb is None:
            proc.tb = _Traceback(self._line_no, process=line.process, pid=line.pid)  # header cut off
        tb = proc.tb
        tb.last_frame = stripped[:300]
        name = func.rsplit(".", 1)[-1]
        phase = _FRAME_PHASE.get(name)
        if phase is None:
            if "CacheEngine" in func or (name == "__init__" and file.endswith("cache_engine.py")):
                phase = PHASE_KV_CACHE  # v0 allocates the KV cache in CacheEngine's constructor
            elif file.endswith("cuda/graphs.py"):
                phase = PHASE_CUDA_GRAPH  # torch.cuda.graph: only a capture goes through it
        if phase is not None:
            rank = _PHASE_RANK[phase]
            tb.phases[phase] = rank
            self._all_phases[phase] = rank
        if name in _REQUEST_FRAMES:
            tb.request = True
            tb.phases.setdefault(PHASE_SERVING, _PHASE_RANK[PHASE_SERVING])
        if not tb.hint and _HINT_RE.search(stripped) is not None:
            tb.hint = True

    def _source_line(self, tb: _Traceback, text: str) -> None:
        """A source line under a frame: the call it makes tells the phase when the next frame is cut."""
        if not tb.hint and _HINT_RE.search(text) is not None:
            tb.hint = True
        if "(" not in text:
            return
        names = _CALL_RE.findall(text)
        if "rpc" in text or "_run_workers" in text or "execute_method" in text or "run_method" in text:
            names += _RPC_RE.findall(text)  # the worker method an RPC runs
        if "cuda.graph(" in text:
            names.append("capture")  # "with torch.cuda.graph(...)": a capture
        for name in names:
            phase = _FRAME_PHASE.get(name)
            if phase is not None:
                rank = _PHASE_RANK[phase]
                tb.phases[phase] = rank
                self._all_phases[phase] = rank

    @staticmethod
    def _continues(text: str, stripped: str, pending: _Pending, wrapped: bool = False) -> bool:
        if not stripped or pending.lines >= JOIN_LINES or len(pending.text_space) >= JOIN_CHARS:
            return False
        if len(text) - len(stripped) > pending.indent + 2:
            return False  # a source line of the next traceback, not more of the message
        if stripped.startswith(("File ", "Traceback", "The above exception", "During handling", "Process ")):
            return False
        if not wrapped and _EXC_HEADER_RE.match(stripped) is not None:
            return False  # a new exception (a wrapped piece may look like one: "rs.CompilationError: ...")
        if not _gate(stripped):
            return True
        # a line that names a cause of another class by itself ("Killed") starts something new,
        # unless it only completes the message ("...type fp8" + "e4nv not supported ...")
        alone = _match_families(stripped)
        if alone is None or (pending.finding is not None and alone[0] == pending.finding.cls):
            return True
        joined = _match_families(pending.text_tight + stripped)
        if joined is None:
            return False
        if pending.finding is None:
            # a wrap candidate: it continues only when it completes the cause (the line names it alone)
            return _specificity(joined) > _specificity(alone)
        return _specificity(joined) > _specificity(alone) or (
            joined[0] == alone[0] and _specificity(joined) >= _specificity(alone)
        )

    def _extend(self, pending: _Pending, stripped: str, line: LogLine) -> None:
        pending.lines += 1
        pending.last_line = self._line_no
        if pending.speculative:
            self._spec_line = self._line_no
        pending.text_space = f"{pending.text_space} {stripped}"[:JOIN_CHARS]
        pending.text_tight = f"{pending.text_tight}{stripped}"[:JOIN_CHARS]
        old = pending.finding
        tail = len(stripped) + 41
        if old is None and not (_gate(pending.text_space[-tail:]) or _gate(pending.text_tight[-tail:])):
            return  # (both joins: a word split by the wrap, or two words a trailing space kept apart)
        fam = _match_families(pending.text_space)
        joined = pending.text_space
        tight = _match_families(pending.text_tight)
        if tight is not None and (
            fam is None
            or _specificity(tight) > _specificity(fam)
            or (pending.wrapped and _specificity(tight) == _specificity(fam))
        ):
            fam, joined = tight, pending.text_tight
        if fam is None:
            return
        cls, prio, fixed, numbers = fam
        if old is not None and _specificity(fam) <= (old.prio, old.fixed_phase is not None, len(old.numbers)):
            return
        if old is not None and self._findings.get(old.cls) is old:
            del self._findings[old.cls]
        if old is None:
            finding = self._new_finding(cls, prio, fixed, joined, numbers, line, pending.tb, True)
            finding.line_no = pending.opened_at
        else:
            finding = _Finding(
                cls=cls,
                prio=prio,
                fixed_phase=fixed,
                text=joined[:EVIDENCE_CHARS],
                numbers=numbers,
                line_no=old.line_no,
                process=old.process,
                pid=old.pid,
                frame_phase=old.frame_phase,
                hint=old.hint,
                request=old.request,
                after_ready=old.after_ready,
                after_shutdown=old.after_shutdown,
                stage=old.stage,
                header=old.header,
            )
        pending.finding = finding
        if pending.speculative:  # a cause showed in the joined text: a message like any other now
            pending.speculative = False
            self._spec_count -= 1
        self._record(finding)

    def _expire_pending(self) -> None:
        for proc in self._procs.values():
            p = proc.pending
            if p is not None and self._line_no - p.opened_at > PENDING_WINDOW:
                self._drop_pending(proc)

    def _new_finding(
        self,
        cls: str,
        prio: int,
        fixed: str | None,
        text: str,
        numbers: dict[str, float],
        line: LogLine,
        tb: _Traceback | None,
        header: bool,
    ) -> _Finding:
        return _Finding(
            cls=cls,
            prio=prio,
            fixed_phase=fixed,
            text=text[:EVIDENCE_CHARS],
            numbers=numbers,
            line_no=self._line_no,
            process=line.process,
            pid=line.pid,
            frame_phase=_best_key(tb.phases) if tb is not None else None,
            hint=tb.hint if tb is not None else False,
            request=tb.request if tb is not None else False,
            after_ready=self._is_ready(),
            after_shutdown=self._shutdown_line is not None,
            stage=self._stage,
            header=header,
        )

    def _record(self, finding: _Finding) -> None:
        if finding.request and finding.cls in (CONFIG_ERROR, MODEL_NOT_FOUND):
            return  # a per-request error: the server stays up
        current = self._findings.get(finding.cls)
        if current is None:
            self._findings[finding.cls] = finding
            return
        if finding.header and not current.header and finding.line_no - current.line_no <= 50:
            # the exception line itself beats the raise statement shown just above it
            finding.line_no = current.line_no
            self._findings[finding.cls] = finding
            finding, current = current, finding
        if _phase_rank(finding.frame_phase) > _phase_rank(current.frame_phase):
            # the same failure reported by another process, whose traceback shows the deeper step
            current.frame_phase = finding.frame_phase

    # -- progress ------------------------------------------------------------------------------

    def _identity(self, text: str, tail: str) -> None:
        """The engine's version, arguments and device, from the lines that print them (first seen wins)."""
        if tail == "args":
            if self._engine_args is None:
                self._engine_args = _literal_args(text)
            return
        if self._engine_version is None:
            vm = _ENGINE_VERSION_RE.search(text)
            if vm is not None:
                self._engine_version = vm.group(1)
        if self._engine_device is None and tail == "gine":
            dm = _DEVICE_RE.search(text)
            if dm is not None:
                self._engine_device = dm.group(1)

    def _progress(self, text: str, events: list[LogLine | Progress] | None, kw: str) -> None:
        """A line whose message starts with the progress keyword ``kw``: its numbers and milestones."""
        tail = kw[-4:]
        for kind, literal, rx in _RULES_BY_KEYWORD.get(tail, _PROGRESS_RULES):
            if literal not in text:
                continue
            m = rx.search(text)
            if m is None:
                continue
            numbers: dict[str, float] = {}
            for key, value in m.groupdict().items():
                if value is not None:
                    numbers[key] = _f(value)
            self._recognised = True
            if kind == "kv_blocks" and "gpu_blocks" in numbers:
                numbers["kv_cache_tokens"] = numbers["gpu_blocks"] * self._block_size
                self._blocks_line = self._line_no
            elif "cudagraph_estimated_gib" in numbers:  # the pool line, or "Estimated CUDA graph memory"
                self._cudagraph_estimate_logged = True
            elif kind == "engine_config" and "block_size=" in text:
                for bm in _BLOCK_SIZE_RE.finditer(text):
                    start = bm.start()
                    if start == 0 or not (text[start - 1].isalnum() or text[start - 1] == "_"):
                        self._block_size = int(bm.group(1))
                        break
            if kind not in _LOADING_KINDS:
                self._obs.update(numbers)
            if kind in _DERIVING_KINDS:  # (only these change what _derive reads)
                derived = self._derive()
                if kind == "cudagraph_estimate":
                    numbers.update(derived)
            stage = _KIND_STAGE.get(kind, _STAGE_NONE)
            if stage > self._stage:
                self._stage = stage
            if events is not None:
                events.append(Progress(kind=kind, numbers=numbers, text=text[:EVIDENCE_CHARS]))
            break
        if tail in _IDENTITY_TAILS:
            self._identity(text, tail)
        if tail not in _MILESTONE_TAILS:
            return
        if tail == "ring" and self._stage < _STAGE_CAPTURE and _CAPTURE_START_RE.search(text) is not None:
            self._stage = _STAGE_CAPTURE
        if tail in ("lete", "g on") and self._ready_line is None and _READY_RE.search(text) is not None:
            self._ready_line = self._line_no
            self._ready_text = text.strip()[:EVIDENCE_CHARS]
            self._forget_survived()
            if events is not None:
                events.append(Progress(kind="server_ready", numbers={}, text=self._ready_text))
        if (
            tail in ("down", "own]", "gnal")
            and self._shutdown_line is None
            and _SHUTDOWN_RE.search(text) is not None
        ):
            self._shutdown_line = self._line_no

    def _derive(self) -> dict[str, float]:
        """Observations computed from figures of different lines of the same run; the new ones.

        ``cudagraph_estimated_gib``: vLLM's CUDA-graph estimate taken out of the KV budget, from
        "The current --gpu-memory-utilization=U is equivalent to --gpu-memory-utilization=E" and the
        device's total memory: ``(U - E) x total``. vLLM's own "CUDA graph pool memory: ... (estimated)"
        figure, when logged, is more precise and is kept.
        """
        obs = self._obs
        u = obs.get("profiled_gpu_memory_utilization")
        e = obs.get("equivalent_gpu_memory_utilization")
        total = obs.get("total_gib")
        if self._cudagraph_estimate_logged or u is None or e is None or not total:
            return {}
        value = round(max(0.0, u - e) * total, 3)
        if obs.get("cudagraph_estimated_gib") == value:
            return {}
        obs["cudagraph_estimated_gib"] = value
        return {"cudagraph_estimated_gib": value}

    # -- verdict helpers -------------------------------------------------------------------------

    def _best(self, keep: Callable[[_Finding], bool]) -> _Finding | None:
        """The most specific live finding: highest priority, earliest on a tie.

        A finding seen before vLLM became ready did not stop it (a logged, survived error), except a
        port clash, which uvicorn reports after ``Application startup complete``.
        """
        best: _Finding | None = None
        for finding in self._findings.values():
            if not keep(finding) or self._ready_before(finding.line_no) is not None:
                continue
            if best is None or _rank(finding) > _rank(best):
                best = finding
        return best

    def _phase_of(self, finding: _Finding) -> str:
        if finding.after_ready and finding.cls not in (PORT_IN_USE, MODEL_NOT_FOUND, FREE_MEM_BELOW_UTIL):
            return PHASE_SERVING
        if finding.fixed_phase is not None:
            return finding.fixed_phase
        if finding.request or self._serving_death_line is not None:
            return PHASE_SERVING  # logged by a request handler, or the engine died in its serving loop
        key = finding.frame_phase
        union = _best_key(self._all_phases)
        if union is not None and (
            key is None or (key in _WEAK_PHASE and _phase_rank(union) > _phase_rank(key))
        ):
            key = union  # the traceback of another process (a worker) shows the step that failed
        if key is not None:
            return _WEAK_PHASE.get(key, key)
        return _phase_from_stage(finding.stage)

    def _build(self, finding: _Finding, cls: str) -> Failure:
        phase = self._phase_of(finding)
        if cls.startswith(_OOM):
            if phase == PHASE_STARTUP:
                # no frame and no milestone: a forward pass in the traceback means profiling, else weights
                phase = PHASE_PROFILE if finding.hint else PHASE_LOAD_WEIGHTS
            cls = _OOM_BY_PHASE[phase]
        numbers = dict(self._obs)
        if cls in _OOM_BY_PHASE.values():
            for other in self._findings.values():  # the torch message under vLLM's (sampler, weights)
                if other is not finding and other.cls.startswith(_OOM):
                    numbers.update(other.numbers)
        numbers.update(finding.numbers)
        detail = (finding.process or "main") + (f" pid {finding.pid}" if finding.pid is not None else "")
        detail += f", line {finding.line_no}"
        return Failure(cls, phase=phase, evidence=finding.text, numbers=numbers, detail=detail)

    def _bare(self, cls: str, evidence: str, detail: str) -> Failure:
        if self._is_ready():
            phase = PHASE_SERVING
        else:
            phase = _best_phase(self._all_phases) or _phase_from_stage(self._stage)
        return Failure(cls, phase=phase, evidence=evidence, numbers=self.observations, detail=detail)

    def _infer_v0_kv(self) -> Failure | None:
        """v0 prints ``# GPU blocks: N`` before it checks them: enough to explain a death without the line."""
        blocks = self._obs.get("gpu_blocks")
        if blocks is None or self._is_ready():
            return None
        numbers = dict(self._obs)
        if blocks <= 0:
            return Failure(
                NO_KV_MEMORY,
                phase=PHASE_KV_CACHE,
                evidence="# GPU blocks: 0",
                numbers=numbers,
                detail="inferred from the block count: no room for the KV cache",
            )
        capacity = blocks * self._block_size
        max_len = self._obs.get("max_model_len")
        if max_len is None or capacity >= max_len:
            return None
        numbers["kv_capacity_tokens"] = capacity
        return Failure(
            KV_INSUFFICIENT,
            phase=PHASE_KV_CACHE,
            evidence=f"# GPU blocks: {int(blocks)} x {self._block_size} tokens = {int(capacity)} tokens "
            f"< max_model_len {int(max_len)}",
            numbers=numbers,
            detail="inferred from the block count",
        )


# ----------------------------------------------------------------------------------------------
# Convenience


def _plain(text: str) -> bool:
    """Whether ``text`` holds no carriage return, escape or NUL (its lines need no cleaning)."""
    return "\r" not in text and "\x1b" not in text and "\x00" not in text


def _line_batches(chunks: Iterable[bytes], max_line_chars: int) -> Iterator[tuple[list[str], bool]]:
    """The lines of each chunk (see :func:`lines_from_chunks`), and whether all of them are plain.

    Lines are split from the bytes and decoded one by one: a newline byte is never part of another
    character in UTF-8, so this decodes as the whole stream would (a line of ASCII stays a compact
    string, whatever the rest of the chunk holds). Plain is told from the bytes too: a carriage return,
    an escape or a NUL is one byte, and decoding never makes one. An over-long line keeps its first
    ``4 * max_line_chars + 4`` bytes, which decode to more characters than are kept.
    """
    cap = 4 * max_line_chars + 4
    partial = b""
    partial_plain = True
    dropping = False  # the rest of an over-long line is being skipped
    for chunk in chunks:
        chunk_plain = b"\r" not in chunk and b"\x1b" not in chunk and b"\x00" not in chunk
        pieces = chunk.split(b"\n")
        if len(pieces) == 1:
            partial_plain = partial_plain and chunk_plain
            if not dropping:
                partial += chunk
                if len(partial) > cap:
                    partial = partial[:cap]
                    dropping = True
            continue
        plain = chunk_plain and partial_plain
        pieces[0] = partial if dropping else partial + pieces[0]
        dropping = False
        partial = pieces.pop()
        partial_plain = chunk_plain
        if len(partial) > cap:
            partial = partial[:cap]
            dropping = True
        lines = [piece.decode("utf-8", "replace") for piece in pieces]
        if max(map(len, lines)) > max_line_chars:
            lines = [line[:max_line_chars] for line in lines]
        yield lines, plain
    if partial:
        line = partial.decode("utf-8", "replace")[:max_line_chars]
        yield [line], _plain(line)


def lines_from_chunks(chunks: Iterable[bytes], max_line_chars: int = DEFAULT_MAX_LINE_CHARS) -> Iterator[str]:
    """Decode byte chunks (invalid UTF-8 replaced) into lines of at most ``max_line_chars``.

    Memory stays bounded by one chunk plus one capped line: the rest of an over-long line is dropped.
    """
    return itertools.chain.from_iterable(lines for lines, _ in _line_batches(chunks, max_line_chars))


def diagnose_text(lines: Iterable[str], exit_code: int | None = None) -> tuple[Failure, dict[str, float]]:
    """Read a whole log and return the verdict and the success-path observations."""
    reader = LogReader()
    reader.feed_lines(lines)
    return reader.verdict(exit_code), reader.observations
