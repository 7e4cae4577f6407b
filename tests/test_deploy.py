"""deploy/: the Ray cluster config of docs/deploy.md is a valid `ray up` config (Ray's own schema),
with token authentication on every node, one GPU node type and the head kept free of instances;
docs/deploy.md names the files it tells the reader to use."""

from __future__ import annotations

import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_ray_cluster_config_is_valid_for_ray_up():
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from ray.autoscaler._private.util import prepare_config, validate_config

    with open(os.path.join(ROOT, "deploy", "ray-cluster.yaml")) as f:
        cfg = yaml.safe_load(f)
    validate_config(prepare_config(cfg))  # raises on any field Ray's schema does not know or a wrong type
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if " start " in c)
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"CPU": 0}


def test_the_deploy_page_names_files_that_exist():
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        page = f.read()
    for path in ("deploy/ray-cluster.yaml", "deploy/prometheus.yml", "deploy/grafana/tidal.json"):
        assert path in page and os.path.exists(os.path.join(ROOT, path)), path
