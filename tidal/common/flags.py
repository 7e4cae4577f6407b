"""The command-line flags the commands share, each defined once.

The groups: engine (the model and its memory), scheduler, workload, SLO and capacity search,
output, cluster, pipeline and KV pressure (``--kv-pressure``); :func:`serving_config` turns a
serving cluster's flags into its one config tree (:class:`tidal.cluster.config.ServingConfig`). ``tidal generate | serve | sim | profile`` and the ``tidal bench`` commands add the groups
they take with ``add_*_flags`` and turn the parsed arguments into config objects with
:func:`engine_kwargs`, :func:`scheduler_config`, :func:`cache_config`, :func:`workload_options` and
:func:`capacity_search`, so one flag means the same everywhere.

A command that needs another default (``tidal sim --model`` is a model *shape*; ``tidal bench
policies`` runs 32 requests at once) passes ``defaults={dest: value}``; ``helps`` and ``choices``
adjust the text and the allowed values the same way; ``only``/``omit`` pick flags by dest. Values
are checked where the config objects are built (``SchedulerConfig``, ``CacheConfig``...), so a bad
value is one line naming the field; argparse itself checks only that a number is a number (and, for
workload and search flags, that it is positive).

``--batching`` and ``--policy-arg`` become a config in one place, :func:`scheduler_config` (for
engines: :func:`engine_kwargs`, whose scheduler part is the same), so a check of policy names and
parameters hooks in there.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal import metrics as M
from tidal import workload as W
from tidal.cluster.pressure.events import PRESSURE_MODES
from tidal.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION,
    SCHEDULING_MODES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    parse_size,
)
from tidal.policies import check_policy


# ============================================================================ value types
def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def gib_size(text: str, name: str = "size") -> int:
    """Bytes from a size in GiB (``4``, ``0.5``; vLLM's unit for ``--kv-offloading-size``) or with a
    unit (``512MiB``)."""
    try:
        v = float(text)
    except ValueError:
        try:
            return parse_size(text, name)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {text}")
    return int(v * 1024**3)


# ============================================================================ the flags
@dataclass(frozen=True)
class Flag:
    """One flag: its option strings and argparse keywords. ``dest`` is the attribute it parses to."""

    names: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.names[0][2:].replace("-", "_")


def _flag(*names: str, **kwargs: Any) -> Flag:
    return Flag(names, kwargs)


# model and cache: the fields of ModelConfig and CacheConfig (None = the config's default)
ENGINE_FLAGS: tuple[Flag, ...] = (
    _flag("--model", default=None,
          help="path to a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)"),
    _flag("--dtype", default="auto", choices=list(DTYPES),
          help="weights and KV dtype; auto: bfloat16 on CUDA; on CPU bfloat16 where it is native and its "
               "matmuls time faster than float32 (once per machine), else float32"),
    _flag("--device", default="auto", help="auto | cpu | cuda | cuda:N"),
    _flag("--quantization", default=None, choices=list(QUANTIZATION),
          help="weights stored as 4-bit groups (GGUF Q4_1) run int4 kernels: auto = for the step sizes where "
               "start-up timing finds them faster than float (timed once per machine, kept in ~/.cache/tidal/"
               "crossovers.json); int4 = always; none = dequantized float only"),
    _flag("--compile", action="store_true", default=None,
          help="run steps of decodes (one request, or a batch) as torch.compile graphs, compiled at start-up "
               "(~1-2 min on a 2-core CPU, seconds when Inductor's cache has them); in float32 on CPU, where "
               "tidal's kernels run each layer of a decode step as one C++ call, it gains nothing"),
    _flag("--enforce-eager", action="store_true", default=None,
          help="CUDA: run decode steps eagerly instead of replaying CUDA graphs captured at start-up "
               "(one per padded batch size up to --max-num-seqs)"),
    _flag("--async-scheduling", action="store_true", default=None,
          help="CUDA: plan and launch each decode step while the one before computes, its tokens fed on "
               "the GPU, so that scheduling and outputs overlap the model (steps of decodes replayed as CUDA "
               "graphs; other steps run as without it)"),
    _flag("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS),
          help="auto: Triton paged attention on CUDA (blocks read in place, one call a layer for all decodes "
               "and one for all prefill chunks), tidal's C++ kernels in float32 on CPU, else torch's SDPA"),
    _flag("--kv-cache-dtype", default=None, choices=list(KV_CACHE_DTYPES),
          help="dtype of the KV cache; auto = the model's. A 16-bit cache halves KV memory and bandwidth in a "
               "float32 engine (tokens may then differ from the float32 reference)"),
    _flag("--max-model-len", type=int, default=None, help="context length (default: the model's)"),
    _flag("--kv-cache-memory", default=None, help="KV pool size on CPU or CUDA, e.g. 512MiB"),
    _flag("--gpu-memory-utilization", type=float, default=None, help="fraction of GPU memory for weights+KV"),
    _flag("--block-size", type=int, default=None, help="tokens per KV block"),
    _flag("--swap-space", default=None, help="host memory for swapped-out KV with --preemption-mode swap (default "
                                             "4GiB, vLLM's; allocated only in swap mode), e.g. 8GiB"),
    _flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
          help="reuse the KV of shared prompt prefixes (full blocks named by a chained hash, kept after their "
               "last user until reused; on by default); --no-enable-prefix-caching recomputes every prompt"),
    _flag("--kv-offloading-size", type=lambda t: gib_size(t, "--kv-offloading-size"), default=None, metavar="GIB",
          help="GiB of host memory for a second tier of cached prefix blocks (what the KV pool evicts is copied "
               "there, a hit there is loaded back); off by default (on a CPU host and pool are the same memory)"),
    _flag("--num-threads", type=int, default=None, help="CPU threads for the model (default: all cores, or $TIDAL_CPU_THREADS)"),
    # dest differs from the workload's --seed, so a command never mistakes one for the other
    _flag("--seed", type=int, default=None, dest="engine_seed", help="engine seed for unseeded sampling"),
)

# the fields of SchedulerConfig
SCHEDULER_FLAGS: tuple[Flag, ...] = (
    _flag("--max-num-seqs", type=int, default=None, help="most requests running at once"),
    _flag("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (prefill chunk)"),
    _flag("--long-prefill-token-threshold", type=int, default=None, help="cap on one request's prefill chunk"),
    _flag("--preemption-mode", default=None, choices=list(PREEMPTION_MODES), help="what preemption does"),
    _flag("--scheduling", default=None, choices=list(SCHEDULING_MODES),
          help="chunked (default): prefill chunks share a step with the decodes; prefill-first: a step is "
               "either all prefills (admissions and recomputes, each whole) or all decodes, prefills first "
               "(vLLM v0's default scheduler)"),
    _flag("--pad-prefill", action="store_true", default=None,
          help="run a step's prefill chunks as a padded rectangle, every row as long as the longest (an "
               "engine without variable-length attention; the padding is computed, and the simulator charges it)"),
    _flag("--batching", default=None, help="scheduling policy name(s), joined with + (default: continuous)"),
    _flag("--max-queued-requests", type=int, default=None, help="bound of the waiting queue (server)"),
    _flag("--tbt-slo-ms", type=float, default=None, help="decode-latency SLO for the SLA/SLO-aware policies"),
    _flag("--policy-arg", action="append", default=None, dest="policy_args", metavar="NAME=VALUE",
          help="policy parameter, repeatable (e.g. bucket.theta=0.5)"),
)

# the fields of tidal.workload.WorkloadOptions
WORKLOAD_FLAGS: tuple[Flag, ...] = (
    _flag("--workload", default=None,
          help="fixed:IN:OUT | uniform:A-B:C-D | " + " | ".join(W.SHAPES) +
               " | mix:NAME=W,NAME=W (e.g. mix:alpaca=0.8,longbench=0.2) | alpaca-real | sharegpt-lengths | "
               "arxiv-lengths | conversation[:KEY=VALUE,...] (multi-turn: turns resend the history; --rate "
               "counts conversation starts; keys in tidal.workload.conversation) (default with --trace: the trace)"),
    _flag("--trace", default=None, help="timed trace to replay: Azure CSV or Mooncake JSONL"),
    _flag("--time-scale", type=positive_float, default=None,
          help="trace replay speedup: arrival t becomes t / X (2 = twice as fast)"),
    _flag("--dataset", default=None, help="file for alpaca-real / *-lengths (default: in --traces-dir)"),
    _flag("--traces-dir", default=None, help="folder of the shared traces (default: ../shared/traces)"),
    _flag("--num-requests", type=positive_int, default=None, help="number of requests"),
    _flag("--duration", type=positive_float, default=None, help="seconds of arrivals (a trace is cut)"),
    _flag("--rate", type=positive_float, default=None,
          help="mean request rate (req/s; default inf = all at once; with --trace: rescale the trace "
               "to this average rate, keeping its pattern)"),
    _flag("--burstiness", type=positive_float, default=None,
          help="Gamma arrivals shape: 1 = Poisson (default), < 1 burstier"),
    _flag("--seed", type=int, default=0, help="seed of the workload (lengths, arrivals, prompts)"),
    _flag("--max-input-len", type=positive_int, default=None, help="clip prompt lengths"),
    _flag("--max-output-len", type=positive_int, default=None, help="clip output lengths"),
)

SLO_FLAGS: tuple[Flag, ...] = (
    _flag("--slo", default=None, help="latency SLOs in ms, e.g. ttft=2000,tpot=200,e2e=30000"),
    _flag("--capacity-search", action="store_true",
          help="search the highest rate whose SLO attainment >= --target-attainment"),
    _flag("--target-attainment", type=float, default=0.9),
    _flag("--search-low", type=positive_float, default=0.5, help="lowest rate probed (req/s)"),
    _flag("--search-high", type=positive_float, default=32.0, help="highest rate probed (req/s)"),
    _flag("--search-tolerance", type=positive_float, default=0.1,
          help="stop when the bracket's high/low <= 1 + this"),
    _flag("--max-probes", type=positive_int, default=8, help="most rates probed"),
)

OUTPUT_FLAGS: tuple[Flag, ...] = (
    _flag("--output", default=None, help="JSON result path (PNGs are written beside it)"),
    _flag("--no-plots", action="store_true", help="no PNG plots"),
    _flag("--no-progress", action="store_true", help="no progress bar or progress lines"),
)

# several instances: shared by `tidal serve` (real workers) and `tidal sim` (simulated instances)
CLUSTER_FLAGS: tuple[Flag, ...] = (
    _flag("--instances", type=positive_int, default=1, help="serving instances (engine workers)"),
    _flag("--mode", default="colocate", choices=["colocate", "disaggregate", "split"],
          help="colocate: every instance prefills and decodes; disaggregate: prefill instances hand each "
               "request's KV to a decode instance (BucketServe); split: pairs of instances share each "
               "request, split at the token the planner picks (DynaServe)"),
    _flag("--prefill-instances", type=int, default=0, help="prefill instances with --mode disaggregate"),
    _flag("--split-placement", default=None, choices=["load", "fixed"],
          help="--mode split: which instance of a pair is a request's alpha. load (the default, DynaServe Sec. 3.1): "
               "either, by the least predicted max(T_alpha, T_beta), with --router cache-aware also counting the "
               "prefix each holds cached; fixed: instance 2k of pair k always"),
    _flag("--prefill-batching", default=None,
          help="batching policy of the prefill instances with --mode disaggregate (default: --batching, which the "
               "decode instances run), e.g. bucket (BucketServe Sec. III)"),
    _flag("--router", default="least-outstanding",
          choices=["round-robin", "least-outstanding", "kv-aware", "llumnix", "llumnix-group", "cache-aware"],
          help="how the dispatcher picks an instance for a new request (llumnix-group: tidal's ablation of llumnix, "
               "a KunServe group takes a request only while its prefill queue per member is the shortest; "
               "cache-aware: the least predicted TTFT from each instance's queued prefill work, its decodes and the "
               "prompt tokens it would compute after the prefix it holds cached (from its reports), unless the "
               "instances' loads are too far apart)"),
    _flag("--backend", default="process", choices=["process", "ray"],
          help="workers as local processes, or as Ray actors (pip install -e '.[ray]')"),
    _flag("--ray-address", default=None, help="Ray cluster to join (default: start a local Ray)"),
    _flag("--ray-placement", default="spread", choices=["spread", "strict-spread", "pack", "strict-pack"],
          help="--backend ray: the workers' placement group, one bundle per instance; strict-spread puts every "
               "instance on a node of its own (the start fails, naming what is missing, when the cluster has too "
               "few nodes)"),
    _flag("--num-gpus-per-instance", type=float, default=0.0,
          help="--backend ray: GPUs each instance's bundle reserves (1 for --device cuda on GPU nodes)"),
    _flag("--threads-per-instance", type=positive_int, default=None,
          help="CPU threads of each instance (default: the cores split evenly)"),
    _flag("--kv-transport", default=None, choices=["shm", "ray"],
          help="how KV moves between instances (default: shm for processes, ray for Ray actors)"),
    _flag("--kv-tokens-per-chunk", type=int, default=0,
          help="tokens per KV chunk of a hand-off or migration (0: all the request's); with token ranges, a "
               "destination skips the chunks its prefix cache already holds"),
    _flag("--step-log", default=None, metavar="FILE",
          help="write one JSON line per worker step report to FILE (the front end's clock, the instance, the "
               "step's time and shape, its pool and queue, hand-offs landed there): where a layout's time goes"),
)

# a KunServe pipeline group's (tidal serve --kv-pressure drop); read by engine_kwargs
PIPELINE_FLAGS: tuple[Flag, ...] = (
    _flag("--profile", default=None, dest="microbatch_profile", metavar="FILE",
          help="`tidal profile` output whose Eq. 1 alpha, beta, gamma split a pipeline group's steps into "
               "balanced microbatches (KunServe Sec. 4.3; default: the model's FLOP ratios)"),
)


# what a throttled instance does (its queue's KV does not fit): tidal serve's workers, tidal sim's instances
PRESSURE_FLAGS: tuple[Flag, ...] = (
    _flag("--kv-pressure", default="preempt", choices=list(PRESSURE_MODES),
          help="what throttled instances (their queue's KV does not fit) do: preempt (the scheduler's "
               "--preemption-mode alone), migrate (Llumnix-like: running requests move with their KV "
               "to the instance with the most room), drop (KunServe: a pair drops half its layers "
               "each, grows its KV pools and serves as one pipeline) or auto (each throttle onset takes "
               "the one of recompute, swap, migrate and drop the cost model predicts serves the queue "
               "soonest, with hysteresis; its choices are on /admin/state and /dashboard); migrate, drop "
               "and auto need --instances >= 2 and --mode colocate"),
)


def _add_group(p: argparse.ArgumentParser, title: str, flags: tuple[Flag, ...], *,
               only: Iterable[str] | None, omit: Iterable[str], defaults: Mapping[str, Any] | None,
               helps: Mapping[str, str] | None, choices: Mapping[str, Sequence[Any]] | None,
               aliases: Mapping[str, Sequence[str]] | None) -> argparse._ArgumentGroup:
    defaults, helps, choices, aliases = defaults or {}, helps or {}, choices or {}, aliases or {}
    only = None if only is None else set(only)
    omit = set(omit)
    known = {f.dest for f in flags}
    for what, names in (("only", only or ()), ("omit", omit), ("defaults", defaults), ("helps", helps),
                        ("choices", choices), ("aliases", aliases)):
        unknown = set(names) - known
        if unknown:  # a mistake in a command's definition, not in a user's input
            raise ValueError(f"{title} flags: {what} names unknown dests {sorted(unknown)}")
    g = p.add_argument_group(title)
    for f in flags:
        d = f.dest
        if (only is not None and d not in only) or d in omit:
            continue
        kw = dict(f.kwargs)
        if d in defaults:
            kw["default"] = defaults[d]
        if d in helps:
            kw["help"] = helps[d]
        if d in choices:
            kw["choices"] = list(choices[d])
        g.add_argument(*f.names, *aliases.get(d, ()), **kw)
    return g


def add_engine_flags(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None, omit: Iterable[str] = (),
                     defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                     choices: Mapping[str, Sequence[Any]] | None = None,
                     aliases: Mapping[str, Sequence[str]] | None = None,
                     title: str = "engine") -> argparse._ArgumentGroup:
    """The model and cache flags (:data:`ENGINE_FLAGS`); the engine's ``--seed`` parses to ``engine_seed``."""
    return _add_group(p, title, ENGINE_FLAGS, only=only, omit=omit, defaults=defaults, helps=helps,
                      choices=choices, aliases=aliases)


def add_scheduler_flags(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None, omit: Iterable[str] = (),
                        defaults: Mapping[str, Any] | None = None, helps: Mapping[str, str] | None = None,
                        choices: Mapping[str, Sequence[Any]] | None = None) -> argparse._ArgumentGroup:
    """The scheduler flags (:data:`SCHEDULER_FLAGS`), read by :func:`scheduler_config`."""
    return _add_group(p, "scheduler", SCHEDULER_FLAGS, only=only, omit=omit, defaults=defaults, helps=helps,
                      choices=choices, aliases=None)


def add_workload_flags(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None, omit: Iterable[str] = (),
                       defaults: Mapping[str, Any] | None = None,
                       helps: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """The workload flags (:data:`WORKLOAD_FLAGS`), read by :func:`workload_options`."""
    return _add_group(p, "workload", WORKLOAD_FLAGS, only=only, omit=omit, defaults=defaults, helps=helps,
                      choices=None, aliases=None)


def add_slo_flags(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                  defaults: Mapping[str, Any] | None = None,
                  helps: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """``--slo`` and the capacity search (:data:`SLO_FLAGS`), read by :func:`capacity_search`."""
    return _add_group(p, "SLOs and capacity", SLO_FLAGS, only=only, omit=(), defaults=defaults, helps=helps,
                      choices=None, aliases=None)


def add_cluster_flags(p: argparse.ArgumentParser, *, only: Iterable[str] | None = None,
                      omit: Iterable[str] = (), choices: Mapping[str, Sequence[Any]] | None = None,
                      helps: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """Instances, mode, prefill instances, router (and, for real workers, backend and threads).
    ``choices`` / ``helps`` widen a flag for one command (``tidal sim --mode split``)."""
    return _add_group(p, "cluster", CLUSTER_FLAGS, only=only, omit=omit, defaults=None, helps=helps,
                      choices=choices, aliases=None)


def add_pipeline_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--profile`` (:data:`PIPELINE_FLAGS`), read by :func:`engine_kwargs`."""
    return _add_group(p, "pipeline group (--kv-pressure drop)", PIPELINE_FLAGS, only=None, omit=(), defaults=None,
                      helps=None, choices=None, aliases=None)


def add_pressure_flags(p: argparse.ArgumentParser, *, defaults: Mapping[str, Any] | None = None,
                       helps: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """``--kv-pressure`` (:data:`PRESSURE_FLAGS`), read by :func:`serving_config` (and ``tidal sim``)."""
    return _add_group(p, "KV pressure", PRESSURE_FLAGS, only=None, omit=(), defaults=defaults, helps=helps,
                      choices=None, aliases=None)


def serving_config(args: argparse.Namespace) -> Any:
    """The serving cluster's whole config (:class:`tidal.cluster.config.ServingConfig`: engine,
    scheduler, cache, cluster, pressure) from its flags, validated once, here: a bad value or
    combination is a :class:`ConfigError` before anything loads."""
    from tidal.cluster.config import ClusterConfig, ServingConfig

    transport = args.kv_transport or ("ray" if args.backend == "ray" else "shm")
    cluster = ClusterConfig(layout=cluster_layout(args), prefill_batching=args.prefill_batching, router=args.router,
                            backend=args.backend, ray_address=args.ray_address,
                            threads_per_instance=args.threads_per_instance, transport=transport,
                            kv_pressure=args.kv_pressure, ray_placement=args.ray_placement,
                            num_gpus_per_instance=args.num_gpus_per_instance,
                            step_log=getattr(args, "step_log", None),
                            tokens_per_chunk=getattr(args, "kv_tokens_per_chunk", 0),
                            split_placement=split_placement(args))
    return ServingConfig(EngineConfig.from_kwargs(**engine_kwargs(args)), cluster)


def split_placement(args: argparse.Namespace) -> str:
    """``--split-placement`` (default ``load``); given without ``--mode split`` it is an error."""
    given = getattr(args, "split_placement", None)
    if given is not None and args.mode != "split":
        raise ConfigError("--split-placement needs --mode split")
    return given or "load"


def cluster_layout(args: argparse.Namespace) -> Any:
    """The checked :class:`tidal.cluster.dispatch.ClusterLayout` of the cluster flags."""
    from tidal.cluster.dispatch import ClusterLayout

    return ClusterLayout(args.instances, args.mode, args.prefill_instances)


def add_output_flags(p: argparse.ArgumentParser, output: str, *, plots: bool = True,
                     aliases: Mapping[str, Sequence[str]] | None = None,
                     helps: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
    """``--output`` (default ``output``), ``--no-plots`` (only with ``plots``) and ``--no-progress``."""
    return _add_group(p, "output", OUTPUT_FLAGS, only=None, omit=() if plots else ("no_plots",),
                      defaults={"output": output}, helps=helps, choices=None, aliases=aliases)


# ============================================================================ args -> config
def _values(args: argparse.Namespace, flags: tuple[Flag, ...]) -> dict[str, Any]:
    """The given flags' values that the command defines and the user (or its default) set."""
    out = {}
    for f in flags:
        if hasattr(args, f.dest):
            v = getattr(args, f.dest)
            if v is not None:
                out["seed" if f.dest == "engine_seed" else f.dest] = v
    return out


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine and scheduler flags a command defines, as ``EngineConfig.from_kwargs`` (and
    ``LLM(...)``) arguments; unset ones are left out so the config's defaults apply. ``model`` is
    always there (None: the default model)."""
    out = {**_values(args, ENGINE_FLAGS), **_values(args, SCHEDULER_FLAGS)}
    out.setdefault("model", getattr(args, "model", None))
    profile = getattr(args, "microbatch_profile", None)
    if profile:
        from tidal.common.results import load_eq1

        try:
            out["microbatch_cost"] = load_eq1(profile)
        except ValueError as e:
            raise ConfigError(f"--profile: {e}") from None
    return out


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The engine's config from its flags (validated: a bad value, policy name or policy argument
    is a :class:`ConfigError`, found here before any weights load)."""
    cfg = EngineConfig.from_kwargs(**{**engine_kwargs(args), **overrides})
    _check_policies(args, cfg.scheduler)
    return cfg


def scheduler_config(args: argparse.Namespace, **overrides: Any) -> SchedulerConfig:
    """``SchedulerConfig`` from the scheduler flags: the same for the engine and the simulator
    (policy names and parameters checked)."""
    cfg = SchedulerConfig(**{**_values(args, SCHEDULER_FLAGS), **overrides})
    _check_policies(args, cfg)
    return cfg


def _check_policies(args: argparse.Namespace, cfg: SchedulerConfig) -> None:
    """The policy and its arguments; with ``--prefill-batching`` each role's (a ``--policy-arg``
    may then name a policy only the prefill instances run)."""
    if getattr(args, "prefill_batching", None):
        from tidal.cluster.dispatch import check_role_policies

        check_role_policies(cfg, cluster_layout(args), args.prefill_batching, check_policy)
    else:
        check_policy(cfg)


def cache_config(args: argparse.Namespace) -> CacheConfig:
    """``CacheConfig`` from the cache flags (sizes parsed, block size and utilization checked)."""
    names = {"kv_cache_memory", "gpu_memory_utilization", "block_size", "swap_space", "enable_prefix_caching",
             "kv_offloading_size"}
    return CacheConfig(**{k: v for k, v in _values(args, ENGINE_FLAGS).items() if k in names})


def workload_options(args: argparse.Namespace, **overrides: Any) -> W.WorkloadOptions:
    """``WorkloadOptions`` from the workload flags; ``overrides`` (e.g. ``rate=``, ``num_requests=``)
    replace what the flags say. ``--traces-dir`` defaults to the shared traces folder."""
    names = {"duration": "duration_s"}
    opts = {names.get(f.dest, f.dest): getattr(args, f.dest) for f in WORKLOAD_FLAGS if hasattr(args, f.dest)}
    opts["traces_dir"] = opts.get("traces_dir") or W.default_traces_dir()
    if opts.get("seed") is None:
        opts.pop("seed", None)
    opts.update(overrides)
    return W.WorkloadOptions(**opts)


def check_capacity_flags(args: argparse.Namespace) -> None:
    """With ``--capacity-search``: the flags that contradict it, and the search's own bounds."""
    if not getattr(args, "capacity_search", False):
        return
    if getattr(args, "rate", None) is not None or getattr(args, "time_scale", None) is not None:
        raise ConfigError("--capacity-search picks the rates itself; drop --rate/--time-scale "
                          "(set the range with --search-low/--search-high)")
    if not 0 < args.target_attainment <= 1:
        raise ConfigError("--target-attainment must be in (0, 1]")
    if not args.search_low < args.search_high:
        raise ConfigError("--search-low must be below --search-high")
    if args.max_probes < 2:
        raise ConfigError("--max-probes must be >= 2 (the low and the high bound)")


def capacity_search(args: argparse.Namespace) -> M.CapacitySearch:
    """The bisection the SLO flags describe (call :func:`check_capacity_flags` first for clear errors)."""
    check_capacity_flags(args)
    return M.CapacitySearch(args.search_low, args.search_high, args.target_attainment,
                            tolerance=args.search_tolerance, max_probes=args.max_probes)


__all__ = [
    "CLUSTER_FLAGS", "ENGINE_FLAGS", "OUTPUT_FLAGS", "PRESSURE_FLAGS", "SCHEDULER_FLAGS", "SLO_FLAGS", "WORKLOAD_FLAGS",
    "Flag", "add_cluster_flags", "add_engine_flags", "add_output_flags", "add_pressure_flags", "cluster_layout",
    "add_scheduler_flags", "add_slo_flags", "add_workload_flags", "cache_config", "capacity_search",
    "check_capacity_flags", "engine_config", "engine_kwargs", "positive_float", "positive_int", "scheduler_config",
    "serving_config", "workload_options",
]
