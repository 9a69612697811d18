"""`python -m sparkdl train|demo ...`: the same as the `sparkdl` console script."""
from __future__ import annotations

import sys

from sparkdl.cli import main

if __name__ == "__main__":
    sys.exit(main())
