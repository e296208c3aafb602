"""Read vLLM's output: relay lines, success-path numbers, and one verdict (a :class:`Failure`).

Pure: lines in, typed values out; no ``os``, no clock, no subprocess. Streaming: the reader keeps a
bounded state (per-process traceback frames, the best finding per class, numbers) and never the log.

One module per job:

* :mod:`~r1sup.core.logparse.heads`: the heads of records (wrappers, process tags, level stamps), lines
  from bytes;
* :mod:`~r1sup.core.logparse.triage`: the cheap tests that pass over lines that cannot change anything;
* :mod:`~r1sup.core.logparse.figures`: progress and figures (numbers, start-up milestones, readiness, the
  engine's identity);
* :mod:`~r1sup.core.logparse.families`: the failure message families and their numbers;
* :mod:`~r1sup.core.logparse.tracebacks`: traceback tracking (the step each frame names);
* :mod:`~r1sup.core.logparse.joining`: record joining (messages continued on later lines, hard wraps);
* :mod:`~r1sup.core.logparse.verdict`: the pure :func:`decide`, from what was collected to the verdict;
* :mod:`~r1sup.core.logparse.reader`: :class:`LogReader`, their composition.
"""

from r1sup.core.figures import Figures
from r1sup.core.logparse.figures import Progress
from r1sup.core.logparse.heads import DEFAULT_MAX_LINE_CHARS, LogLine, lines_from_chunks, parse_line
from r1sup.core.logparse.reader import LogReader, diagnose_text
from r1sup.core.logparse.verdict import Collected, Decision, Diagnosis, Finding, decide

__all__ = [
    "DEFAULT_MAX_LINE_CHARS",
    "Collected",
    "Decision",
    "Diagnosis",
    "Figures",
    "Finding",
    "LogLine",
    "LogReader",
    "Progress",
    "decide",
    "diagnose_text",
    "lines_from_chunks",
    "parse_line",
]
