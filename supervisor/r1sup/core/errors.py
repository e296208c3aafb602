"""One exception hierarchy, each class mapped to a documented exit code."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_NO_WORKING_CONFIG = 3
EXIT_FATAL_FAILURE = 4
EXIT_RESTART_BUDGET = 5
EXIT_NOT_A_VLLM_LOG = 6
EXIT_GATE_FAILED = 8  # `profile gate`: the new image's verified capacity is below the old one's
EXIT_SIGHUP = 129  # `tune` only: stopped by SIGHUP (the terminal closed), vLLM stopped first
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class R1supError(Exception):
    """Base class: carries the process exit code the CLI returns for it."""

    exit_code = EXIT_INTERNAL


class ConfigError(R1supError):
    """Bad configuration or usage. The message names the dotted field."""

    exit_code = EXIT_CONFIG

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


class InputError(R1supError):
    """An input file that cannot be read (diagnose, profile import)."""

    exit_code = EXIT_CONFIG


class PreflightError(R1supError):
    """What must hold before any model load does not: the interpreter, vLLM, the model, the port.

    Exit 2 when the setting's value itself is wrong (an interpreter that does not exist), 4 when the
    world does not match it (no vLLM in that interpreter, a model that is nowhere)."""

    def __init__(self, field: str, message: str, exit_code: int = EXIT_FATAL_FAILURE) -> None:
        self.field = field
        self.message = message
        self.exit_code = exit_code
        super().__init__(f"{field}: {message}")


class InternalError(R1supError):
    """r1sup's own machinery broke (the probe child, an unexpected exception): never the engine's fault.

    ``where`` names the module (and function) that failed, ``error`` the exception, in one line."""

    exit_code = EXIT_INTERNAL

    def __init__(self, where: str, error: str, trace: str = "") -> None:
        self.where = where
        self.error = error
        self.trace = trace  # the traceback, for a debug log event; never printed on stderr
        super().__init__(f"internal error in {where}: {error}")

    @classmethod
    def from_exception(cls, exc: BaseException) -> InternalError:
        """Where an unexpected exception was raised: the innermost frame inside the r1sup package."""
        import traceback

        where = "r1sup"
        for frame in traceback.extract_tb(exc.__traceback__):
            module = r1sup_module(frame.filename)
            if module:
                where = f"{module} ({frame.name}, line {frame.lineno})"
        text = " ".join(str(exc).split())[:300]
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(where, f"{type(exc).__name__}: {text}" if text else type(exc).__name__, trace)


def r1sup_module(filename: str, package_dir: str | None = None) -> str | None:
    """``<package>/commands/tune.py`` -> ``r1sup.cli.commands.tune``; None for a file outside the package.

    A probe child's traceback names files of the same installed package, so its text is read the same way.
    """
    import os

    root = package_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # r1sup/
    path = os.path.abspath(filename)
    if not path.endswith(".py") or os.path.commonpath([root, path]) != root:
        return None
    names = ["r1sup", *os.path.relpath(path, root)[: -len(".py")].split(os.sep)]
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


class NotAVllmLog(R1supError):
    """``diagnose`` read its input and found no line of vLLM output in it."""

    exit_code = EXIT_NOT_A_VLLM_LOG
