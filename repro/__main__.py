"""``python -m repro <command>``: see :mod:`repro.cli`."""

import sys

from repro.cli import main

if __name__ == "__main__":
    sys.exit(main())
