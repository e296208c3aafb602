"""``r1sup tiny-model DIR``: write the tiny dummy-weight model for the demo and tests."""

from __future__ import annotations

import argparse
import sys

from r1sup.adapters.tinymodel import write_tiny_model


def main(args: argparse.Namespace) -> int:
    path = write_tiny_model(args.dir)
    sys.stdout.write(f"tiny model written to {path}\n")
    return 0
