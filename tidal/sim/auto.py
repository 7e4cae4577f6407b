"""``tidal sim --kv-pressure auto``: each throttle onset gets the response the moment calls for.

The pure :class:`tidal.cluster.pressure.AutoPressure` chooses (recompute, swap, migrate or drop,
by the predicted time to serve the queue, with hysteresis); this handler executes the choice with
the other handlers' own machinery, so each response runs exactly as its fixed mode does:

- recompute / swap: the instance's scheduler preempts that way (``Scheduler.preemption_mode``;
  every instance has its host pool, so a swap has room until the pool is full);
- migrate: :class:`tidal.sim.migrate.MigrateHandler`'s moves, for the instances whose response is
  migrate, to instances running alone;
- drop: :class:`tidal.sim.kunserve.DropHandler`, driven by the gated KunServe controller (drop for
  the throttles whose response is drop; restore by Sec. 4.4's rule).

One change at a time: no drop starts while a migration is in flight and no migration while a drop
or restore is being executed; both share one link per instance. Pure: virtual time only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.pressure import (
    AutoChoice,
    AutoParams,
    AutoPressure,
    ChunkCost,
    ModelMemory,
    Prices,
    RestorePolicy,
    Victim,
)
from tidal.core.scheduler import Scheduler
from tidal.sim.auto_audit import PredictionAudit, ShadowAudit, waiting_ids
from tidal.sim.kunserve import DropHandler
from tidal.sim.links import LinkSpec
from tidal.sim.loop import Event
from tidal.sim.migrate import MigrateHandler, movable_requests
from tidal.sim.pressure import PressureConfig, PressureHandler

if TYPE_CHECKING:
    from tidal.sim.instance import SimInstance
    from tidal.sim.simulator import ClusterSimulator


def auto_prices(chunk: ChunkCost, token_budget: int, overhead_s: float, model: ModelMemory, block_size: int,
                host_bytes_per_s: float, link: LinkSpec, tp: int = 1, layers_per_chunk: int = 0,
                hidden_bytes: int = 0) -> Prices:
    """The prices ``auto`` predicts with, from a cost model's Eq. 1 coefficients and the hardware's
    links (the runtime calls this too, with the same cost model on its own hardware)."""
    chunks = math.ceil(model.num_layers / layers_per_chunk) if layers_per_chunk else 1
    return Prices(chunk, token_budget, overhead_s, model.kv_bytes_per_token, block_size, host_bytes_per_s,
                  link.bandwidth * tp, link.latency_s, chunks, hidden_bytes)


def sim_prices(cfg: PressureConfig, sim: ClusterSimulator) -> Prices:
    """The prices of a simulated cluster (its first instance's scheduler and pool, the config's links)."""
    sched = sim.instances[0].scheduler.config
    return auto_prices(cfg.chunk_cost, sched.max_num_batched_tokens, cfg.overhead_s, cfg.model,
                       sim.instances[0].kv.block_size, cfg.host_bytes_per_s, cfg.link, cfg.tp,
                       cfg.layers_per_chunk, cfg.hidden_bytes)


def shadow_audit(cfg: PressureConfig, sim: ClusterSimulator, response: str | None) -> ShadowAudit:
    """A passive ``auto`` over a fixed-mode run (``response``: the run's response; None: each
    instance's preemption mode): it predicts at each onset, acts on nothing."""
    shadow = AutoPressure(sim.monitor, cfg.model, sim_prices(cfg, sim), params=cfg.auto_params)
    return ShadowAudit(shadow, sim, response)


def victims(s: Scheduler) -> list[Victim]:
    """The running requests in the scheduler's own preemption order (the lowest priority, latest arrival first)."""
    order = sorted(s.running, key=lambda r: (r.priority, r.arrival_time), reverse=True)
    return [Victim(r.num_tokens, s.kv.num_blocks_of(r.request_id), bool(r.output_token_ids) and not r.in_prefill,
                   max(r.max_output_tokens - len(r.output_token_ids), 0)) for r in order]


def queued(s: Scheduler) -> list[Victim]:
    """The requests waiting for their first token, in queue order: each takes its prompt's blocks and
    the next token's slot to be admitted, and may produce its max_tokens."""
    bs = s.kv.block_size
    return [Victim(r.num_tokens, handoff_blocks(r.num_tokens, bs), False, r.max_output_tokens, r.request_id)
            for r in s.waiting if not r.output_token_ids]


class _Running(Mapping[int, list[Victim]]):
    """Each instance's victims (``queue``: its queued requests instead), computed only for the
    instances asked about (the throttled ones)."""

    def __init__(self, execs: list[SimInstance], queue: bool = False):
        self.execs, self.of = execs, queued if queue else victims

    def __getitem__(self, i: int) -> list[Victim]:
        return self.of(self.execs[i].scheduler)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.execs)))

    def __len__(self) -> int:
        return len(self.execs)


