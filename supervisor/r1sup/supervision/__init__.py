"""Supervision: the loop and everything it drives.

The one loop and its phases, the runner (one launch: start, watch, stop), a launch's record and phases
(``launch``), the load probe (``prober``), the tuner (the bring-up's search shell), its footing (what a
search starts from) and what a passed configuration leaves (``bringup``), the daemon with its state
table (``states``) and serving phases (``serving``), the bus and its subscribers (the only writers of
logs, status.json, metrics and sd_notify), and the session wiring shared by ``tune`` and ``run``.
Supervision may import state, adapters and the core; never ``cli``.
"""
