"""Triage: the cheap tests that tell a line which cannot change the reader's state from one that may.

Pure. Most lines of a log change nothing: Python warnings and the source lines under them, torch's
and NCCL's own INFO/WARNING records, progress bars, and short raw lines holding no word the reader
looks for. These tests are supersets of what the costly ones find (tests check them on every line of
the fixtures and the collected excerpts).
"""

from __future__ import annotations

import re

from r1sup.core.logparse.families import GATE_WORDS, word_start_trie

# Python's warnings module: "path.py:12: DeprecationWarning: ..." (never a failure)
PYWARN_RE = re.compile(r"\S+:\d+: [A-Z]\w*Warning: ")

# What else makes an unstamped line matter to the reader: an exception line (its name ends in Error,
# Exception, Exit or Interrupt), a traceback, a frame (behind any prefix), a process tag, a request
# handler, a worker method, a forward pass, a progress keyword. A line holding none of these nor a gate
# word changes nothing but, when it is long, the wrap candidate it opens. Gate and trigger words are
# searched at word starts of the lowercased line (after a character other than a letter or digit; a
# leading non-letter of a word stands for that boundary), which lets the search skip most positions.
_QUICK_HEADERS = ("Error", "Exception", "Exit", "Interrupt", "Traceback", "File")  # searched case-sensitively
# A progress bar as tqdm draws it ("desc:  50%|█████     | 34/67 [00:03<00:03, 10.9it/s]") or as vLLM's
# weight loading formats it ("desc:  50% Completed | 4/8 [00:03<00:03,  1.10it/s]"), alone on its line
BAR_RE = re.compile(
    r"(?:[^%|]{1,200}:)?\s*\d{1,3}%(?:\|[^|]{0,200}\||\s+Completed \|)\s*[\d.]+[kMG]?/[\d.]+[kMG]?\s+"
    r"\[[^\]]{0,120}\]\s*$"
)
# torch's glog records at INFO/WARNING ("[W1129 18:43:13.213727611 utils.cpp:68] ...", "I0101 ...")
GLOG_QUIET_RE = re.compile(r"(?:\[rank\d+\]:)?\[?[IW]\d{4} \d\d:\d\d:\d\d")
_QUICK_WORDS = (
    *GATE_WORDS,
    "during handling", "the above exception", "py", "pid=", "serving", "executing method",
    "logits", "sampler", "sample(", "dummy", "forward", "model_executable", "hidden_states",
    # the progress keywords (PROGRESS_KEYWORDS), each by one of its words
    "took", "memory", "kv cache", "concurrency", "blocks", "graph", "startup complete", "uvicorn running",
    "initializing", "max model len", "max_model_len", "shutting down", "shutdown", "vllm instance",
    "capturing", "received signal", "explicitly set", "init engine", "starting to load", "loading",
    "warming up", "starting vllm", "chunked prefill", "non-default args",
    # request traffic (r1sup.core.logparse.phase)
    "post /v1", "added request", "received request", "aborted request", "finished request", "avg prompt",
    "engine 0", "writing input", "failed to pickle", "dumping input", "running:", "port ",
    # another program's output (r1sup.core.logparse.origin)
    "text_generation_launcher",
)  # fmt: skip
_QUICK_RE = word_start_trie(_QUICK_WORDS)


BORING_MEMO = 4096  # short unstamped lines whose test a reader remembers


def boring_text(text: str) -> bool:
    """Whether an unstamped line holds none of the words that make it matter to the reader."""
    return not any(word in text for word in _QUICK_HEADERS) and _QUICK_RE.search(" " + text.lower()) is None
