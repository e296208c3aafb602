"""The command line: ``main(argv) -> int``. Thin: parse, configure logging, call a command module.

Nothing heavy is imported here; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from r1sup import __version__
from r1sup.core.errors import EXIT_CONFIG, EXIT_INTERNAL, EXIT_SIGINT, InternalError, R1supError

# One line (or two) per exit code, as the README's "Exit codes" table says it. Each command's --help lists
# only the codes that command can return; the top-level help lists them all.
EXIT_CODE_LINES: dict[int, str] = {
    0: "ok",
    1: "a file could not be written, or an internal error of r1sup (one line naming where)",
    2: "usage or configuration error (one line on stderr naming the field)",
    3: "no working configuration within the search's bounds (plan: does not fit within them)",
    4: "fatal non-memory failure (model not found, no vLLM in server.python, port taken, bad engine\n"
    "       arguments)",
    5: "run gave up: more crashes than daemon.restart_budget allows",
    6: "diagnose: the input is not a vLLM log",
    7: "plan: fits only with the recommended flags (not as given)",
    8: "profile gate: the new image's verified capacity is below the previous image's (not published)",
    129: "tune: stopped by SIGHUP, the terminal closed (vLLM stopped first)",
    130: "stopped by SIGINT (vLLM stopped first)",
    143: "stopped by SIGTERM during tune (vLLM stopped first; run exits 0 on SIGTERM)",
}


def exit_codes_help(codes: dict[int, str | None], title: str = "exit codes:", tail: str = "") -> str:
    """The ``exit codes:`` epilog of one command: ``codes`` maps each code it can return to its own
    wording (None: the common one of :data:`EXIT_CODE_LINES`), in the order given."""
    lines = [title]
    for code, text in codes.items():
        lines.append(f"  {code:<4} {text if text is not None else EXIT_CODE_LINES[code]}")
    return "\n".join(lines) + "\n" + tail


EXIT_CODES_HELP = exit_codes_help({code: None for code in EXIT_CODE_LINES})
_INTERNAL_ONLY = "an internal error of r1sup (one line naming where)"
_STATE_DIR_BUSY = (
    "usage or configuration error (one line naming the field); also: another r1sup holds the\n"
    "       state directory (the line names its pid and command)"
)
RUN_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "stopped cleanly (SIGTERM or SIGINT: vLLM drained and stopped first)",
        1: None,
        2: _STATE_DIR_BUSY,
        3: "no working configuration within the search's bounds",
        4: None,
        5: "gave up serving: more crashes than daemon.restart_budget allows",
    }
)
TUNE_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "a configuration started and passed the probe (saved, the report printed)",
        1: "the profile could not be saved, or an internal error of r1sup (one line naming where)",
        2: _STATE_DIR_BUSY,
        3: "no working configuration within the search's bounds, or an [slo] that one request at a "
        "time already misses (the measured floor named)",
        4: None,
        129: "stopped by SIGHUP, the terminal closed (vLLM stopped first; not under nohup)",
        130: "stopped by SIGINT (vLLM stopped first)",
        143: "stopped by SIGTERM (vLLM stopped first)",
    }
)
WORKER_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "stopped cleanly (SIGTERM or SIGINT: the headless vLLM stopped first)",
        1: None,
        2: "usage or configuration error (one line naming the field: multinode.nnodes >= 2, backend\n"
        "       mp, node_rank >= 1 and master_addr are required)",
    }
)
DIAGNOSE_EXIT_CODES_HELP = exit_codes_help(
    {
        0: 'the input is a vLLM log (whatever its verdict, "none" included)',
        1: _INTERNAL_ONLY,
        2: "usage error, or the input cannot be read",
        6: "the input is not a vLLM log: no line of it is vLLM output (empty, binary, another program's"
        " text)",
    }
)
PLAN_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "fits as given: vLLM starts with these flags and holds the target",
        7: "fits only with the recommended flags (printed; r1sup run launches them first)",
        3: "does not fit within the search's bounds (the ways out say what would)",
        1: _INTERNAL_ONLY,
        2: "usage or configuration error (one line on stderr naming the field; an unknown or ambiguous\n"
        "       --gpu name lists the close ones)",
    },
    title="exit codes (the verdict; --json: verdict.exit_code):",
    tail="scripts: `r1sup plan ... && deploy` deploys only what fits as written; accept the recommended"
    " flags\ntoo with `r1sup plan ...; [ $? -ne 3 ]`\n",
)
STATUS_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "shown (also when nothing runs or was tuned yet; a --watch ends with Ctrl-C)",
        1: _INTERNAL_ONLY,
        2: None,
    }
)
REPORT_EXIT_CODES_HELP = exit_codes_help(
    {
        0: None,
        1: "the --html file could not be written, or an internal error of r1sup (one line naming where)",
        2: "usage error, no run record (or none matching --run), or an unusable one",
    }
)
CHECK_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "the config is valid and the preflight passed",
        1: _INTERNAL_ONLY,
        2: None,
        4: "the preflight failed: no vLLM in server.python, the model is nowhere, the port is taken",
    }
)
PROFILE_EXIT_CODES_HELP = exit_codes_help(
    {
        0: None,
        1: None,
        2: "usage or configuration error, no saved profile to export, a profile file that cannot be\n"
        "       read, or a fingerprint that differs (without --force)",
    }
)
PROFILE_GATE_EXIT_CODES_HELP = exit_codes_help(
    {
        0: "published: the new image's profile verifies at least the previous image's",
        1: None,
        2: "usage or configuration error, or no profile of this box and config to gate",
        8: None,
    }
)
PROFILE_GROUP_EXIT_CODES_HELP = exit_codes_help({0: None, 1: None, 2: None, 8: None})
TINY_MODEL_EXIT_CODES_HELP = exit_codes_help({0: None, 1: None, 2: None})
# Commands that log nothing: structlog is neither imported nor configured for them (start-up time).
SILENT_COMMANDS = frozenset({"diagnose"})
# Commands that log only when something is wrong (an unusable state file): logging is configured as
# for any command, structlog imported only when the first line is logged (start-up time: issue 36)
QUIET_COMMANDS = frozenset({"status"})
# Commands whose parser alone is built when they come first (``build_parser``; start-up time)
FAST_COMMANDS = frozenset({"status"})

CONFIG_ENV = "R1SUP_CONFIG"  # the config file when --config is not given (containers)
KV_DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def _columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size().columns`` gives it (COLUMNS, else the
    terminal of stdout, else 80), without importing shutil and the compression modules it loads."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:  # no sys.__stdout__ (None): AttributeError, as in shutil
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's raw-description help at the width argparse would take (the terminal's, less 2)."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ) -> None:
        super().__init__(
            prog, indent_increment, max_help_position, _columns() - 2 if width is None else width
        )


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_CONFIG)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="TOML config of one served model (default: $R1SUP_CONFIG; without either, the settings "
        "come from R1SUP_* variables alone)",
    )
    p.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable); beats R1SUP_* variables and the file",
    )
    p.add_argument("--state-dir", metavar="DIR", help="same as --set state.dir=DIR")


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine flags (override the config's [start])")
    g.add_argument("--max-model-len", type=int, metavar="N")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F")
    g.add_argument("--kv-cache-dtype", choices=KV_DTYPE_CHOICES)
    g.add_argument("--quantization", choices=("none", "fp8", "awq", "gptq"), help="weight quantization")
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--max-num-seqs", type=int, metavar="N")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N")
    g.add_argument("--target-concurrency", type=int, metavar="N", help="requests that must fit at once")
    g.add_argument("--target-context", type=int, metavar="N", help="tokens per request that must fit")


class _Unbuilt:
    """A command's parser not built: every call is taken and does nothing (see ``build_parser``)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line. ``only``: a command given first (``r1sup status ...``): the other commands'
    arguments are not built (about a tenth of ``status``'s start-up); the top level and that command
    parse, help and fail as in the full parser (the usage names COMMAND, never the list)."""
    parser = _Parser(
        prog="r1sup",
        description="Start vLLM, recover it from out-of-memory, keep it serving.",
        epilog=EXIT_CODES_HELP,
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"r1sup {__version__}")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None)
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: JSON unless a terminal",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, help: str, epilog: str) -> argparse.ArgumentParser:
        if only is not None and name != only:
            return _Unbuilt()  # type: ignore[return-value]
        p: argparse.ArgumentParser = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=epilog,
            formatter_class=_Formatter,
        )
        return p

    p = add(
        "run",
        "serve under supervision: reuse or tune a working config, then keep vLLM alive",
        epilog=RUN_EXIT_CODES_HELP,
    )
    _add_config_args(p)

    p = add(
        "worker",
        "a node of a multi-node group (multinode.backend = mp) other than the leader's: run vLLM headless "
        "with the leader's flags, again at each of the leader's launches",
        epilog=WORKER_EXIT_CODES_HELP,
    )
    _add_config_args(p)

    p = add(
        "tune",
        "find a configuration that starts and passes the load probe, save it, print a report",
        epilog=TUNE_EXIT_CODES_HELP,
    )
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--strategy", choices=("smart", "naive"), help="same as --set search.strategy=...")
    _add_slo_args(p, "tune then proves the highest concurrency that meets the [slo] targets")

    p = add(
        "plan",
        "size a model for a GPU before anything is downloaded or launched",
        epilog=PLAN_EXIT_CODES_HELP,
    )
    _add_slo_args(p, "plan cannot measure it: it says what tune would prove on the engine")
    p.add_argument("--config", "-c", metavar="FILE", help="take model, flags and target from this config")
    p.add_argument("--model", "-m", help="HF id (catalog or local HF cache) or a local model directory")
    p.add_argument(
        "--gpu",
        metavar="NAME",
        help="GPU from the catalog, e.g. 'RTX 4090', 'H100 80' (a name it does not hold is refused; "
        "for such a card give --gpu-memory-gib)",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="GIB",
        help="memory of one GPU in GiB, CUDA's total (beside a --gpu NAME not in the catalog, NAME is "
        "its label)",
    )
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs for tensor parallel")
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        metavar="N",
        help="pipeline stages, vLLM's --pipeline-parallel-size (default: server.extra_args', else 1)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="N",
        help="GPUs per node for multi-node layouts and ways out (default 8)",
    )
    p.add_argument(
        "--vllm-version",
        metavar="X.Y.Z",
        help="size for this vLLM release (default: the installed vLLM's, else the newest r1sup knows)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_plan_flags(p)
    p.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float16", "float32"), help="vLLM's --dtype (weights, KV)"
    )

    p = add(
        "diagnose",
        "explain a vLLM log: failure class, phase, evidence and its line, numbers, next step",
        epilog=DIAGNOSE_EXIT_CODES_HELP,
    )
    p.add_argument("file", metavar="FILE|-", help="log file, or - for standard input")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = add(
        "status",
        "the served models (like ollama ps), the daemon's state and events, saved profiles",
        epilog=STATUS_EXIT_CODES_HELP,
    )
    p.add_argument("--config", "-c", metavar="FILE", help="config whose state.dir to read")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state directory (default: the config's or /var/lib/r1sup)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="more columns (KV cache, TTFT, launches, profile) and the daemon's events",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )

    p = add(
        "report",
        "the report of a tune or run: attempts, what changed and why, memory per GPU",
        epilog=REPORT_EXIT_CODES_HELP,
    )
    p.add_argument("--config", "-c", metavar="FILE", help="config whose state.dir to read")
    p.add_argument(
        "--state-dir", metavar="DIR", help="state directory (default: the config's or /var/lib/r1sup)"
    )
    p.add_argument("--run", metavar="ID", help="which run (an id or its start; default: the newest)")
    p.add_argument("--html", metavar="FILE", help="write one self-contained HTML page to FILE (- for stdout)")
    p.add_argument("--json", action="store_true", help="print the run record as JSON")
    p.add_argument("--list", action="store_true", help="list the run records")

    p = add(
        "check",
        "validate a config, run the preflight and print the effective settings",
        epilog=CHECK_EXIT_CODES_HELP,
    )
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the settings as JSON")
    p.add_argument(
        "--no-preflight",
        action="store_true",
        help="validate the file only: do not run server.python, look for the model or check the port",
    )

    p = add(
        "profile",
        "export, import or gate a tuned profile for identical boxes",
        epilog=PROFILE_GROUP_EXIT_CODES_HELP,
    )
    psub = p.add_subparsers(dest="profile_command", metavar="ACTION", parser_class=_Parser)
    psub.required = True
    pe = psub.add_parser(
        "export",
        help="write the profile matching this box and config to FILE",
        epilog=PROFILE_EXIT_CODES_HELP,
        formatter_class=_Formatter,
    )
    _add_config_args(pe)
    pe.add_argument("file", metavar="FILE")
    pi = psub.add_parser(
        "import",
        help="install a profile from FILE after checking its fingerprint",
        epilog=PROFILE_EXIT_CODES_HELP,
        formatter_class=_Formatter,
    )
    _add_config_args(pi)
    pi.add_argument("file", metavar="FILE")
    pi.add_argument("--force", action="store_true", help="import even if the fingerprint differs")
    pg = psub.add_parser(
        "gate",
        help="publish this box's tuned profile to the fleet's store if its verified capacity is at least "
        "that of the store's profile for the previous image; else exit 8 with both side by side",
        epilog=PROFILE_GATE_EXIT_CODES_HELP,
        formatter_class=_Formatter,
    )
    _add_config_args(pg)
    pg.add_argument("--store", metavar="DIR", help="the fleet's store (default: state.profile_store)")

    p = add(
        "tiny-model",
        "write the tiny dummy-weight model used by the demo and the tests",
        epilog=TINY_MODEL_EXIT_CODES_HELP,
    )
    p.add_argument("dir", metavar="DIR")
    return parser


# command name -> module in r1sup.cli.commands with a ``main(args) -> int``
COMMANDS = {
    "run": "run",
    "tune": "tune",
    "worker": "worker",
    "plan": "plan",
    "diagnose": "diagnose",
    "status": "status",
    "report": "report",
    "check": "check",
    "profile": "profile",
    "tiny-model": "tinymodel",
}


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--set``/``--state-dir``/``--strategy`` as dotted settings."""
    from r1sup.core import config as cfg

    overrides: dict[str, Any] = cfg.parse_assignments(getattr(args, "assignments", []) or [])
    if getattr(args, "state_dir", None):
        overrides["state.dir"] = args.state_dir
    if getattr(args, "strategy", None):
        overrides["search.strategy"] = args.strategy
    for name in ("ttft", "itl", "e2e"):
        value = getattr(args, f"slo_{name}_p95_s", None)
        if value is not None:
            overrides[f"slo.{name}_p95_s"] = value
    return overrides


def _add_slo_args(p: argparse.ArgumentParser, then: str) -> None:
    """``--slo-ttft-p95`` / ``--slo-itl-p95`` / ``--slo-e2e-p95`` (tune's and plan's)."""
    for name, what in (
        ("ttft", "time to first token"),
        ("itl", "inter-token latency"),
        ("e2e", "end-to-end time"),
    ):
        p.add_argument(
            f"--slo-{name}-p95",
            type=float,
            metavar="S",
            dest=f"slo_{name}_p95_s",
            help=f"p95 {what} to meet, seconds (same as --set slo.{name}_p95_s=S): {then}",
        )


def load_config(args: argparse.Namespace) -> Any:
    """The config named by ``--config`` (else ``$R1SUP_CONFIG``) with the command line's overrides
    applied. Neither: the settings come from ``R1SUP_*`` variables alone (a container's way), which
    must at least name the model."""
    from r1sup.core import config as cfg
    from r1sup.core.errors import ConfigError

    path = args.config or os.environ.get(CONFIG_ENV) or None
    overrides = cli_overrides(args)
    if path is None and not os.environ.get("R1SUP_MODEL_NAME") and "model.name" not in overrides:
        raise ConfigError(
            "--config",
            f"required (or {CONFIG_ENV}=FILE, or the settings as R1SUP_* variables: R1SUP_MODEL_NAME...)",
        )
    config = cfg.load(path, overrides=overrides)
    if config.renamed:  # one warning each, naming the new key
        from r1sup.adapters import logs
        from r1sup.core.events import ConfigRenamed
        from r1sup.supervision.subscribers import logging_bus

        publish = logging_bus(logs.get_logger(command=args.command)).publish
        for renamed in config.renamed:
            publish(ConfigRenamed(renamed.old, renamed.new, renamed.where))
    return config


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(given[0] if given and given[0] in FAST_COMMANDS else None)
    try:
        args = parser.parse_args(given)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code or 0)

    silent = args.command in SILENT_COMMANDS
    if not silent:
        _configure_logging(args)
    try:
        module = importlib.import_module(f"r1sup.cli.commands.{COMMANDS[args.command]}")
        return int(module.main(args))
    except R1supError as exc:
        if silent:
            _configure_logging(args)  # for the secrets to mask in the message
        from r1sup.adapters import logs

        sys.stderr.write(f"r1sup: error: {logs.mask(str(exc))}\n")
        _termination_message(args, exc.exit_code, str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("r1sup: interrupted\n")
        return EXIT_SIGINT
    except BrokenPipeError:
        return EXIT_INTERNAL
    except Exception as exc:  # a bug: one line naming where, the traceback only at debug
        if silent:
            _configure_logging(args)
        from r1sup.adapters import logs

        fault = InternalError.from_exception(exc)
        sys.stderr.write(f"r1sup: error: {logs.mask(str(fault))}\n")
        if _log_level(args) == "debug":
            sys.stderr.write(logs.mask(fault.trace))
        _termination_message(args, EXIT_INTERNAL, str(fault))
        return EXIT_INTERNAL


def _termination_message(args: argparse.Namespace, code: int, reason: str) -> None:
    """The verdict of a container's main command (run, tune, worker) where Kubernetes reads it. A failure
    before the config was read (a config error) finds the file by R1SUP_DAEMON_TERMINATION_LOG or its
    default; the daemon writes its own failures with the config's daemon.termination_log."""
    if args.command not in ("run", "tune", "worker"):
        return
    from r1sup.adapters import termination

    termination.write(termination.path_from(None), code, reason)


def _log_level(args: argparse.Namespace) -> str:
    return str(
        args.log_level
        or ("warning" if args.command in ("diagnose", "plan", "check", "status", "report") else "info")
    )


def _configure_logging(args: argparse.Namespace) -> None:
    from r1sup.adapters import logs

    env_key = os.environ.get("VLLM_API_KEY")
    # logs always go to stderr, results to stdout: `r1sup tune ... > report.txt` keeps them apart
    logs.configure(
        level=_log_level(args),
        fmt=args.log_format,
        stream=sys.stderr,
        secrets=[env_key] if env_key else [],
        defer=getattr(args, "command", None) in QUIET_COMMANDS,
    )


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
