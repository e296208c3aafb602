"""One exception hierarchy, each class mapped to a documented exit code."""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_NO_WORKING_CONFIG = 3
EXIT_FATAL_FAILURE = 4
EXIT_RESTART_BUDGET = 5
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


class NoWorkingConfig(R1supError):
    """The ladder is exhausted: no configuration within its bounds started and passed the probe."""

    exit_code = EXIT_NO_WORKING_CONFIG


class FatalFailure(R1supError):
    """A non-memory failure that no flag change can fix: model not found, port taken, bad arguments."""

    exit_code = EXIT_FATAL_FAILURE


class RestartBudgetExhausted(R1supError):
    """While serving, the server crashed more often than the restart budget allows."""

    exit_code = EXIT_RESTART_BUDGET


class Interrupted(R1supError):
    """Stopped by a signal; the child was stopped first."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.exit_code = EXIT_SIGINT if signum == signal.SIGINT else EXIT_SIGTERM
        super().__init__(f"stopped by {signal.Signals(signum).name}")
