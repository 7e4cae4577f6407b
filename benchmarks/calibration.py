"""The analytic cost model against published A100 measurements (issue 14): every reference
point of tidal/sim/reference.py (Vidur's A100 profiles, DynaServe Fig. 6) with its error before
and after calibration, the median and max, and the fitted terms. Same as ``tidal bench
calibrate``; extra arguments go to it (e.g. ``--output``)."""

import sys

from tidal.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "calibrate", "--output", "results/calibration.json", *sys.argv[1:]]))
