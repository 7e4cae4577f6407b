"""Typed policy parameters: every bad ``--batching`` / ``--policy-arg`` is one line naming the problem."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tidal.config import ConfigError, SchedulerConfig
from tidal.policies import available_policies, build_policy, check_policy, policy_params
from tidal.policies.bucket import BucketPolicy
from tidal.policies.memory import MemoryPolicy
from tidal.policies.sla import SLAPolicy


def cfg(batching: str, **args) -> SchedulerConfig:
    return SchedulerConfig(batching=batching, tbt_slo_ms=50, policy_args=args)


def error(batching: str, **args) -> str:
    with pytest.raises(ConfigError) as e:
        check_policy(cfg(batching, **args))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_unknown_policy_names_the_choices():
    msg = error("nope")
    assert "unknown policy 'nope'" in msg and all(n in msg for n in available_policies())
    assert "unknown policy 'nope'" in error("bucket+nope")
    assert "twice" in error("sla+sla")


def test_unknown_parameter_names_it_and_the_known_ones():
    msg = error("sla", **{"sla.alpah": "8"})
    assert msg.startswith("policy argument sla.alpah: unknown parameter of 'sla'")
    assert "alpha" in msg and "window" in msg


def test_out_of_range_values_name_the_parameter_and_the_bound():
    msg = error("memory", **{"memory.eps_m": "2"})
    assert msg.startswith("policy argument memory.eps_m=2:") and "less than 1" in msg
    assert "bucket.theta=1.5" in error("bucket", **{"bucket.theta": "1.5"})
    assert "sla.alpha=0" in error("sla", **{"sla.alpha": 0})
    assert "sla.window=4.5" in error("sla", **{"sla.window": "4.5"})  # an int parameter
    assert "offline_order" in error("bucket", **{"bucket.offline_order": "random"})


def test_arguments_must_name_a_policy_that_runs():
    assert "policy 'sla' is not in batching 'bucket'" in error("bucket", **{"sla.alpha": 4})
    assert "unknown policy 'slaa'" in error("sla", **{"slaa.alpha": 4})
    assert "expected POLICY.PARAMETER" in error("sla", alpha=4)


def test_cross_field_checks_against_the_scheduler_config():
    with pytest.raises(ConfigError, match=r"memory.b_min=9: must be <= max_num_seqs \(8\)"):
        build_policy(SchedulerConfig(batching="memory", max_num_seqs=8, policy_args={"memory.b_min": 9}))
    with pytest.raises(ConfigError, match="needs a decode-latency SLO"):
        build_policy(SchedulerConfig(batching="sla"))


def test_cli_strings_are_coerced_to_the_declared_types():
    pol = build_policy(cfg("bucket+memory+sla", **{"bucket.theta": "0.25", "bucket.offline_order": "LJF",
                                                   "memory.l0_every": "3", "sla.alpha": "8",
                                                   "sla.d_sla_ms": "30"}))
    bucket, memory, sla = pol.parts
    assert isinstance(bucket, BucketPolicy) and (bucket.theta, bucket.offline_order) == (0.25, "ljf")
    assert isinstance(memory, MemoryPolicy) and memory.l0_every == 3
    assert isinstance(sla, SLAPolicy) and sla.alpha == 8 and sla.d_sla == pytest.approx(0.030)


@pytest.mark.parametrize("name", available_policies())
def test_every_policy_declares_frozen_defaults(name):
    params = policy_params(name)()  # every parameter has a default
    for field in type(params).model_fields:
        with pytest.raises(ValidationError, match="frozen"):
            setattr(params, field, getattr(params, field))
    check_policy(cfg(name))  # and the defaults build


def test_the_engine_checks_the_policy_before_loading_weights(monkeypatch):
    from tidal.config import EngineConfig
    from tidal.engine import llm_engine

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the policy was checked")

    monkeypatch.setattr(llm_engine, "load_checkpoint", no_load)
    bad = EngineConfig.from_kwargs(batching="sla", policy_args=["sla.alpah=8"], device="cpu")
    with pytest.raises(ConfigError, match="sla.alpah"):
        llm_engine.LLMEngine(bad)


def test_usage_page_lists_every_parameter_of_every_policy():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    readme = readme[readme.index("| policy | parameters (defaults) |"):]
    for name in available_policies():
        fields = set(policy_params(name).model_fields)
        row = re.search(rf"^\| `{re.escape(name)}` \| (.*) \|$", readme, re.M)
        if not fields:
            continue
        assert row, f"docs/usage.md has no parameter row for {name}"
        assert set(re.findall(r"`(\w+)`", row.group(1))) == fields, name
