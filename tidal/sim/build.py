"""Building a simulated cluster from names: model shape, hardware, cost model, KV pool, router,
layout (colocated or prefill/decode), the link hand-offs travel on.

Each instance's KV pool is sized by :func:`tidal.config.kv_pool_blocks`, the formula the engine
uses: on a GPU, ``utilization`` of the memory less the weights, the runtime's reserve and one
step's activations; on the CPU, the engine's KV budget. Disaggregated, the prefill instances can
run their own batching policy (``prefill_batching``, e.g. BucketServe's buckets on the prefill
side and continuous batching on the decode side, Sec. II-C). Pure (no torch, no clock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tidal.cluster.decisions import Decision
from tidal.cluster.dispatch import ClusterLayout, check_role_policies, role_scheduler
from tidal.cluster.handoff import DEFAULT_LAYERS_PER_CHUNK, DEFAULT_TOKENS_PER_CHUNK
from tidal.cluster.pressure import ModelMemory, check_pressure_mode
from tidal.cluster.router import build_router
from tidal.cluster.split import SplitParams, SplitPlanner
from tidal.config import DEFAULT_SWAP_SPACE, ConfigError, ModelArch, SchedulerConfig, swap_space_warning
from tidal.policies.profile_table import ProfileTable
from tidal.sim.analytic import AnalyticCostModel, kv_pool_blocks_for
from tidal.sim.cost_model import CostModel, ScaledCostModel
from tidal.sim.hardware import HardwareSpec, get_hardware
from tidal.sim.instance import SimInstance
from tidal.sim.jitter import FITTED as JITTER_FITTED
from tidal.sim.jitter import MODES as JITTER_MODES
from tidal.sim.jitter import JitterParams, testbed, with_jitter
from tidal.sim.links import LinkSpec, get_link
from tidal.sim.models import MODELS, get_model
from tidal.sim.pd import HandoffConfig
from tidal.sim.pressure import PressureConfig, PressureHandler, build_pressure
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec

if TYPE_CHECKING:
    from tidal.sim.step_grid import ProfileGrid

COST_MODELS = ("analytic", "profiled")


@dataclass
class ClusterSpec:
    model: str = "llama-3-8b"
    hardware: str = "a100-80g"
    instances: int = 1
    tp: int = 1  # GPUs per instance (tensor parallel)
    dtype_bytes: int = 2
    block_size: int = 16
    router: str = "least-outstanding"
    cost_model: str = "analytic"
    profile: str | None = None  # a `tidal profile` file (cost_model "profiled")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # explicit KV budget per instance (bytes)
    num_blocks: int | None = None  # explicit pool size (overrides the memory budget)
    swap_space: int = DEFAULT_SWAP_SPACE  # host bytes per instance for swapped-out KV (preemption_mode swap)
    # prefix caching as the engine's: requests share blocks where a trace's hash ids or a conversation's
    # content spans say their contents are equal (a turn's answer blocks too); any request re-hits its own
    # blocks after a recompute preemption (other prompts have no tokens here, so they share nothing else).
    # Off by default here: the papers' experiments model engines without it (vLLM v0's default); `tidal sim`
    # follows the engine's default (on)
    enable_prefix_caching: bool = False
    kv_offloading_size: int = 0  # host bytes per instance for cached blocks the pool evicts (a second tier)
    max_model_len: int | None = None  # default: the model's context
    timeline_interval_s: float = 0.0
    time_factor: float = 1.0  # multiply every step time (a slower or faster machine than modelled)
    mode: str = "colocate"  # colocate | disaggregate
    prefill_instances: int = 0  # with mode disaggregate: the first ones prefill, the rest decode
    prefill_batching: str | None = None  # the prefill instances' policy (default: scheduler.batching)
    link: str | None = None  # hand-off link (tidal.sim.links; default: nvlink on a GPU, shm on the CPU)
    layers_per_chunk: int = DEFAULT_LAYERS_PER_CHUNK
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    split: SplitParams | None = None  # mode split: Alg. 1's knobs (default: SplitParams() on the scheduler's limits)
    split_length: str = "max-tokens"  # mode split: what the planner knows of the output (tidal.sim.split.LENGTH_MODES)
    kv_stream_tokens: int = 16  # mode split: KV goes to beta each time this many tokens are computed
    kv_stream_lead: int | None = None  # mode split: ... once alpha is within this many tokens of s (None: always)
    seed_profile: bool = False  # seed slo-compose's profile table with the cost model on a grid (an offline profile)
    kv_pressure: str | None = None  # preempt | migrate | drop | auto (tidal.sim.pressure); None: no handler
    lookahead: bool = True  # drop: Fig. 11's cost-balanced microbatches (False: token counts)
    restore_threshold: float = 0.5  # drop: Sec. 4.4's restore rule
    pipeline_parallel: int = 1  # > 1: every this many instances run as one pipeline from the start (vLLM + PP)
    pipeline_stage_gap_s: float = 0.0  # a pipeline's idle time per stage per microbatch (tidal.sim.pipeline)
    auto_params: Any = None  # auto: tidal.cluster.pressure.AutoParams (None: the defaults)
    audit_auto: bool = False  # note auto's predictions beside what happened (tidal.sim.auto_audit; not in drop)
    split_kv_aware: bool = False  # mode split: the planner's predictor obeys each instance's KV pool
    step_jitter: str = "off"  # off | fitted: step-time tails (tidal.sim.jitter); planners see the mean model
    jitter_params: JitterParams | None = None  # with step_jitter fitted: these instead of jitter.FITTED
    jitter_seed: int = 0  # the tails' own random stream

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError(f"instances must be >= 1, got {self.instances}")
        self.layout  # noqa: B018  (checks mode and prefill_instances)
        if self.prefill_batching is not None and self.mode != "disaggregate":
            raise ConfigError("--prefill-batching needs --mode disaggregate")
        if self.tp < 1:
            raise ConfigError(f"tp must be >= 1, got {self.tp}")
        if self.cost_model not in COST_MODELS:
            raise ConfigError(f"cost model must be one of {', '.join(COST_MODELS)}; got {self.cost_model!r}")
        if self.mode != "split" and (self.split is not None or self.split_length != "max-tokens" or self.split_kv_aware):
            raise ConfigError("the split planner's settings need --mode split")
        if self.step_jitter not in JITTER_MODES:
            raise ValueError(f"step_jitter must be one of {', '.join(JITTER_MODES)}; got {self.step_jitter!r}")
        if self.kv_offloading_size < 0:
            raise ConfigError(f"kv_offloading_size must be >= 0, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size keeps cached prefix blocks in host memory: it needs prefix caching")
        if self.kv_stream_tokens < 1:
            raise ConfigError(f"kv_stream_tokens must be >= 1, got {self.kv_stream_tokens}")
        if self.kv_stream_lead is not None and self.kv_stream_lead < 0:
            raise ConfigError(f"kv_stream_lead must be >= 0, got {self.kv_stream_lead}")
        if self.cost_model == "profiled" and not self.profile:
            raise ConfigError("the profiled cost model needs a profile file (write one with `tidal profile`)")
        if self.pipeline_parallel < 1:
            raise ConfigError(f"pipeline_parallel must be >= 1, got {self.pipeline_parallel}")
        if self.pipeline_stage_gap_s < 0:
            raise ConfigError(f"pipeline_stage_gap_s must be >= 0, got {self.pipeline_stage_gap_s}")
        if self.pipeline_parallel > 1 and (self.kv_pressure not in (None, "preempt") or self.mode != "colocate"):
            raise ConfigError("pipeline parallel instances preempt on their own (kv_pressure preempt) and colocate")
        if self.kv_pressure is not None:
            try:
                check_pressure_mode(self.kv_pressure, self.instances, get_model(self.model).num_layers
                                    if self.model in MODELS else None, self.mode == "disaggregate")
            except ValueError as e:
                raise ConfigError(str(e)) from None


    @property
    def layout(self) -> ClusterLayout:
        return ClusterLayout(self.instances, self.mode, self.prefill_instances)

    def role_scheduler(self, role: str) -> SchedulerConfig:
        """The scheduler config of an instance of ``role`` (the runtime's rule: the prefill
        instances may run ``prefill_batching``)."""
        return role_scheduler(self.scheduler, role, self.prefill_batching)


def make_cost_model(spec: ClusterSpec, arch: ModelArch, hw: HardwareSpec) -> CostModel:
    model: CostModel
    if spec.cost_model == "profiled":
        from tidal.sim.profiled import ProfiledCostModel

        model = ProfiledCostModel.load(spec.profile)
    else:
        model = AnalyticCostModel(arch, hw, dtype_bytes=spec.dtype_bytes, tp=spec.tp, block_size=spec.block_size)
    return model if spec.time_factor == 1.0 else ScaledCostModel(model, spec.time_factor)


def resolve(spec: ClusterSpec) -> tuple[ModelArch, HardwareSpec, int, int]:
    """(model shape, hardware, KV blocks per instance, context length)."""
    arch, hw = get_model(spec.model), get_hardware(spec.hardware)
    max_len = min(spec.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    if spec.num_blocks is not None:
        blocks = spec.num_blocks
    else:
        blocks = kv_pool_blocks_for(arch, hw, spec.dtype_bytes, spec.tp, spec.block_size,
                                    spec.scheduler.max_num_batched_tokens,
                                    utilization=spec.gpu_memory_utilization, kv_cache_memory=spec.kv_cache_memory)
    return arch, hw, blocks, max_len


def swap_blocks(spec: ClusterSpec, arch: ModelArch) -> int:
    """Host blocks per instance for swapped-out KV (none unless ``--preemption-mode swap``), as the engine sizes them."""
    block_bytes = spec.block_size * arch.kv_bytes_per_token(spec.dtype_bytes)  # all tp shards
    return spec.swap_space // block_bytes if spec.scheduler.preemption_mode == "swap" else 0


def swap_warning(spec: ClusterSpec) -> str | None:
    """The engine's start-up warning for this setup: a swap space too small for one longest request."""
    if spec.scheduler.preemption_mode != "swap":
        return None
    arch, _, _, max_len = resolve(spec)
    return swap_space_warning(swap_blocks(spec, arch), spec.block_size, max_len, spec.swap_space)


