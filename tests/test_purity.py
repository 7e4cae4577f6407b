"""The decision core stays pure: no torch, no clocks, no threads (the import-linter layer and
purity contracts run in ``make lint``).

``tidal.core`` and ``tidal.policies`` run unchanged inside the simulator, so they must not
import torch (nor any engine layer), read a clock (``now`` is always an argument) or start
threads. numpy would be allowed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PURE_PACKAGES = ("tidal/core", "tidal/policies", "tidal/cluster", "tidal/metrics", "tidal/workload")
# the simulator runs on a virtual clock: all of it but its CLI driver (wall time, progress, plots)
PURE_SIM_FILES = ("tidal/sim/loop.py", "tidal/sim/instance.py", "tidal/sim/simulator.py", "tidal/sim/build.py",
                  "tidal/sim/cost_model.py", "tidal/sim/analytic.py", "tidal/sim/profiled.py",
                  "tidal/sim/hardware.py", "tidal/sim/models.py", "tidal/sim/pressure.py", "tidal/sim/migrate.py",
                  "tidal/sim/kunserve.py", "tidal/sim/pipeline.py")
PURE_MODULE_PREFIXES = ("tidal.core", "tidal.policies", "tidal.config", "tidal.metrics",
                        "tidal.workload", "tidal.cluster", "tidal.sim")
BANNED_TIME = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns"}
BANNED_MODULES = {"threading", "_thread"}


def test_importing_pure_packages_does_not_import_torch_or_engine():
    code = (
        "import json, sys\n"
        "import tidal.core, tidal.policies, tidal.config\n"
        "import tidal.metrics, tidal.workload\n"
        "import tidal.sim.build, tidal.sim.profiled, tidal.cluster.router\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'tidal')))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")], loaded
    impure = [m for m in loaded if m != "tidal" and not m.startswith(PURE_MODULE_PREFIXES)]
    assert not impure, f"pure packages pulled in {impure}"


def impurities(source: str, filename: str = "<src>") -> list[str]:
    """Clock reads and thread imports in ``source`` (by AST, so comments and strings don't count)."""
    tree = ast.parse(source, filename)
    time_aliases: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                root = a.name.split(".")[0]
                if root in BANNED_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
                if a.name == "time":
                    time_aliases.add(a.asname or "time")
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            if mod in BANNED_MODULES:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            if node.module == "time":
                for a in node.names:
                    if a.name in BANNED_TIME or a.name == "*":
                        found.append(f"{filename}:{node.lineno}: from time import {a.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in BANNED_TIME
                and isinstance(node.value, ast.Name) and node.value.id in time_aliases):
            found.append(f"{filename}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def _pure_sources() -> list[Path]:
    files = [p for pkg in PURE_PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    files += [REPO / f for f in PURE_SIM_FILES]
    assert files, "no sources found"
    return files


@pytest.mark.parametrize("path", _pure_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_pure_sources_read_no_clock_and_start_no_threads(path: Path):
    assert impurities(path.read_text(), str(path.relative_to(REPO))) == []


def test_impurity_scanner_catches_what_it_should():
    bad = (
        "import time\nimport threading\nfrom time import monotonic\nimport time as t\n"
        "from concurrent import futures\nfrom threading import Lock\n"
        "def f(clock=time.perf_counter):\n    return time.time() + t.monotonic()\n"
    )
    found = impurities(bad)
    assert len(found) == 6, found
    ok = "import time\n# time.time()\nx = 'time.monotonic'\ntime.sleep(0)\n"
    assert impurities(ok) == []
