"""Workloads (pure): request specs, length shapes from the papers, arrivals, trace and dataset readers.

``make_requests`` gives lengths and arrival times (all the simulator needs); ``materialize`` turns
them into prompts of exactly those lengths for a tokenizer (what a load test sends).
"""

from tidal.workload.requests import *  # noqa: F403
from tidal.workload.requests import __all__  # noqa: F401
