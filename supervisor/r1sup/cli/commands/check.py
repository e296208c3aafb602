"""``r1sup check``: validate a config, run the preflight, print the effective settings."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from r1sup.cli.app import load_config
from r1sup.core import config as cfg
from r1sup.core.errors import EXIT_FATAL_FAILURE, PreflightError


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    found: dict[str, Any] | None = None
    if not args.no_preflight:
        found = _preflight(config)
    rows = cfg.describe(config)
    if args.json:
        out: dict[str, Any] = {}
        for dotted, value, _ in rows:
            section, _, key = dotted.partition(".")
            out.setdefault(section, {})[key] = value
        if found is not None:
            out["preflight"] = found
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    sys.stdout.write(f"# {config.source}: valid\n")
    if found is not None:
        engine = found["engine"]
        sys.stdout.write(
            f"# server.python {engine['python']}: {engine['package'] or 'vllm'} {engine['version'] or '?'}, "
            f"torch {engine['torch_version'] or '?'} ({engine['seconds']:.1f}s)\n"
            f"# model.name: {found['model']}\n"
            f"# server.port: {found['port']}\n"
        )
    width = max(len(dotted) for dotted, _, _ in rows)
    for dotted, value, help_text in rows:
        sys.stdout.write(f"{dotted:<{width}} = {_toml(value):<28} # {help_text}\n")
    return 0


def _preflight(config: cfg.Config) -> dict[str, Any]:
    from dataclasses import asdict

    from r1sup.adapters import preflight

    result = preflight.run(config)
    free, port = preflight.port_report(config)
    if not free:
        raise PreflightError("server.port", port, EXIT_FATAL_FAILURE)
    return {"engine": asdict(result.engine), "model": result.model.describe(), "port": port}


def _toml(value: object) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)
