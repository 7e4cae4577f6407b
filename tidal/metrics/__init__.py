"""Serving metrics, defined once (pure): request records, SLOs, summaries, goodput, capacity search.

``tidal bench serve`` (a real load test) and ``tidal sim`` (the simulator) fill the same
:class:`RequestRecord` and summarize it with the same functions, so their figures mean the same.
"""

from tidal.metrics.capacity import CapacitySearch, Probe
from tidal.metrics.serving import (
    PERCENTILES,
    SLO,
    RequestRecord,
    SLOError,
    attains,
    benchmark_duration,
    distribution,
    in_flight_series,
    itl_from_chunks,
    parse_slo,
    slo_checks,
    summarize,
    tpot,
)

__all__ = [
    "PERCENTILES", "SLO", "CapacitySearch", "Probe", "RequestRecord", "SLOError", "attains",
    "benchmark_duration", "distribution", "in_flight_series", "itl_from_chunks", "parse_slo",
    "slo_checks", "summarize", "tpot",
]
