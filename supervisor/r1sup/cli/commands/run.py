"""``r1sup run``: the supervisor daemon (systemd Type=notify)."""

from __future__ import annotations

import argparse

from r1sup.cli.app import cli_overrides, load_config
from r1sup.core.multinode import check_leader
from r1sup.supervision.daemon import Daemon
from r1sup.supervision.session import open_session


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    check_leader(config.multinode, "run")
    session = open_session(args, config, overrides=cli_overrides(args))
    return Daemon(session).run()
