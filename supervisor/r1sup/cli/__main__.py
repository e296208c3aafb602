"""``python -m r1sup.cli``: the ``r1sup`` command."""

import sys

from r1sup.cli.app import main

sys.exit(main())