def handoff_config(spec: ClusterSpec, arch: ModelArch, hw: HardwareSpec) -> HandoffConfig:
    link: LinkSpec = get_link(spec.link, hw)
    return HandoffConfig.for_model(arch, spec.dtype_bytes, link, spec.tp, spec.layers_per_chunk, spec.tokens_per_chunk)


def pressure_link(spec: ClusterSpec, hw: HardwareSpec) -> LinkSpec:
    """The link between instances that KV migrations, exchanges, activations and restored weights
    take: ``--link``, else InfiniBand HDR 200 Gb/s on a GPU (KunServe's cluster A: one A800 per
    server, 200 Gbps RDMA, Table 2), shared memory on the CPU."""
    return get_link(spec.link or ("ib-hdr" if hw.kind == "gpu" else "shm"), hw)


def pressure_config(spec: ClusterSpec, arch: ModelArch, hw: HardwareSpec, cost_model: CostModel) -> PressureConfig:
    from tidal.sim.pipeline import chunk_cost_for

    model = ModelMemory(arch.num_layers, arch.params_per_layer() * spec.dtype_bytes,
                        arch.kv_bytes_per_token(spec.dtype_bytes))
    return PressureConfig(spec.kv_pressure or "preempt", pressure_link(spec, hw), model,
                          arch.hidden_size * spec.dtype_bytes,
                          chunk_cost_for(cost_model, spec.scheduler.max_num_batched_tokens), tp=spec.tp,
                          layers_per_chunk=spec.layers_per_chunk, lookahead=spec.lookahead,
                          restore_threshold=spec.restore_threshold, overhead_s=hw.step_overhead_s,
                          stage_gap_s=spec.pipeline_stage_gap_s,
                          host_bytes_per_s=hw.host_bandwidth * spec.tp, auto_params=spec.auto_params,
                          audit=spec.audit_auto)


