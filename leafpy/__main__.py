"""``python -m leafpy``: the ``leafpy`` command (train, evaluate, predict, summary)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
