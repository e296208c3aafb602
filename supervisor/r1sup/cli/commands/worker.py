"""``r1sup worker``: a node of a multi-node group other than the leader's (multinode.backend = "mp")."""

from __future__ import annotations

import argparse

from r1sup.cli.app import load_config
from r1sup.supervision.worker import Worker


def main(args: argparse.Namespace) -> int:
    return Worker(load_config(args)).run()
