"""``bucket``: BucketServe's adaptive length buckets and memory-safe batch size.

Zheng et al., "BucketServe: Bucket-Based Dynamic Batching for Smart and Efficient LLM Inference
Serving", Sec. IV (Alg. 1, Eq. 1-6). Waiting requests are grouped into buckets over sequence
length; the layout starts as one bucket ``[0, L_max)``, splits at midpoints under load and
merges back when the queue drains (Alg. 1). Each step's admissions come from one bucket (a
batch is formed from one bucket), and the number of running requests is capped by the
memory-safe batch size N_max (Eq. 5-6).

Choices made here, where the paper leaves room:

* **Bucket key S = the prompt length.** The paper buckets for the *prefill* ("Dynamic Batching
  with Prefill Bucketing", Sec. II-B, e.g. buckets [0-256], [256-1024] of input tokens); output
  lengths are unknown at admission and decode runs under continuous batching. The prompt is the
  only length known exactly, and it is what a padded prefill batch pads. Prompts of ``L_max``
  tokens or more fall in the last bucket.
* **Memory S for N_max = prompt + most output, capped at L_max**
  (``min(request.expected_total_tokens, L_max)``). Eq. 6 bounds the KV a batch holds; in the
  paper's disaggregated prefill instance that is the prompt, but in tidal's colocated engine a
  request's KV grows until it finishes, so its largest footprint is the honest S.
* **N_max (Eq. 5-6) on the KV pool, cumulative.** N_max is the longest prefix, in admission
  order, whose S_i (rounded up to whole KV blocks) sum to at most M_safe / (2LHDB), which is the
  pool in tokens: ``num_total_blocks * block_size``. The pool is already sized at 90 % of the device
  less the weights (``gpu_memory_utilization``), so that is where Eq. 5's 0.9 is applied;
  ``bucket.m_safe_frac`` (default 1) can reserve more. Alg. 1's N_max (split size m and merge
  threshold) sums the waiting requests in arrival order; the step's cap (``plan_step``'s
  ``StepCaps.max_num_seqs``) sums the running requests first (they hold their memory), then the chosen bucket's waiting ones
  in the order they would be admitted (the tests check it against Eq. 6 in bytes for a model
  shape).
* **Order.** Requests are grouped by (priority, class, bucket). Groups go lower priority first,
  then online before offline, then the group holding the earliest arrival first (the paper's
  order for online buckets; also used between offline buckets so that none starves). Inside a
  group online requests are FCFS; offline ones SJF (default), LJF or FCFS by
  ``bucket.offline_order`` (job length = memory S, then prompt length, then arrival).
* **One bucket per batch, work-conserving.** ``admit`` refuses a request while an earlier group
  in the order still has members not admitted this step; once the chosen group is exhausted
  the next one may fill the rest of the step.
* **AdjustBuckets** runs once each time the waiting set changes (arrivals, admissions), one
  round of Alg. 1 per run; repeated runs keep splitting while the load lasts. The buckets and
  groups are kept up to date change by change (:class:`~tidal.policies.bucket_index.BucketIndex`),
  not re-derived from the whole queue. Ties (equal job keys or arrivals) go in queue order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal

from pydantic import Field, field_validator

from tidal.config import SchedulerConfig
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import Request, RequestClass
from tidal.policies.bucket_index import BucketIndex
from tidal.policies.params import PolicyParams
from tidal.policies.registry import register_policy


# ============================================================================ pure formulas
def bucket_key(request: Request) -> int:
    """S for bucketing: the prompt length (the paper's prefill bucketing)."""
    return request.num_prompt_tokens


def memory_len(request: Request, l_max: int) -> int:
    """S for memory: the most KV tokens the request may hold (prompt + max output), capped."""
    return max(1, min(request.expected_total_tokens, l_max))


def waste_ratio(lengths: Sequence[int]) -> float:
    """Padding waste of a batch padded to its longest sequence: (S_max - S_avg) / S_max (Eq. 2)."""
    if not lengths:
        return 0.0
    s_max = max(lengths)
    return (s_max - sum(lengths) / len(lengths)) / s_max if s_max > 0 else 0.0


def safe_memory(m_remain_bytes: float, m_safe_frac: float = 0.9) -> float:
    """M_safe = 0.9 x M_remain (BucketServe Eq. 5): the share of the memory left after the model."""
    return m_safe_frac * m_remain_bytes


def n_max_prefix(seq_lens: Iterable[int], budget_tokens: float) -> int:
    """max{N | sum_{i<=N} S_i <= budget} over ``seq_lens`` in admission order (BucketServe Eq. 6's
    cumulative sum; ``budget`` = M_safe / (2LHDB), in tokens).

    When every given S_i fits, the requests that would come next are not known: they are taken at
    the given ones' mean, so N_max can exceed the count (else Alg. 1's merge test ``total < N_max``
    could never hold)."""
    n, used = 0, 0
    for s in seq_lens:
        if used + s > budget_tokens:
            return n
        used += s
        n += 1
    return n + int((budget_tokens - used) // (used / n)) if n and used > 0 else n


def max_safe_batch_blocks(num_total_blocks: int, block_size: int, seq_lens: Iterable[int],
                          m_safe_frac: float = 1.0) -> int | None:
    """Eq. 6 on a paged KV pool (what the policy sees of memory), None for no lengths.

    The pool holds ``num_total_blocks * block_size`` tokens of KV: it is M_remain / (2LHDB) with the
    bytes already divided out, and it is already what is left after the engine's memory reserve
    (``kv_pool_blocks`` sizes it at ``utilization`` = 0.9 of the device less the weights), so Eq. 5's
    0.9 is applied there and ``m_safe_frac`` defaults to 1 here (a second 0.9 would reserve twice).
    Each S_i occupies whole blocks in a paged pool, so it is rounded up to ``block_size``; the sum
    is cumulative in the order given (Eq. 6 as written), not a mean.
    """
    lens = (-(-max(1, s) // block_size) * block_size for s in seq_lens)  # lazy: the prefix sum stops early
    first = next(lens, None)
    if first is None:
        return None
    return n_max_prefix(chain((first,), lens), safe_memory(num_total_blocks * block_size, m_safe_frac))


@dataclass
class Bucket:
    """One length range [low, up) and the waiting requests (or any items) in it."""

    low: int
    up: int
    members: list = field(default_factory=list)

    @property
    def mid(self) -> int:
        return (self.low + self.up) // 2

    def as_list(self) -> list[int]:
        return [self.low, self.up, len(self.members)]


def expected_waste(buckets: Sequence[Bucket], key: Callable[[Any], int] = bucket_key) -> float:
    """Eq. 3 over the empirical length distribution: mean over members of (1 - S / U_b)."""
    terms = [1.0 - min(key(m), b.up) / b.up for b in buckets for m in b.members if b.up > 0]
    return sum(terms) / len(terms) if terms else 0.0


# ============================================================================ the policy
def _length(s: int) -> int:
    return s


class BucketParams(PolicyParams):
    theta: float = Field(0.5, ge=0.0, lt=1.0, description="Alg. 1 theta: share below the midpoint that splits")
    l_max: int = Field(8192, ge=2, description="L_max: the upper bound of the first bucket")
    m_safe_frac: float = Field(1.0, gt=0.0, le=1.0,
                               description="M_safe as a share of the KV pool (Eq. 5; the pool already leaves 10%)")
    offline_order: Literal["sjf", "ljf", "fcfs"] = Field("sjf", description="order inside offline buckets")

    @field_validator("offline_order", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v


@dataclass(frozen=True, slots=True)
class ChosenBucket:
    low: int
    up: int
    request_class: str
    priority: int
    waiting: int


@dataclass(frozen=True, slots=True)
class BucketState(PolicyState):
    theta: float = 0.0
    l_max: int = 0
    m_safe_frac: float = 0.0
    offline_order: str = ""
    n_max: int | None = None
    n_max_batch: int | None = None
    buckets: tuple[tuple[int, int, int], ...] = ()  # (low, up, waiting) of each bucket
    num_buckets: int = 0
    num_waiting: int = 0
    num_groups: int = 0
    chosen: ChosenBucket | None = None
    num_splits: int = 0
    num_merges: int = 0
    expected_waste: float = 0.0
    padding_waste_last: float = 0.0
    padding_waste_mean: float = 0.0
    padding_steps: int = 0


class BucketPolicy(SchedulingPolicy):
    name = "bucket"

    def __init__(self, params: BucketParams | None = None, **kwargs: object):
        params = params or BucketParams(**kwargs)
        self.params = params
        self.theta, self.l_max, self.m_safe_frac = params.theta, params.l_max, params.m_safe_frac
        self.offline_order = params.offline_order
        # the waiting queue in buckets and groups (Alg. 1), kept up to date change by change
        self.index = BucketIndex(self.l_max, self.theta, bucket_key, self._job_key, self._mem, self._nmax_of_mems)
        self.groups: list[list[Request]] = []  # admission order, chosen group first
        self._view_waiting: Sequence[Request] = ()  # this step's snapshot (order_waiting's fast path)
        self._admitted: tuple[Sequence[Request] | None, set[str]] = (None, set())  # admit's list, its ids so far
        self._mem_of: dict[str, tuple[Request, int]] = {}  # memory S per live request (it never changes)
        self._geometry: tuple[int, int] | None = None  # (num_total_blocks, block_size)
        self.n_max_batch: int | None = None  # the cap over running + the chosen bucket
        self._ptr = 0  # groups before this one are exhausted this step (reset by plan_step)
        self.padding_waste_last = 0.0
        self._waste_sum = 0.0
        self._waste_steps = 0

    # ---------------------------------------------------------------- bucketing
    def _mem(self, r: Request) -> int:
        got = self._mem_of.get(r.request_id)
        if got is None or got[0] is not r:
            got = self._mem_of[r.request_id] = (r, memory_len(r, self.l_max))
        return got[1]

    def _nmax_of_mems(self, mems: Iterable[int]) -> int | None:
        if self._geometry is None:
            return None
        total_blocks, block_size = self._geometry
        # BucketServe Eq. 6: the cumulative sum of S_i in the order given
        n = max_safe_batch_blocks(total_blocks, block_size, mems, self.m_safe_frac)
        return None if n is None else max(1, n)

    def _nmax(self, requests: Iterable[Request]) -> int | None:
        return self._nmax_of_mems(self._mem(r) for r in requests)

    @property
    def n_max(self) -> int | None:
        """Alg. 1's N_max over the waiting requests in arrival order."""
        return self.index.n_max

    @property
    def num_splits(self) -> int:
        return self.index.num_splits

    @property
    def num_merges(self) -> int:
        return self.index.num_merges

    def _job_key(self, r: Request) -> tuple:
        if r.request_class is RequestClass.ONLINE or self.offline_order == "fcfs":
            return (r.arrival_time,)
        sign = 1 if self.offline_order == "sjf" else -1
        return (sign * self._mem(r), sign * r.num_prompt_tokens, r.arrival_time)

    # ---------------------------------------------------------------- SchedulingPolicy
    def plan_step(self, view: SchedulerView) -> StepCaps:
        """Re-bucket the waiting queue (Alg. 1) and cap the step at N_max (Eq. 6) over the running
        requests plus the chosen bucket."""
        self._geometry = (view.num_total_blocks, view.block_size)
        if self.index.sync(view.waiting):
            self.groups = [g.members for g in self.index.ordered]
        self._view_waiting = view.waiting
        self._ptr = 0  # admissions start again from the chosen group
        chosen = self.groups[0] if self.groups else []
        self.n_max_batch = self._nmax([*view.running, *chosen])
        return StepCaps(max_num_seqs=self.n_max_batch)

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request]:
        """The groups in order; requests that arrived after ``plan_step`` go last, FCFS."""
        if waiting is self._view_waiting and len(waiting) == len(self.index):
            return list(chain.from_iterable(self.groups))  # every one is indexed: the groups in order
        rank = self.index.ranks()
        late = len(rank)
        return sorted(waiting, key=lambda r: (rank.get(r, late), r.arrival_time))

    def admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        """One bucket per batch, work-conserving: a group may admit once every group before it
        was admitted in full this step."""
        g = self.index.group_index(request)
        if g is None:
            return True  # not bucketed (arrived after plan_step): nothing to hold it back
        if self._ptr < g:
            src, ids = self._admitted  # the scheduler's list only grows within a step: add the new ones
            if src is not admitted or len(ids) > len(admitted):
                src, ids = admitted, set()
                self._admitted = (src, ids)
            if len(ids) < len(admitted):
                ids.update(r.request_id for r in admitted[len(ids):])
            while self._ptr < g and all(r.request_id in ids for r in self.groups[self._ptr]):
                self._ptr += 1  # that group is exhausted: the next may fill the step
        return g <= self._ptr

    def on_finished(self, request: Request) -> None:
        self._mem_of.pop(request.request_id, None)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        lengths = [c.context_len for c in plan.chunks]
        if not lengths:
            return
        self.padding_waste_last = waste_ratio(lengths)
        self._waste_sum += self.padding_waste_last
        self._waste_steps += 1

    def state(self) -> BucketState:
        chosen = None
        if self.index.ordered:
            g = self.index.ordered[0]
            chosen = ChosenBucket(g.bucket.low, g.bucket.up, g.members[0].request_class.value, g.priority,
                                  len(g.members))
        buckets = [Bucket(lo, up, lens) for lo, up, lens in self.index.layout()]
        return BucketState(
            self.name, theta=self.theta, l_max=self.l_max, m_safe_frac=self.m_safe_frac,
            offline_order=self.offline_order, n_max=self.n_max, n_max_batch=self.n_max_batch,
            buckets=tuple((b.low, b.up, len(b.members)) for b in buckets), num_buckets=len(buckets),
            num_waiting=len(self.index), num_groups=len(self.index.ordered), chosen=chosen,
            num_splits=self.num_splits, num_merges=self.num_merges,
            expected_waste=expected_waste(buckets, key=_length),
            padding_waste_last=self.padding_waste_last,
            padding_waste_mean=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            padding_steps=self._waste_steps)


@register_policy("bucket", params=BucketParams)
def _bucket(config: SchedulerConfig, params: BucketParams) -> SchedulingPolicy:
    return BucketPolicy(params)
