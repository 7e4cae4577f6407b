"""``static``: run-to-completion batches, the baseline that dynamic batching papers beat.

A batch forms only when nothing runs: the first ``max_num_seqs`` waiting requests (priority, then
FCFS) become its members, and their ids are remembered. Only members are admitted, over as many
steps as the token budget needs to take them all in (chunked prefill), and no other request
joins until every member has finished. A member preempted by recompute is readmitted (it is
still a member); a swapped one resumes through the scheduler's swap-in path.

Padding. A true static batch pads every prompt to the batch's longest and keeps decoding every
row until the longest output is done, so each row occupies S_pad = max_i p_i + max_i o_i
positions. ``state()`` reports the waste such a batch would have, BucketServe's Eq. 2 with
S_max := S_pad: (S_pad - S_avg) / S_pad, S_avg = mean_i (p_i + o_i), and the padded token slots
N * S_pad - sum_i (p_i + o_i).

``static.pad`` (default off) says whether that padding is computed. Off: each request advances
only its own tokens and a finished request leaves at once, so the baseline keeps the
run-to-completion *admission* of static batching without its padding compute (stronger than true
static batching). On (the UELLM-like padded baseline BucketServe compares against): every step
is a rectangle, each row as long as the step's longest chunk and every finished member still a
row until the batch ends (:func:`tidal.core.plan.rectangle_padding`); the plan's
``num_padded_tokens`` says how many tokens that adds; the simulator's cost model charges them and
the engine's runner computes them (``--batching static --policy-arg static.pad=true``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from tidal.config import SchedulerConfig
from tidal.core.plan import ScheduledChunk, StepPlan, StepResult, rectangle_padding
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import Request
from tidal.policies.params import PolicyParams
from tidal.policies.registry import register_policy


def static_padding(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> tuple[float, int]:
    """(waste ratio, padded token slots) of a static batch: Eq. 2 of BucketServe with
    S_max = max(prompt) + max(output), the length every row is padded to."""
    if not prompt_lens:
        return 0.0, 0
    s_pad = max(prompt_lens) + max(output_lens)
    used = sum(prompt_lens) + sum(output_lens)
    total = s_pad * len(prompt_lens)
    return (total - used) / total if total else 0.0, total - used


class StaticParams(PolicyParams):
    pad: bool = Field(False, description="compute the padding of a static batch (UELLM-like padded baseline)")
    group: Literal["fcfs", "length"] = Field(
        "fcfs", description="a batch's members: the oldest waiting (fcfs), or the oldest and those closest to it "
                            "in predicted length, prompt + max_tokens (length: UELLM's length-grouped batches)")


def _fcfs(r: Request) -> tuple:
    return (r.priority, r.arrival_time)


def _length(r: Request) -> int:
    """A request's predicted length: its prompt and what it may generate (max_tokens; the prompt alone without one)."""
    return r.num_prompt_tokens + (r.sampling_params.max_tokens or 0)


@dataclass(frozen=True, slots=True)
class StaticState(PolicyState):
    num_batches: int = 0
    batch_size: int = 0
    batch_active: bool = False
    batch_unfinished: int = 0
    padding_waste: float = 0.0  # of the current batch so far (the last one when idle)
    padded_tokens: int = 0
    padding_waste_mean: float = 0.0  # over completed batches
    completed_batches: int = 0


class StaticPolicy(SchedulingPolicy):
    name = "static"

    def __init__(self, params: StaticParams | None = None) -> None:
        params = params or StaticParams()
        self.pad, self.group = params.pad, params.group
        self.members: list[Request] = []  # the current (or last) batch, in admission order
        self._ids: set[str] = set()
        self._unfinished: set[str] = set()  # members that have not finished (on_finished removes them)
        self._done = True  # the last batch's padding is folded into the mean
        self.num_batches = 0
        self._waste_sum = 0.0

    @property
    def batch_active(self) -> bool:
        return bool(self._unfinished)

    def _close(self) -> None:
        if self.members and not self._done and not self.batch_active:
            self._waste_sum += self._padding()[0]
            self._done = True

    def _padding(self) -> tuple[float, int]:
        return static_padding([r.num_prompt_tokens for r in self.members],
                              [r.num_output_tokens for r in self.members])

    # ---------------------------------------------------------------- SchedulingPolicy
    def plan_step(self, view: SchedulerView) -> StepCaps:
        """A new batch forms only when the last one finished and nothing runs."""
        if not self.batch_active and not view.running and view.waiting:
            self._close()
            self.members = self._pick(view.waiting, view.max_num_seqs)
            self._ids = {r.request_id for r in self.members}
            self._unfinished = set(self._ids)
            self._done = False
            self.num_batches += 1
        return StepCaps()

    def _pick(self, waiting: Sequence[Request], n: int) -> list[Request]:
        """The next batch: the first ``n`` by FCFS, or (``group=length``, UELLM's grouping of requests
        by predicted length) the oldest request and the ``n - 1`` closest to it in prompt +
        max_tokens, so a padded batch pads little and the oldest never starves."""
        if self.group == "fcfs":
            return sorted(waiting, key=_fcfs)[:n]
        anchor = _length(min(waiting, key=_fcfs))
        return sorted(sorted(waiting, key=lambda r: (abs(_length(r) - anchor), _fcfs(r)))[:n], key=_fcfs)

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request]:
        """The batch's members that wait, FCFS. The others are left out: ``admit`` refuses them,
        and a long queue is then neither sorted nor walked each step."""
        ids = self._ids
        return sorted([r for r in waiting if r.request_id in ids], key=_fcfs)

    def admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        return request.request_id in self._unfinished

    def padded_tokens(self, chunks: Sequence[ScheduledChunk]) -> int:
        """With ``static.pad``: the step as a rectangle, with a dead row for each finished member."""
        if not self.pad:
            return 0
        return rectangle_padding(list(chunks), len(self.members) - len(self._unfinished))

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        self._close()

    def on_finished(self, request: Request) -> None:
        self._unfinished.discard(request.request_id)

    def state(self) -> StaticState:
        waste, padded = self._padding()
        completed = self.num_batches - (0 if self._done else 1)
        return StaticState(
            self.name, num_batches=self.num_batches, batch_size=len(self.members), batch_active=self.batch_active,
            batch_unfinished=len(self._unfinished), padding_waste=waste, padded_tokens=padded,
            padding_waste_mean=self._waste_sum / completed if completed else 0.0, completed_batches=completed)


@register_policy("static", params=StaticParams)
def _static(config: SchedulerConfig, params: StaticParams) -> SchedulingPolicy:
    return StaticPolicy(params)
