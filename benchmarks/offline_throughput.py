#!/usr/bin/env python
"""Offline throughput of tidal vs transformers (generate, generate_batch) and llama.cpp.

``python benchmarks/offline_throughput.py ARGS`` is the same as ``tidal bench offline ARGS``;
see ``tidal/bench/offline.py`` for what is measured and how.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    from tidal.bench.offline import main

    sys.exit(main())
