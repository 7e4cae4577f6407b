"""The simulator (profiled CPU cost model) against the real engine at two loads: same as
``tidal bench sim-accuracy``. Run ``tidal profile`` first; on a shared machine profile and compare
with one thread (``tidal profile --num-threads 1``): two threads wait on each other at every
barrier, so a neighbour's load moves their speed by 15-35% between minutes."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim-accuracy", *sys.argv[1:]]))
