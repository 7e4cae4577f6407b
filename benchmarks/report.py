"""docs/performance.md and the README's performance table from the result JSON in
benchmarks/results/: same as ``tidal bench report``; extra arguments go to it (e.g. ``--check``)."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "report", *sys.argv[1:]]))