class AutoHandler(PressureHandler):
    mode = "auto"

    def __init__(self, cfg: PressureConfig, params: AutoParams | None = None):
        super().__init__(cfg)
        self.params = params or getattr(cfg, "auto_params", None) or AutoParams()
        inner = replace(cfg, audit=False)  # the notes are auto's choices (self.audit), not its parts' shadows
        self.drop = DropHandler(inner, self.detector)
        self.mig = MigrateHandler(inner, self.detector)
        self.choices: list[AutoChoice] = []

    def attach(self, sim: ClusterSimulator) -> None:
        super().attach(sim)
        self.drop.attach(sim)
        self.mig.attach(sim)
        self.drop.events = self.mig.events = self.events  # one log
        self.mig.links = self.drop.links  # one link per instance
        cfg = self.cfg
        if cfg.audit:
            self.audit = PredictionAudit()
        self.auto = AutoPressure(sim.monitor, cfg.model, sim_prices(cfg, sim), params=self.params, detector=self.detector,
                                 restore=RestorePolicy(cfg.restore_threshold), recorder=self.record,
                                 choices=self.choices.append)
        self.drop.ctl = self.auto  # type: ignore[assignment]  (KunServe's executor drives the gated controller)

    # ---------------------------------------------------------------- the handler's hooks
    def _changing(self) -> bool:
        d = self.drop
        return d.plan is not None or bool(d.in_flight) or bool(d.draining)

    def after_step(self, inst: SimInstance, now: float) -> list[Event]:
        drop_ready = not self._changing() and not self.mig.moves
        for c in self.auto.onsets(now, _Running(self.drop.execs), drop_ready, _Running(self.drop.execs, queue=True)):
            self.drop.execs[c.index].scheduler.preemption_mode = self.auto.preemption_mode(c.index)
            if self.audit is not None:
                self.audit.note(c, c.choice, waiting_ids(self.sim, c.index))
        out: list[Event] = []
        if self.mig.moves:  # a migration in flight: no change of groups until it lands
            self.auto.observe(now)
        else:
            out += self.drop.after_step(inst, now)
        if not self._changing() and self.auto.mode.get(inst.index) == "migrate":
            out += self._migrate(inst, now)
        return out

    def _migrate(self, inst: SimInstance, now: float) -> list[Event]:
        """MigrateHandler's moves out of ``inst`` (only its own step end starts them): its decoding
        requests, each needing its tokens and the next one's slot."""
        bs = inst.kv.block_size
        running = {inst.index: [(r.request_id, handoff_blocks(r.num_tokens, bs)) for r in movable_requests(inst)]}
        m = self.mig
        out = []
        for move in self.auto.migrations(now, running, dict(enumerate(m.leaving)), dict(enumerate(m.incoming))):
            ev = m._start(move, now)
            if ev is not None:
                out.append(ev)
        return out

    def can_step(self, inst: SimInstance) -> bool:
        return self.drop.can_step(inst)

    def on_first_token(self, request_id: str, now: float) -> None:
        self.auto.first_token(request_id, now)

    def on_failure(self, index: int, request_id: str, now: float) -> list[Event] | None:
        return self.mig.on_failure(index, request_id, now)

    def finish(self, now: float) -> None:
        self.drop.finish(now)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        d, m = self.drop.summary(), self.mig.summary()
        out.update({k: d[k] for k in ("groups", "exchange_bytes", "link_bytes")})
        out.update({k: m[k] for k in ("migrated", "migrated_bytes", "mean_stall_ms")})
        out["choice_counts"] = dict(self.auto.counts)
        out["auto_params"] = self.params.to_dict()
        out["choices"] = [c.to_dict() for c in self.choices]  # whole records: each replays (choose.replay)
        return out


__all__ = ["AutoHandler", "auto_prices", "shadow_audit", "sim_prices", "victims"]
