"""The scheduler keeps the policy contract: one ``plan_step`` per step, before any question;
caps never above the configured ones; ``on_finished`` for every way a request can end."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import FinishReason, Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler


class Recorder(SchedulingPolicy):
    name = "recorder"

    def __init__(self, caps: StepCaps = StepCaps(), reverse: bool = False):
        self.caps, self.reverse = caps, reverse
        self.calls: list[str] = []
        self.finished: list[tuple[str, FinishReason | None]] = []

    def plan_step(self, view: SchedulerView) -> StepCaps:
        self.calls.append("plan")
        return self.caps

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request] | None:
        self.calls.append("order")
        return sorted(waiting, key=lambda r: r.arrival_time, reverse=True) if self.reverse else None

    def admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        self.calls.append("admit")
        return True

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        self.calls.append("observe")

    def on_finished(self, request: Request) -> None:
        self.finished.append((request.request_id, request.finish_reason))


def make(policy: SchedulingPolicy, blocks: int = 64, **cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, **cfg})
    return Scheduler(config, KVCacheManager(blocks, 4), policy=policy, watermark=0.0)


def req(rid: str, n: int = 6, max_tokens: int = 3, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival)


def run_step(s: Scheduler, now: float = 0.0) -> StepPlan:
    plan = s.schedule(now)
    s.update(plan, StepResult(plan.step_id, sampled={c.request_id: 9 for c in plan.chunks if c.sample}), now)
    return plan


def test_plan_step_comes_once_and_first_then_questions_then_observe():
    pol = Recorder()
    s = make(pol)
    for i in range(3):
        s.add_request(req(f"r{i}", arrival=float(i)))
    for _ in range(5):
        pol.calls.clear()
        run_step(s)
        assert pol.calls[0] == "plan" and pol.calls.count("plan") == 1
        assert pol.calls[-1] == "observe" and pol.calls.count("observe") == 1


def test_caps_are_the_tighter_of_the_policy_and_the_config():
    s = make(Recorder(StepCaps(max_num_seqs=2, token_budget=1000)))
    for i in range(4):
        s.add_request(req(f"r{i}"))
    plan = run_step(s)
    assert s.last_caps == StepCaps(2, 64)  # the policy's 1000 tokens cannot lift the configured 64
    assert len(plan.chunks) == 2 and s.num_running == 2


def test_no_opinion_falls_back_to_priority_then_fcfs_and_an_opinion_wins():
    s = make(Recorder(), max_num_seqs=1)
    s.add_request(req("late", arrival=2.0))
    s.add_request(req("early", arrival=1.0))
    assert [c.request_id for c in run_step(s).chunks] == ["early"]
    s = make(Recorder(reverse=True), max_num_seqs=1)
    s.add_request(req("early", arrival=1.0))
    s.add_request(req("late", arrival=2.0))
    assert [c.request_id for c in run_step(s).chunks] == ["late"]


@pytest.mark.parametrize("how", ["length", "abort_waiting", "abort_running", "stop_string", "pool"])
def test_on_finished_hears_every_way_a_request_ends(how):
    pol = Recorder()
    s = make(pol, blocks=3 if how == "pool" else 64)
    s.add_request(req("a", n=6, max_tokens=3 if how != "pool" else 100))
    if how == "abort_waiting":
        s.abort_requests(["a"])
        assert pol.finished == [("a", FinishReason.ABORT)]
        return
    for _ in range(20):
        if not s.has_unfinished():
            break
        run_step(s)
        if how == "abort_running":
            s.abort_requests(["a"])
        elif how == "stop_string":
            s.finish_request("a", FinishReason.STOP, stop_reason="###")
    expected = {"length": FinishReason.LENGTH, "abort_running": FinishReason.ABORT,
                "stop_string": FinishReason.STOP, "pool": FinishReason.LENGTH}[how]
    assert pol.finished == [("a", expected)]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_policy_state_is_typed_frozen_and_serializes():
    st = PolicyState("recorder")
    assert st.to_dict() == {"policy": "recorder"} and st.gauges() == []
    with pytest.raises(AttributeError):
        st.policy = "other"  # type: ignore[misc]
