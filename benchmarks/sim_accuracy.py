"""The simulator (profiled CPU cost model) against the real engine at two loads: same as
``tidal bench sim-accuracy``. Run ``tidal profile`` first."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim-accuracy", *sys.argv[1:]]))
