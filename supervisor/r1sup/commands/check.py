"""``r1sup check``: validate a config and print the effective settings."""

from __future__ import annotations

import argparse
import json
import sys

from r1sup import config as cfg
from r1sup.cli import load_config


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    rows = cfg.describe(config)
    if args.json:
        out: dict[str, dict[str, object]] = {}
        for dotted, value, _ in rows:
            section, _, key = dotted.partition(".")
            out.setdefault(section, {})[key] = value
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return 0
    sys.stdout.write(f"# {config.source}: valid\n")
    width = max(len(dotted) for dotted, _, _ in rows)
    for dotted, value, help_text in rows:
        sys.stdout.write(f"{dotted:<{width}} = {_toml(value):<28} # {help_text}\n")
    return 0


def _toml(value: object) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)
