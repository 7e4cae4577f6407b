"""``pad_prefill``: a prefill-first step of prompts runs as a padded rectangle (BucketServe Eq. 1's
S_max x N), counted in the plan; decode steps are never padded; the simulator charges it."""

from __future__ import annotations

import pytest

from tests.core.test_scheduler import Driver, make_request
from tidal.config import ConfigError, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.scheduler import Scheduler


def _sched(budget: int = 256, **kw) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, scheduling="prefill-first", **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks=2048, block_size=4), watermark=0.0)


def test_a_prefill_step_is_padded_to_its_longest_prompt_and_a_decode_step_is_not():
    d = Driver(_sched(pad_prefill=True))
    for rid, n in (("a", 10), ("b", 30), ("c", 7)):
        d.add(make_request(rid, n, max_tokens=3))
    d.run()
    first = d.plans[0]
    assert sorted(c.num_tokens for c in first.chunks) == [7, 10, 30]
    assert first.composition.num_padded_tokens == (30 - 10) + (30 - 7)
    assert all(p.composition.num_padded_tokens == 0 for p in d.plans if all(c.is_decode for c in p.chunks))
    plain = Driver(_sched())
    for rid, n in (("a", 10), ("b", 30), ("c", 7)):
        plain.add(make_request(rid, n, max_tokens=3))
    plain.run()
    assert [p.composition.num_padded_tokens for p in plain.plans] == [0] * len(plain.plans)
    assert d.outputs == plain.outputs


def test_padding_needs_prefill_first_steps():
    with pytest.raises(ConfigError, match="prefill-first"):
        SchedulerConfig(pad_prefill=True)


def test_the_simulator_charges_the_padding():
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware
    from tidal.sim.models import get_model

    cm = AnalyticCostModel(get_model("llama-2-13b"), get_hardware("a100-40g"))
    pad, plain = _sched(4096, pad_prefill=True), _sched(4096)
    for s in (pad, plain):
        for rid, n in (("a", 40), ("b", 2000), ("c", 60)):
            s.add_request(make_request(rid, n, max_tokens=3))
    p_pad, p_plain = pad.schedule(0.0), plain.schedule(0.0)
    assert p_pad.composition.num_padded_tokens == 2 * 2000 - 100
    # three rows of 2,000 tokens against 2,100 tokens: at least twice the work
    assert cm.step_time(p_pad) > 2 * cm.step_time(p_plain)
