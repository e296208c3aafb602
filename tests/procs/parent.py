"""Plays r1sup: starts child.py 'stubborn' through the launcher, prints pids, then waits to be killed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from r1sup.adapters.launcher import Engine, LaunchSpec
from r1sup.core.events import ChildOutput, EventQueue

HERE = Path(__file__).resolve().parent


def main() -> int:
    events = EventQueue()
    argv = (sys.executable, str(HERE / "child.py"), "stubborn")
    spec = LaunchSpec(argv, {"PATH": "/usr/bin:/bin"}, argv, "127.0.0.1", 1, "x", "test")
    engine = Engine(spec, events, 1)
    engine.start()
    while True:
        event = events.get(5)
        if isinstance(event, ChildOutput) and event.line.startswith("pids"):
            print(event.line, flush=True)
            break
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
