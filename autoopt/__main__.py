"""``python -m autoopt``: the same command as ``autoopt``."""

import sys

from autoopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
