"""Structured logging: JSON lines when not on a terminal, a console renderer on one.

Event names are snake_case (``launch_started``, ``failure_classified``, ``ladder_step``...). vLLM's
own lines are relayed as ``vllm`` events with ``source="vllm"``. Secrets registered with
:class:`Redactor` are masked in every value before rendering.
"""

from __future__ import annotations

import logging
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


structlog = _import_structlog()

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


_active = {"redactor": Redactor()}  # the process's logging configuration is process-wide, like structlog's


def mask(text: str) -> str:
    """Mask the secrets the logging was configured with (for text printed outside structlog)."""
    return str(_active["redactor"].mask(text))


def console_format(fmt: str, stream: IO[str]) -> bool:
    """Whether ``--log-format fmt`` renders for a person on ``stream`` (console) rather than JSON."""
    return fmt == "console" or (fmt == "auto" and _isatty(stream))


def configure(
    level: str = "info",
    fmt: str = "auto",
    stream: IO[str] | None = None,
    secrets: Iterable[str] = (),
) -> None:
    """Configure structlog for the process. ``fmt``: auto (JSON unless a TTY), json or console."""
    out = stream if stream is not None else sys.stdout
    if fmt == "auto":
        fmt = "console" if _isatty(out) else "json"
    redactor = Redactor(secrets)
    _active["redactor"] = redactor
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(default=str)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(out))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redactor,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("r1sup").bind(**context)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