def check_policy_args(spec: ClusterSpec) -> None:
    """Each role's policy and every ``--policy-arg`` (one naming no role's policy is an error)."""
    from tidal.policies import check_policy

    check_role_policies(spec.scheduler, spec.layout, spec.prefill_batching, check_policy)


def seed_profile_tables(instances: Sequence[SimInstance], records: Sequence[tuple[int, int, int, int, float]]) -> int:
    """Record an offline profile in the profile table of every policy (or policy part) that has
    one (``slo-compose``: DynaServe's table is "derived from offline profiling", then refined
    with every step). ``records``: (prefill tokens, mean context, decode count, the prefill's
    prefix, seconds), as :meth:`tidal.sim.step_grid.ProfileGrid.records`. Returns how many tables
    were seeded."""
    n = 0
    for inst in instances:
        for pol in getattr(inst.policy, "parts", [inst.policy]):
            table = getattr(pol, "table", None)
            if isinstance(table, ProfileTable):
                for p, c, d, x, t in records:
                    table.record(p, c, d, t, prefix=x)
                n += 1
    return n


def split_params(spec: ClusterSpec, kv_pool_tokens: int | None = None) -> SplitParams:
    """Alg. 1's knobs, with the predictor's passes on the instances' own limits (and, with
    ``split_kv_aware``, their KV pool of ``kv_pool_tokens``)."""
    base = spec.split or SplitParams()
    kv = kv_pool_tokens if spec.split_kv_aware else base.kv_capacity_tokens
    return replace(base, token_budget=spec.scheduler.max_num_batched_tokens, max_num_seqs=spec.scheduler.max_num_seqs,
                   kv_capacity_tokens=kv)


