"""Scheduling policies side by side on the real engine: same as ``tidal bench policies``."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "policies", *sys.argv[1:]]))
