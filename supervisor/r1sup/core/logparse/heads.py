"""The heads of vLLM's log records: wrappers, process tags and level stamps, and lines from bytes.

Pure: text in, :class:`LogLine` values out. Every line is cleaned of its wrappers (docker/k8s/CI
prefixes, vLLM's ``(EngineCore_DP0 pid=..)`` process tag, the logger stamp, ANSI colours, ``^M``,
Ray's ``[repeated Nx across cluster]``). The first level stamp of a line says whether vLLM logged it
quietly (INFO/DEBUG/WARNING: progress at most) or as a possible failure.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from r1sup.core.logparse.phase import ACCESS_KEYWORD, TRAFFIC_KEYWORDS

DEFAULT_MAX_LINE_CHARS = 65536
EVIDENCE_CHARS = 2000  # longest evidence kept in a verdict or a progress value
COLLAPSED_LONG = 400  # a line this long may hold several records (frames are scanned inside it)

# Progress lines start their message with one of these (after the level stamp and vLLM's
# ``[file.py:123]`` source); a quiet line without one cannot change the reader's state.
PROGRESS_KEYWORDS = (
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
    r"Estimated CUDA graph memory|worker init memory snapshot|Chunked prefill is enabled|non-default args|"
    r"port \d+ is used by process|Failed to pickle inputs of failed execution:|"
    r"No available (?:shared memory broadcast )?block found"
)


@dataclass(frozen=True)
class LogLine:
    """One relayed vLLM line with its prefixes parsed out."""

    text: str
    process: str | None = None
    rank: int | None = None
    pid: int | None = None
    level: str | None = None


_LEVELS = "DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"


# A level stamp as vLLM's logger (LEVEL MM-DD HH:MM:SS [file.py:123]) or uvicorn (LEVEL:   ) writes it,
# with the progress keyword that may start the message. The first stamp of a line tells whether
# vLLM logged it quietly (INFO/DEBUG/WARNING: progress only) or as a possible failure.
# The stamp counts at the start of a line or after a prefix's last character (a space, "|", ">", ")",
# "]"). The group that matched last tells it all (``m.lastindex``): up to ``QUIET_LAST`` a quiet level
# without a progress keyword (a line that cannot change the reader's state), beyond it an error level,
# ``KW_GROUP`` a progress keyword (after a quiet level when the match starts with D, I or W).
# (Each level is its own alternative with an empty group after it, and the start check follows the
# level: the pattern then begins with plain letters, which lets the regex engine skip to the candidates.)
def _stamp_re(keywords: str, access: str) -> re.Pattern[str]:
    """The stamp pattern with these progress keywords and this access-log keyword (same groups always)."""
    levels = "|".join(
        rf"{level}(?<![^ \t|>)\]:]{level})(?P<{group}>)"
        for level, group in (
            ("DEBUG", "q"),
            ("INFO", "qi"),
            ("WARNING", "qw"),
            ("ERROR", "e"),
            ("CRITICAL", "ec"),
        )
    )
    return re.compile(
        f"(?:{levels})"
        # uvicorn's "LEVEL:" (its access log of an OpenAI request after it: request traffic, logparse.phase),
        # or vLLM's date and source
        rf"(?::\s+(?P<ak>{access})?"
        r"| \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? (?:\[[^\]\s]{1,120}\] ?|[^\]\s]{1,120}\] ?)?)"
        rf"(?P<kw>{keywords})?"
    )


STAMP_RE = _stamp_re(PROGRESS_KEYWORDS + "|" + TRAFFIC_KEYWORDS, ACCESS_KEYWORD)


@functools.cache
def serving_stamp_re() -> re.Pattern[str]:
    """``STAMP_RE`` without the traffic keywords, for the lines after a run's first traffic (the only one
    that changes anything): in a serving log nearly every line is traffic, and capturing it would cost each
    line. Compiled when a log first shows traffic (a start-up log never needs it)."""
    return _stamp_re(PROGRESS_KEYWORDS, "(?!)")


QUIET_LAST = STAMP_RE.groupindex["qw"]  # m.lastindex <= this: a quiet level and no progress keyword
KW_GROUP = STAMP_RE.groupindex["kw"]
ACCESS_GROUP = STAMP_RE.groupindex["ak"]  # uvicorn's access log of a request (a quiet line but traffic)
QUIET_INITIALS = "DIW"  # the first letters of the quiet levels
STAMP_WINDOW = 320  # characters searched for the stamp
# In a quiet line longer than COLLAPSED_LONG, these mean more records were pasted onto it.
COLLAPSED_ALERT_RE = re.compile(r" ERROR \d\d-\d\d |ERROR: |Traceback \(most recent call last\)")

# an unstamped progress line
RAW_PROGRESS_RE = re.compile(rf"\s*(?P<kw>{PROGRESS_KEYWORDS}|{TRAFFIC_KEYWORDS})")

_ANSI_RE = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_REPEATED_RE = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
_CARET_M_RE = re.compile(r"(?:\^M)+\s*$")

_TS = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
_OUTER_RE = re.compile(
    r"(?:"
    r"\s*>[ \t]?"  # markdown quote
    r"|[ \t]*[-*+][ \t]+(?=[\w(\[])"  # a Markdown list item (a log pasted into a list)
    # DJL Serving relaying its Python worker: "WARN  PyProcess W-299-model1-stderr: [1,0]<stderr>:"
    rf"|(?:{_TS}[ \t]+)?(?:INFO|WARN|ERROR|DEBUG)[ \t]+PyProcess[ \t]+[\w.@-]+:[ \t]?"
    r"(?:\[\d+,\d+\]<std(?:out|err)>:)?"
    # journald's short-iso and short-precise heads: "2024-06-22T20:16:34+0000 host vllm[411]: "
    rf"|{_TS}[ \t]+[\w.-]+[ \t]+[\w.@/-]+\[\d+\]:[ \t]"
    r"|[\w.-]{1,40}[ \t]>>[ \t]"  # a launcher's "node-0 >> "
    # a launcher's tag in another language: "[错误] ", "【ERROR】", "日志："
    r"|(?:\[[^\]\x00-\x7f]{1,16}\]|\u3010[^\u3011]{1,24}\u3011|[^\x00-\x7f\s:\uff1a]{1,16}[:\uff1a])[ \t]*"
    r"|[ \t]*\|[ \t]"  # CI (buildkite) pipe
    r"|\[rank\d+\]:(?![IWEF]\d{4})[ \t]?"  # torch.distributed rank tag
    rf"|\[{_TS}\][ \t]*"  # [2024-09-05T00:38:34Z]
    rf"|{_TS}[ \t]+\|[ \t]+(?P<fc>{_LEVELS})[ \t]+\|[ \t]+[\w.-]+[ \t]+\|[ \t]?"  # fastchat re-logging
    rf"|{_TS}[ \t]+-[ \t]+(?P<pl>{_LEVELS})[ \t]+-[ \t]+"  # python logging "ts - LEVEL - "
    # docker/k8s (kubectl --timestamps, CRI): not a logging stamp "ts LEVEL", unless vLLM's own follows
    rf"|{_TS}[ \t]+(?:(?:stdout|stderr)[ \t]+[FP][ \t]+)?(?=\S)"
    rf"(?!(?:{_LEVELS})\b(?![ \t]+\d\d-\d\d[ \t]))(?!\d+[ \t])"
    # syslog, journald's short and short-precise
    r"|[A-Z][a-z]{2}[ \t]+\d{1,2}[ \t]\d\d:\d\d:\d\d(?:\.\d+)?[ \t]\S+[ \t][\w.@/-]+(?:\[\d+\])?:[ \t]"
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
_RANK_IN_NAME_RE = re.compile(r"(?:TP|-)(?P<rank>\d+)$")


def _process_tag(m: re.Match[str]) -> tuple[str, int | None, int]:
    """The process name, rank and pid of a matched process tag (a worker's rank may be in its name)."""
    process = m.group("proc")
    rank: int | None = None
    if m.group("rank") is not None:
        rank = int(m.group("rank"))
    elif "orker" in process:
        rm = _RANK_IN_NAME_RE.search(process)
        rank = int(rm.group("rank")) if rm else None
    return process, rank, int(m.group("pid"))


def _norm_level(level: str | None) -> str | None:
    if level is None:
        return None
    if level == "WARN":
        return "WARNING"
    if level == "FATAL":
        return "CRITICAL"
    return level


UNSTAMPED = 0  # no vLLM/uvicorn level stamp: raw stderr, or a line from elsewhere
STAMPED = 1  # vLLM or uvicorn logged it at ERROR/CRITICAL: it may carry a failure
_QUIET_LINE = 2  # logged at INFO/DEBUG/WARNING: no failure, no progress keyword
_QUIET_PROGRESS = 3  # logged at INFO/DEBUG/WARNING, the message starts with a progress keyword


def kind_of(m: re.Match[str] | None) -> tuple[int, str | None]:
    """What the first level stamp of a line (``STAMP_RE.search(line, 0, STAMP_WINDOW)``) says,
    ``UNSTAMPED`` ... ``_QUIET_PROGRESS``, and the progress keyword that starts its message.

    A line is quiet when its first level stamp is INFO/DEBUG/WARNING: vLLM logs progress at those
    levels and failures at ERROR (or as raw stderr), so a quiet line can only carry progress.
    """
    if m is None:
        return UNSTAMPED, None
    last = m.lastindex or 0
    if last <= QUIET_LAST:
        return _QUIET_LINE, None
    if last == KW_GROUP and m.string[m.start()] in QUIET_INITIALS:
        return _QUIET_PROGRESS, m.group("kw")
    if last == ACCESS_GROUP and m.string[m.start()] in QUIET_INITIALS:
        return _QUIET_LINE, None  # (the reader notes the traffic)
    return STAMPED, None


def message(segment: str, start: int) -> str:
    """The message of a stamped line from ``start``, cleaned as :func:`parse_line` cleans a line."""
    text = segment[start:]
    if "^M" in text:
        text = _CARET_M_RE.sub("", text)
    if "across cluster]" in text:
        text = _REPEATED_RE.sub("", text)
    return text.rstrip()


def segments(raw: str) -> list[str]:
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
        process, rank, pid = _process_tag(m)
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


def fast_line(segment: str, start: int) -> LogLine | None:
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
        process, rank, pid = _process_tag(pm)
    vm = _VLLM_STAMP_RE.match(segment, start)
    if vm is None:
        return None
    return LogLine(
        text=message(segment, vm.end()),
        process=process,
        rank=rank,
        pid=pid,
        level=_norm_level(vm.group("v")),
    )


def _plain(text: str) -> bool:
    """Whether ``text`` holds no carriage return, escape or NUL (its lines need no cleaning)."""
    return "\r" not in text and "\x1b" not in text and "\x00" not in text


def line_batches(chunks: Iterable[bytes], max_line_chars: int) -> Iterator[tuple[list[str], bool]]:
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
    return itertools.chain.from_iterable(lines for lines, _ in line_batches(chunks, max_line_chars))
