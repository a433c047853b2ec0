"""`python -m basis_lite ...` runs the basis-lite command line."""
import sys

from .cli import main

sys.exit(main())
