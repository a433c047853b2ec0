#!/usr/bin/env python
"""`python cli.py ...` from a source checkout: the same command line as the installed `basis-lite`.

The command line itself lives in `basis_lite/cli.py` (installed as the `basis-lite` console script and runnable as
`python -m basis_lite`); this file only puts the checkout on `sys.path` and hands over.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from basis_lite.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
