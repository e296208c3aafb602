"""The run's phase from the log itself: start-up milestones against request traffic.

Pure. vLLM's start-up prints its milestones (``r1sup.core.failure.STARTUP_MILESTONES``); once it serves, its
log shows requests: the engine adding them, the API server's access log answering ``POST /v1/...``, the
periodic statistics with requests running, and, when a step fails, the dump of the failed execution's
input. A failure after traffic fails while serving (``oom_runtime``, not a start-up step), whatever the
excerpt kept of the start-up; a start-up milestone after the traffic starts a new run.
"""

from __future__ import annotations

import re

TRAFFIC_RE = re.compile(
    r'"POST /v1/[\w/.-]{0,80} HTTP/[\d.]+"'  # uvicorn's access log of an OpenAI request
    r"|\b(?:Added|Received|Aborted|Finished) request \S"  # the engine's and the API server's request log
    r"|Running: [1-9]\d* reqs"  # the periodic statistics, requests running
    r"|(?:Writing|Failed to pickle) inputs? of failed execution"  # V0: execute_model failed, input dumped
    r"|Dumping input data"  # V1: a failed engine step's scheduler output
)
# Progress keywords (after vLLM's stamp) of traffic lines: r1sup.core.logparse.heads.PROGRESS_KEYWORDS has
# them; their last four characters (the keyword's tail, as r1sup.core.logparse.figures dispatches on it) tell
# them
TRAFFIC_KEYWORDS = (
    r"(?:Added|Received|Aborted|Finished) request|Avg prompt throughput|Engine \d+: Avg prompt throughput|"
    r"Writing input of failed execution"
)
TRAFFIC_TAILS = frozenset({"uest", "hput", "tion"})
# uvicorn's access log of an OpenAI request, after its "INFO:" (heads.STAMP_RE tries it there only)
ACCESS_KEYWORD = r'[\w.\[\]:%-]{3,80} - "POST /v1/'
ACCESS_MARK = '"POST /v1/'

# A WARNING that carries the failure of a model step: its message names the error ("Failed to pickle
# inputs of failed execution: CUDA error: an illegal memory access was encountered")
FAILED_STEP_PREFIX = "Failed to pickle inputs of failed execution"
# vLLM's message queue logging that its readers took no block for a minute (a progress keyword, at INFO or
# WARNING): a hang unless the log goes on
STALL_PREFIX = "No available "


def traffic(text: str) -> bool:
    """Whether a line shows request traffic (the server was serving when it was printed)."""
    return (
        "POST /v1/" in text
        or " request " in text
        or " reqs" in text
        or "failed execution" in text
        or "Dumping input data" in text
    ) and TRAFFIC_RE.search(text) is not None
