"""The batching policies at cluster scale in the simulator, on the papers' setups: same as
``tidal bench sim-policies``."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim-policies", *sys.argv[1:]]))
