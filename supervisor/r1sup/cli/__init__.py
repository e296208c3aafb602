"""The command line: ``r1sup ...``.

``app.main(argv) -> int`` parses the arguments and runs one module of ``commands`` (one per command,
imported only when it runs); ``report`` renders a run record. The cli may import every other layer;
nothing imports the cli.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``r1sup`` command: :func:`r1sup.cli.app.main` (kept here for ``r1sup.cli:main``)."""
    from r1sup.cli.app import main as app_main

    return app_main(argv)
