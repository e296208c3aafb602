"""``python -m fakevllm`` (tests/ on PYTHONPATH) or ``python tests/fakevllm/__main__.py``."""

import os
import sys

if __package__ in (None, ""):
    # Run as a file path: make the parent of this directory importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakevllm.engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
