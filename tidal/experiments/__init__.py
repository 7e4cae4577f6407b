"""The papers' experiments: ``tidal reproduce`` and its per-paper modules (``repro_*``), the
simulator experiments (``sim_*``: ``tidal bench sim-policies``, ``sim-kunserve``, ``sim-dynaserve``,
``sim-accuracy``), the real-engine drivers (``*_real``, ``policies``: ``tidal bench policies``) and
the cost model's calibration (``tidal bench calibrate``).

They drive the simulator, the engine and ``tidal serve`` processes to reproduce a figure; the
measuring tools a user points at any server or engine (``tidal bench serve``, ``soak``, ``offline``,
``kv-transfer``, ``tidal profile``) are :mod:`tidal.bench`, one layer below.
"""
