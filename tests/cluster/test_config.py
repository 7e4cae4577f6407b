"""The cluster's one config tree (tidal.cluster.config): each bad value or combination is a
one-line ConfigError at construction; a worker's engine config is its role's, as an object."""

from __future__ import annotations

import pickle

import pytest

from tidal.cluster.config import ClusterConfig, ServingConfig
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import ConfigError, EngineConfig


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"router": "fastest"}, "router must be one of"),
    ({"backend": "k8s"}, "backend must be one of"),
    ({"transport": "tcp"}, "kv transport must be one of"),
    ({"threads_per_instance": 0}, "threads per instance must be > 0"),
    ({"layers_per_chunk": -1}, "per KV chunk must be >= 0"),
    ({"start_timeout_s": 0}, "start timeout must be > 0"),
    ({"kv_pressure": "evict"}, "--kv-pressure must be one of"),
    ({"kv_pressure": "drop"}, "needs at least 2 instances"),
    ({"kv_pressure": "migrate", "layout": ClusterLayout(2, "disaggregate", 1)}, "needs colocated instances"),
    ({"backend": "ray", "ray_placement": "scatter"}, "--ray-placement must be one of"),
    ({"backend": "ray", "num_gpus_per_instance": -1}, "--num-gpus-per-instance must be >= 0"),
    ({"num_gpus_per_instance": 1}, "--num-gpus-per-instance reserves GPUs for Ray actors: it needs --backend ray"),
])
def test_a_bad_cluster_config_is_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClusterConfig(**kwargs)


def test_the_tree_checks_each_roles_policy_and_the_model_once_known():
    engine = EngineConfig.from_kwargs(batching="bucket", policy_args=["bucket.theta=0.3"])
    with pytest.raises(ConfigError, match="--prefill-batching needs --mode disaggregate"):
        ServingConfig(engine, ClusterConfig(layout=ClusterLayout(2), prefill_batching="bucket"))
    with pytest.raises(ConfigError):
        ServingConfig(EngineConfig.from_kwargs(batching="no-such-policy"), ClusterConfig())
    cfg = ServingConfig(EngineConfig(), ClusterConfig(layout=ClusterLayout(2), kv_pressure="drop"))
    cfg.check_model(30)
    with pytest.raises(ConfigError, match="this one has 1 layer"):
        cfg.check_model(1)


def test_each_worker_gets_its_roles_engine_config_as_an_object():
    engine = EngineConfig.from_kwargs(dtype="auto", batching="continuous",
                                      policy_args=["bucket.theta=0.3"])
    cfg = ServingConfig(engine, ClusterConfig(layout=ClusterLayout(3, "disaggregate", 1), prefill_batching="bucket"))
    pre = cfg.engine_for("prefill", dtype="float32", num_threads=2)
    dec = cfg.engine_for("decode", dtype="float32", num_threads=2)
    assert pre.scheduler.batching == "bucket" and pre.scheduler.policy_args == {"bucket.theta": "0.3"}
    assert dec.scheduler.batching == "continuous" and dec.scheduler.policy_args == {}  # not its policy's
    assert pre.model.dtype == dec.model.dtype == "float32" and pre.model.num_threads == 2
    assert engine.model.dtype == "auto"  # the tree itself is unchanged
    assert pickle.loads(pickle.dumps(pre)) == pre  # what crosses to the worker


def test_kv_blocks_size_each_instance_pool_and_are_checked():
    cfg = ServingConfig(EngineConfig(), ClusterConfig(layout=ClusterLayout(2, "split"), kv_blocks=(64, 8)))
    assert [cfg.engine_for("colocate", i).cache.num_blocks_override for i in (0, 1)] == [64, 8]
    assert cfg.engine_for("colocate").cache.num_blocks_override is None  # no index: the engine's own sizing
    for bad in ((64,), (64, 0)):
        with pytest.raises(ConfigError, match="one positive block count per instance"):
            ClusterConfig(layout=ClusterLayout(2, "split"), kv_blocks=bad)
