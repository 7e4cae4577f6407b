"""Measuring tools a user points at any server or engine: ``tidal bench serve`` (the load client),
``soak``, ``offline`` (tidal against its peers), ``kv-transfer``, ``report`` (the performance page
from result JSON) and ``tidal profile``. The papers' experiments are :mod:`tidal.experiments`."""