def cache_routed(spec: ClusterSpec) -> bool:
    """``--router cache-aware`` with prefix caching: the instances track their cached block names and
    the front end places requests by them."""
    return spec.enable_prefix_caching and spec.router == "cache-aware"


def _split_simulator(spec: ClusterSpec, instances: list[SimInstance], requests: Sequence[RequestSpec],
                     grid: ProfileGrid, handoff: HandoffConfig, max_len: int) -> ClusterSimulator:
    from tidal.sim.split import SplitSimulator

    planner = SplitPlanner(split_params(spec, instances[0].num_blocks * spec.block_size), grid)
    return SplitSimulator(instances, planner, requests, handoff, max_model_len=max_len, length_mode=spec.split_length,
                          stream_tokens=spec.kv_stream_tokens, stream_lead=spec.kv_stream_lead,
                          timeline_interval=spec.timeline_interval_s, cache_aware=cache_routed(spec))


def build_simulator(spec: ClusterSpec, requests: Sequence[RequestSpec],
                    recorder: Callable[[Decision], None] | None = None) -> ClusterSimulator:
    arch, hw, blocks, max_len = resolve(spec)
    if spec.step_jitter == "fitted":  # the testbed the tails were fitted on: its prefill attention too
        hw = testbed(hw, spec.jitter_params or JITTER_FITTED)
    layout = spec.layout
    check_policy_args(spec)
    block_bytes = spec.block_size * arch.kv_bytes_per_token(spec.dtype_bytes)  # all tp shards
    # --kv-pressure auto may switch any instance to swap: every instance keeps its host pool
    swap = spec.swap_space if spec.scheduler.preemption_mode == "swap" or spec.kv_pressure == "auto" else 0
    host_blocks = (swap + spec.kv_offloading_size) // block_bytes  # one host pool: swap and the cache's tier
    caching = spec.enable_prefix_caching
    cost_model = make_cost_model(spec, arch, hw)  # stateless: the instances share it
    # the steps' times, with their tails; the planners' offline profiles (the grid) see the mean model
    step_model = with_jitter(cost_model, spec.step_jitter, spec.jitter_seed, spec.jitter_params)
    instances = [
        SimInstance(i, spec.role_scheduler(role), blocks, spec.block_size, step_model, max_len,
                    num_host_blocks=host_blocks, timeline_interval=spec.timeline_interval_s, role=role,
                    enable_caching=caching, host_tier=caching and spec.kv_offloading_size > 0)
        for i, role in enumerate(layout.roles())
    ]
    if cache_routed(spec):  # the router (or the split planner) reads where each prefix is cached
        for inst in instances:
            inst.kv.track_names()
    grid = None
    if layout.split or spec.seed_profile:
        from tidal.sim.step_grid import ProfileGrid

        grid = ProfileGrid(cost_model, spec.scheduler.max_num_batched_tokens, spec.scheduler.max_num_seqs, max_len)
    if spec.seed_profile:
        assert grid is not None
        seed_profile_tables(instances, grid.records())
    if layout.split:
        assert grid is not None
        return _split_simulator(spec, instances, requests, grid, handoff_config(spec, arch, hw), max_len)
    handoff = handoff_config(spec, arch, hw) if layout.disaggregated else None
    pressure: PressureHandler | None = None
    if spec.pipeline_parallel > 1:  # vLLM + PP: pipelines from the start (tidal.sim.static_pipeline)
        from tidal.sim.static_pipeline import StaticPipelineHandler

        pressure = StaticPipelineHandler(pressure_config(spec, arch, hw, cost_model), spec.pipeline_parallel)
    elif spec.kv_pressure is not None:
        pressure = build_pressure(pressure_config(spec, arch, hw, cost_model))
    return ClusterSimulator(instances, build_router(spec.router), requests, max_model_len=max_len, layout=layout,
                            handoff=handoff, recorder=recorder, timeline_interval=spec.timeline_interval_s,
                            pressure=pressure)
