"""Structured logging: JSON lines when not on a terminal, a console renderer on one.

Event names are snake_case (``launch_started``, ``failure_classified``, ``search_step``: the search's
step, under its documented name, ...). vLLM's own lines are relayed as ``vllm`` events with
``source="vllm"``. Secrets registered with :class:`Redactor` are masked in every value before rendering.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any


def _import_structlog() -> Any:
    """Import structlog without letting it pull in ``rich`` (vLLM's environment has it): that import
    alone costs a tenth of a second, and r1sup's start-up must stay close to a bare interpreter's."""
    if "rich" in sys.modules:
        import structlog as module

        return module
    sys.modules["rich"] = None  # type: ignore[assignment]
    try:
        import structlog as module
    finally:
        del sys.modules["rich"]
    return module


_module: dict[str, Any] = {}  # structlog, once something logs: a command that logs nothing never imports it


def _structlog() -> Any:
    if "structlog" not in _module:
        _module["structlog"] = _import_structlog()
    return _module["structlog"]


def __getattr__(name: str) -> Any:
    """``logs.structlog``: the module, imported on first use."""
    if name == "structlog":
        return _structlog()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


LEVELS = ("debug", "info", "warning", "error")
MASK = "***"


class Redactor:
    """A structlog processor that replaces known secret strings in every event value."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = tuple(s for s in secrets if s)

    def mask(self, value: Any) -> Any:
        if not self._secrets:
            return value
        if isinstance(value, str):
            for secret in self._secrets:
                value = value.replace(secret, MASK)
            return value
        if isinstance(value, dict):
            return {k: self.mask(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mask(v) for v in value)
        if isinstance(value, BaseException):
            return self.mask(str(value))
        return value

    def __call__(self, logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: self.mask(v) for k, v in event_dict.items()}


class StatusLine:
    """One line at the bottom of a terminal that is rewritten in place (the loading progress).

    Log lines printed while it is shown go above it: the line is cleared, the log line written, and
    the line drawn again (see :class:`TerminalLogger`). Only used when the log stream is a terminal.
    """

    CLEAR = "\r\x1b[2K"

    def __init__(self, stream: IO[str], width: int | None = None) -> None:
        self.stream = stream
        self.width = width
        self.text = ""
        import threading  # here: a command that draws no status line does not load it

        self.lock = threading.RLock()

    def _columns(self) -> int:
        if self.width:
            return self.width
        import shutil

        return max(20, shutil.get_terminal_size((100, 24)).columns)

    def set(self, text: str) -> None:
        with self.lock:
            self.text = text[: self._columns() - 1]
            self._write(self.CLEAR + self.text)

    def clear(self) -> None:
        with self.lock:
            if self.text:
                self.text = ""
                self._write(self.CLEAR)

    def hide(self) -> None:
        """Erase it from the screen but keep its text (a log line is about to be printed)."""
        if self.text:
            self.stream.write(self.CLEAR)

    def redraw(self) -> None:
        if self.text:
            self.stream.write(self.text)

    def _write(self, data: str) -> None:
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):
            pass


class TerminalLogger:
    """structlog's PrintLogger for a terminal that shows a :class:`StatusLine` under the log."""

    def __init__(self, stream: IO[str], status: StatusLine) -> None:
        self._stream = stream
        self._status = status

    def msg(self, message: str) -> None:
        with self._status.lock:
            try:
                self._status.hide()
                self._stream.write(message + "\n")
                self._status.redraw()
                self._stream.flush()
            except (OSError, ValueError):
                pass

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


_active: dict[str, Any] = {"redactor": Redactor(), "status": None}  # process-wide, like structlog's


def status_line() -> StatusLine | None:
    """The terminal's progress line when logs go to a terminal in the console format, else None."""
    line = _active["status"]
    return line if isinstance(line, StatusLine) else None


def mask(text: str) -> str:
    """Mask the secrets the logging was configured with (for text printed outside structlog)."""
    return str(_active["redactor"].mask(text))


def mask_value(value: Any) -> Any:
    """:func:`mask` for plain data (dicts, lists, strings): what a state file is written with."""
    return _active["redactor"].mask(value)


def console_format(fmt: str, stream: IO[str]) -> bool:
    """Whether ``--log-format fmt`` renders for a person on ``stream`` (console) rather than JSON."""
    return fmt == "console" or (fmt == "auto" and _isatty(stream))


def configure(
    level: str = "info",
    fmt: str = "auto",
    stream: IO[str] | None = None,
    secrets: Iterable[str] = (),
    defer: bool = False,
) -> None:
    """Configure structlog for the process. ``fmt``: auto (JSON unless a TTY), json or console.
    ``defer``: only when the first logger is asked for (:func:`get_logger`), so that a command that
    logs nothing (``status``, unless a file it reads is unusable) never imports structlog; secrets
    are masked (:func:`mask`) from now on either way."""
    if defer:
        _active["redactor"] = Redactor(secrets)
        _active["pending"] = (level, fmt, stream, tuple(secrets))
        return
    _active.pop("pending", None)
    import logging

    structlog = _structlog()
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if _isatty(out) else "json"
    redactor = Redactor(secrets)
    _active["redactor"] = redactor
    _active["status"] = None
    processors: list[Any] = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level]
    factory: Any = structlog.PrintLoggerFactory(out)
    if fmt == "json":
        # every field, as logged: log shippers rely on them
        processors += [structlog.processors.TimeStamper(fmt="iso", utc=True), redactor]
        processors.append(structlog.processors.JSONRenderer(default=str))
    else:
        tty = _isatty(out)
        processors += [structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False), redactor, console_view]
        processors.append(structlog.dev.ConsoleRenderer(colors=tty, sort_keys=False, pad_event_to=20))
        if tty:
            status = StatusLine(out)
            _active["status"] = status
            factory = lambda *args: TerminalLogger(out, status)  # noqa: E731
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


