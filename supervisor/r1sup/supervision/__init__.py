"""Supervision: the loop and everything it drives.

The one loop and its phases, the runner (one launch: start, watch, probe, stop), the tuner (the
bring-up's search shell) and its footing (what a search starts from), the daemon, the bus and its
subscribers (the only writers of logs, status.json, metrics and sd_notify), and the session wiring
shared by ``tune`` and ``run``.
Supervision may import state, adapters and the core; never ``cli``.
"""
