"""The one-line verdict of an exit, where a container platform reads it.

Kubernetes shows the content of the container's termination-message file (``/dev/termination-log`` by
default, ``terminationMessagePath``) as the reason a container terminated (``kubectl describe pod``). The
kubelet creates that file; r1sup writes it only when it is already there and writable (never creating a
file under ``/dev`` outside Kubernetes), and never raises: the exit code is what counts.
"""

from __future__ import annotations

import os

DEFAULT_PATH = "/dev/termination-log"
ENV = "R1SUP_DAEMON_TERMINATION_LOG"
# the kubelet reads at most 4096 bytes of the file
MAX_BYTES = 4096


def line(code: int, reason: str) -> str:
    """``r1sup: exit 3: <reason>`` on one line, at most :data:`MAX_BYTES` bytes of UTF-8."""
    text = " ".join(f"r1sup: exit {code}: {reason}".split())
    data = text.encode("utf-8")[: MAX_BYTES - 1]
    return data.decode("utf-8", errors="ignore") + "\n"


def path_from(setting: str | None, env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """The file: the setting (daemon.termination_log), else the environment's, else the default. Empty
    turns it off."""
    if setting is not None:
        return setting
    return (os.environ if env is None else env).get(ENV, DEFAULT_PATH)


def write(path: str, code: int, reason: str) -> bool:
    """Replace the file's content with the verdict when ``path`` exists and is writable; whether it
    was written."""
    if not path:
        return False
    from r1sup.adapters import logs

    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        os.write(fd, line(code, logs.mask(reason)).encode("utf-8"))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
