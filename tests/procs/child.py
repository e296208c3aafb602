"""A small stand-in for a server process, for launcher tests. Modes by argv[1]:

- ``lines``: print a few lines (one with a carriage-return progress bar, one very long), report stdin, exit 0
- ``flood N``: write N MiB of output as fast as possible, then exit 0
- ``stubborn``: ignore SIGTERM, start a grandchild that ignores SIGTERM too, print both pids, wait
- ``escape``: start a grandchild in a new session (it leaves our process group), print pids, wait
- ``listen PORT``: listen on 127.0.0.1:PORT, print the pid, wait
- ``env``: print selected environment variables, exit 0
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def wait_forever() -> None:
    while True:
        time.sleep(0.1)


def main() -> int:
    mode = sys.argv[1]
    if mode == "lines":
        print("first line", flush=True)
        sys.stdout.write("progress 10%\rprogress 50%\rprogress 100%\n")
        sys.stdout.write("x" * 200_000 + "\n")
        print(f"stdin={sys.stdin.read()!r}" if sys.stdin else "stdin=None", flush=True)
        return 0
    if mode == "flood":
        block = ("y" * 1023 + "\n").encode()
        for _ in range(int(sys.argv[2]) * 1024):
            sys.stdout.buffer.write(block)
        sys.stdout.flush()
        return 0
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
            ]
        )
        print(f"pids {os.getpid()} {grandchild.pid}", flush=True)
        wait_forever()
    if mode == "escape":
        grandchild = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        print(f"pids {os.getpid()} {grandchild.pid}", flush=True)
        wait_forever()
    if mode == "listen":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", int(sys.argv[2])))
        srv.listen()
        print(f"listening {os.getpid()}", flush=True)
        wait_forever()
    if mode == "env":
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "VLLM_API_KEY", "R1SUP_INSTANCE", "EXTRA"):
            print(f"{name}={os.environ.get(name)}", flush=True)
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
