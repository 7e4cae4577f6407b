"""The metric names the Grafana dashboard (deploy/grafana/tidal.json) queries, and the names a
server's /metrics exposes (every sample name a family can have, also for a family with no sample
yet, e.g. a labelled counter nothing incremented)."""

from __future__ import annotations

import json
import os
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "tidal.json")
PROMETHEUS = os.path.join(ROOT, "deploy", "prometheus.yml")
NAME_RE = re.compile(r"(?<![A-Za-z0-9_:])(tidal:[A-Za-z0-9_:]+|process_[A-Za-z0-9_]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
            "gauge": ("",), "untyped": ("",), "info": ("_info",)}


def load_dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def queries(dash: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the template variables' queries."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def metric_names(expr: str) -> set[str]:
    return set(NAME_RE.findall(expr))


def exposed(url: str) -> set[str]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    names: set[str] = set()
    for fam in text_string_to_metric_families(r.text):
        names.update(fam.name + s for s in SUFFIXES.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def sampled(url: str) -> set[str]:
    """The sample names of /metrics that have at least one sample (what a Grafana panel shows)."""
    r = httpx.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    return {s.name for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def unsampled_queries(url: str) -> set[str]:
    """The dashboard's metrics that the server at ``url`` has no sample of (a panel with "no data")."""
    names = set().union(*map(metric_names, queries(load_dashboard())))
    return names - sampled(url)