# --- the console view: what a person reads -------------------------------------------------------

_CONSOLE_DROP = frozenset({"command", "source", "vllm_level"})  # kept in JSON, noise on a console
_CONSOLE_TEXT_LIMIT = 300


def console_view(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Make an event readable on a console; the JSON format keeps every field as logged.

    Flag dicts become ``ctx=32768 util=0.9 kv=fp8``; a step's ``old``/``new`` dicts become its change
    (``max_model_len 32768 -> 7680``) only; token counts print as integers (``32768``, not
    ``32768.0``); a progress event says the phase in words; empty fields and long texts are cut.
    """
    from r1sup.core.flags import describe_dict_change, short

    ev = dict(event_dict)
    old, new = ev.get("old"), ev.get("new")
    if isinstance(old, dict) and isinstance(new, dict):
        ev.pop("old")
        ev.pop("new")
        ev.setdefault("change", describe_dict_change(old, new))
    if ev.get("event") in ("engine_progress", "engine_ready"):
        ev = _progress_view(ev)
    elif ev.get("event") == "search_step":
        ev.pop("evidence", None)  # the verdict just above showed it
    out: dict[str, Any] = {}
    for key, value in ev.items():
        if value is None or key in _CONSOLE_DROP:
            continue
        if key == "flags" and isinstance(value, dict):
            value = short(value)
        elif key == "numbers" and isinstance(value, dict):
            for k, v in value.items():
                out.setdefault(k, plain(v))
            continue
        out[key] = plain(value)
    return out


def _progress_view(ev: dict[str, Any]) -> dict[str, Any]:
    """``phase='loading weights 45%' after='starting vLLM (0:12)' elapsed=0:15 eta=1:10`` first, then
    the numbers vLLM printed in the phase just left."""
    from r1sup.core.progress import LABELS, clock

    ev = dict(ev)
    head: dict[str, Any] = {k: ev.pop(k) for k in ("event", "level", "timestamp", "attempt") if k in ev}
    ev.pop("launch", None)
    phase, percent = ev.pop("phase", None), ev.pop("percent", None)
    if phase is not None:
        head["phase"] = LABELS.get(phase, phase) + (f" {percent:.0f}%" if percent is not None else "")
    after, seconds = ev.pop("after", None), ev.pop("after_s", None)
    if after is not None:
        head["after"] = LABELS.get(after, after) + (f" ({clock(seconds)})" if seconds is not None else "")
    for key in ("elapsed_s", "eta_s"):
        value = ev.pop(key, None)
        if isinstance(value, (int, float)):
            head[key[:-2]] = clock(value)
    return {**head, **ev}


def plain(value: Any) -> Any:
    """A value as a person wants to read it: ``32768.0`` -> ``32768``, ``7.004518`` -> ``7.005``,
    long texts cut; containers converted item by item."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return int(value)
        return round(value, 3) if abs(value) >= 0.01 else float(f"{value:.3g}")
    if isinstance(value, str):
        return value if len(value) <= _CONSOLE_TEXT_LIMIT else value[: _CONSOLE_TEXT_LIMIT - 3] + "..."
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def get_logger(**context: Any) -> Any:
    pending = _active.get("pending")
    if pending is not None:
        configure(*pending)
    return _structlog().get_logger("r1sup").bind(**context)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
