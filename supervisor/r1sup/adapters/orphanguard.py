"""Kill a vLLM process group when r1sup dies without saying goodbye.

Started by the launcher in its own session with a pipe on stdin. r1sup writes ``done`` before it
closes the pipe on a normal stop. EOF without ``done`` means r1sup was killed (SIGKILL, OOM killer):
SIGTERM to the group, a grace period, then SIGKILL. Usage:
``python -m r1sup.adapters.orphanguard PGID GRACE``.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str]) -> int:
    pgid, grace = int(argv[0]), float(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the pipe decides
    data = b""
    while True:
        chunk = os.read(0, 64)
        if not chunk:
            break
        data += chunk
    if b"done" in data:
        return 0
    if not _alive(pgid):
        return 0
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pgid):
        time.sleep(0.1)
    if _alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
