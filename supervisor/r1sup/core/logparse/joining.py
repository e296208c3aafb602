"""Record joining: exception messages that go on over the next lines (multi-line, or hard-wrapped).

Pure. An exception line opens a :class:`Pending` message; the lines that continue it (no deeper
indentation, no new frame or exception, a terminal's wrap of a full-width line) are joined to it, both
with a space and without one (a word the wrap split), and the joined text is matched again: the
message may name its cause only once it is whole ("... fp8" + "e4nv not supported"). A long line that
names no cause may be the first piece of a wrapped message: it is *speculative*, continued only by the
very next line, until a cause shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from r1sup.core.logparse.families import EXC_HEADER_RE, Family, gate, match_families, specificity
from r1sup.core.logparse.tracebacks import Traceback
from r1sup.core.logparse.verdict import Finding

JOIN_CHARS = 4096  # longest exception message rebuilt from continuation lines
JOIN_LINES = 8  # continuation lines followed after an exception line
PENDING_WINDOW = 12  # lines after which an open exception message is closed whatever comes
WRAP_MIN_WIDTH = 72  # a line this long followed by an unprefixed piece may have been hard-wrapped


@dataclass
class Pending:
    """An exception message that may continue on the next lines (multi-line or hard-wrapped)."""

    finding: Finding | None
    text_space: str
    text_tight: str
    lines: int
    opened_at: int
    tb: Traceback | None = None  # the traceback the exception line ended
    indent: int = 0  # indentation of the exception line; deeper lines are source, not message
    wrapped: bool = False  # continued by hard-wrapped pieces: join them without spaces
    # a long line that is neither an exception nor a known cause: only the very next line can
    # continue it (a terminal's wrap), until a cause shows in the joined text
    speculative: bool = False
    last_line: int = 0  # the line that last joined it


def continues(text: str, stripped: str, pending: Pending, wrapped: bool = False) -> bool:
    """Whether a line (``text``, and ``stripped`` of its indentation) goes on with an open message;
    ``wrapped``: it would be a terminal's wrap of the previous line."""
    if not stripped or pending.lines >= JOIN_LINES or len(pending.text_space) >= JOIN_CHARS:
        return False
    if len(text) - len(stripped) > pending.indent + 2:
        return False  # a source line of the next traceback, not more of the message
    if stripped.startswith(("File ", "Traceback", "The above exception", "During handling")):
        return False
    if stripped.startswith("Process ") and stripped.endswith(":"):
        return False  # multiprocessing's "Process EngineCore:" opens the next traceback ("Process 42 has ...
        # memory in use" goes on with torch's OOM message)
    if not wrapped and EXC_HEADER_RE.match(stripped) is not None:
        return False  # a new exception (a wrapped piece may look like one: "rs.CompilationError: ...")
    if not gate(stripped):
        return True
    # a line that names a cause of another class by itself ("Killed") starts something new,
    # unless it only completes the message ("...type fp8" + "e4nv not supported ...")
    alone = match_families(stripped)
    if alone is None or (pending.finding is not None and alone[0] == pending.finding.cls):
        return True
    joined = match_families(pending.text_tight + stripped)
    if joined is None:
        return False
    if pending.finding is None:
        # a wrap candidate: it continues only when it completes the cause (the line names it alone)
        return specificity(joined) > specificity(alone)
    return specificity(joined) > specificity(alone) or (
        joined[0] == alone[0] and specificity(joined) >= specificity(alone)
    )


def extend(pending: Pending, stripped: str, line_no: int) -> tuple[Family, str] | None:
    """Join a continuation line (on input line ``line_no``) to an open message; the family of the
    joined text and the text, when it names a cause more surely than the message did before."""
    pending.lines += 1
    pending.last_line = line_no
    pending.text_space = f"{pending.text_space} {stripped}"[:JOIN_CHARS]
    pending.text_tight = f"{pending.text_tight}{stripped}"[:JOIN_CHARS]
    old = pending.finding
    tail = len(stripped) + 41
    if old is None and not (gate(pending.text_space[-tail:]) or gate(pending.text_tight[-tail:])):
        return None  # (both joins: a word split by the wrap, or two words a trailing space kept apart)
    fam = match_families(pending.text_space)
    joined = pending.text_space
    tight = match_families(pending.text_tight)
    if tight is not None and (
        fam is None
        or specificity(tight) > specificity(fam)
        or (pending.wrapped and specificity(tight) == specificity(fam))
    ):
        fam, joined = tight, pending.text_tight
    if fam is None:
        return None
    if old is not None and specificity(fam) <= (old.prio, old.fixed_phase is not None, len(old.numbers)):
        return None
    return fam, joined
