"""r1sup's own event log read back: the vLLM lines it relayed and the flags it launched with.

Pure. ``journalctl -u r1sup -o cat`` (or the JSON log on any stream) holds one JSON object a line, as
``r1sup.adapters.logs`` renders them:
``{"event": "vllm", "text": ..., "vllm_level": ..., "proc": ..., "pid": ...}`` for each line of vLLM's output
(its process tag and stamp parsed off), ``{"event": "launch_started", "flags": {...}}`` when a launch begins.
``journalctl -o json`` wraps each in its ``MESSAGE`` field, and the short formats put a syslog head before it.
The reader diagnoses the relayed text as vLLM printed it (the line rebuilt with its tag and level), per
launch, with the launch's flags as the engine's arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EVENT_MARK = '"event": '  # in every line of r1sup's JSON log (json.dumps' separators)
_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"})
# a relayed line gets back a stamp in vLLM's format, so that its level counts as vLLM's did
_RELAY_STAMP = "{level} 01-01 00:00:00 [r1sup_relay.py:0] "
MAX_EVENT_CHARS = 1 << 20  # a longer line is not parsed as an event


def parse_event(line: str) -> dict[str, Any] | None:
    """The event object of one line of r1sup's JSON log (behind a syslog head, or in journald's JSON
    export's ``MESSAGE``); None for any other line."""
    start = line.find("{")
    if start < 0 or len(line) - start > MAX_EVENT_CHARS:
        return None
    body = line[start:].rstrip()
    if not body.endswith("}"):
        return None
    import json  # (only for the lines that look like r1sup's own events)

    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    if "event" not in obj and isinstance(obj.get("MESSAGE"), str):
        return parse_event(obj["MESSAGE"])
    return obj if isinstance(obj.get("event"), str) else None


def relayed_line(event: Mapping[str, Any]) -> str | None:
    """The vLLM line a ``vllm`` event relayed, rebuilt with its process tag and level stamp."""
    if event.get("event") != "vllm" or not isinstance(event.get("text"), str):
        return None
    text: str = event["text"]
    head = ""
    proc, pid, rank = event.get("proc"), event.get("pid"), event.get("rank")
    if isinstance(proc, str) and proc and isinstance(pid, int) and not isinstance(pid, bool):
        ranked = f" rank={rank}" if isinstance(rank, int) and not isinstance(rank, bool) else ""
        head = f"({proc}{ranked} pid={pid}) "
    level = event.get("vllm_level")
    if isinstance(level, str) and level in _LEVELS:
        head += _RELAY_STAMP.format(level=level)
    return head + text


def launched_flags(event: Mapping[str, Any]) -> dict[str, object] | None:
    """The flags a ``launch_started`` event names (plain values only), as vLLM's argument names."""
    if event.get("event") != "launch_started" or not isinstance(event.get("flags"), dict):
        return None
    return {
        str(key): value
        for key, value in event["flags"].items()
        if value is None or isinstance(value, (str, int, float, bool))
    }
