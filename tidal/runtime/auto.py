"""``--kv-pressure auto`` in the real cluster: each throttle onset gets the response it calls for.

After each instance report the pure :class:`~tidal.cluster.pressure.AutoPressure` -- the object the
simulator's :class:`tidal.sim.auto.AutoHandler` drives -- chooses at every throttle onset among
recompute, swap, migrate and drop (the predicted time to serve the queue, with hysteresis), and
this coordinator executes the choice with the fixed modes' own coordinators:

- recompute / swap: the worker is told its preemption mode (``Preemption``); every worker keeps a
  host pool (``--swap-space``), so a swap has room until it is full;
- migrate: :class:`tidal.runtime.migrate.MigrateCoordinator`'s moves, for the instances whose
  response is migrate, to instances running alone;
- drop: :class:`tidal.runtime.pressure.DropCoordinator`, driving the gated KunServe controller
  (groups, exchange, restore by Sec. 4.4's rule, failures).

One change at a time, as in the simulator: no drop while a migration is in flight, no migration
while a drop or restore is executed. The prices come from the simulator's cost model of this
machine (the analytic model on the engine's device, or the Eq. 1 coefficients of ``--profile``)
and the link KV takes here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.pressure import AutoChoice, AutoPressure, ChunkCost, ModelMemory, Prices, Victim
from tidal.runtime.front import Front
from tidal.runtime.migrate import MigrateCoordinator
from tidal.runtime.pressure import DropCoordinator, PressureLog
from tidal.runtime.protocol import Preemption

log = logging.getLogger("tidal.cluster")


def runtime_prices(llm: Any, model: ModelMemory, dtype_bytes: int) -> Prices:
    """What ``auto`` predicts with on this cluster: the simulator's cost model of the device the
    workers run on (``cpu``; a CUDA device by its name, else A100-80G), Eq. 1's coefficients from
    ``--profile`` when given, the host link of that hardware and the link KV takes between workers
    (shared memory for processes, 100 Gb/s Ethernet for Ray actors)."""
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.auto import auto_prices
    from tidal.sim.hardware import HARDWARE, get_hardware
    from tidal.sim.links import get_link
    from tidal.sim.pipeline import analytic_eq1

    cfg, cluster = llm.config, llm.cluster
    name = "cpu"
    if str(cfg.model.device).startswith("cuda"):
        try:
            import torch

            dev = torch.cuda.get_device_name().lower()
        except Exception:  # no device visible here (the front end may run without one)
            dev = ""
        name = next((h for h in HARDWARE if h.split("-")[0] in dev.replace(" ", "")), "a100-80g")
    hw = get_hardware(name)
    arch = llm.engine.arch
    mc = cfg.scheduler.microbatch_cost
    chunk = ChunkCost(*mc) if mc is not None else analytic_eq1(AnalyticCostModel(arch, hw, dtype_bytes=dtype_bytes))
    link = get_link("shm" if cluster.transport == "shm" else "eth-100g", hw)
    prices = auto_prices(chunk, cfg.scheduler.max_num_batched_tokens, hw.step_overhead_s, model, cfg.cache.block_size,
                         hw.host_bandwidth, link, 1, cluster.layers_per_chunk, arch.hidden_size * dtype_bytes)
    log.info("--kv-pressure auto: prices from the %s cost model (%s Eq. 1), link %s", name,
             "profiled" if mc is not None else "analytic", link.name)
    return prices


class _Running(Mapping[int, list[Victim]]):
    """Each instance's running requests as the front end knows them (those with a token streamed
    hold KV), latest arrival first (the scheduler's victim order); built only for those asked about.
    ``queue``: its requests still waiting for their first token instead, in arrival order (the front
    end cannot tell a queued one from one in its prefill: both count as queued)."""

    def __init__(self, llm: Front, queue: bool = False):
        self.llm, self.queue = llm, queue

    def __getitem__(self, i: int) -> list[Victim]:
        llm = self.llm
        bs = llm.monitor.instances[i].block_size
        if self.queue:
            wait = sorted((t for t in llm.requests.values() if t.instance == i and not t.tokens and t.handoff is None),
                          key=lambda t: t.arrival_s)
            return [Victim(len(t.prompt_ids), handoff_blocks(len(t.prompt_ids), bs), False,
                           t.params.max_tokens if t.params.max_tokens is not None
                           else llm.max_model_len - len(t.prompt_ids), t.rid) for t in wait]
        mine = [t for t in llm.requests.values() if t.instance == i and t.tokens and t.handoff is None]
        mine.sort(key=lambda t: (t.priority, t.arrival_s), reverse=True)
        out = []
        for t in mine:
            n = len(t.prompt_ids) + len(t.tokens)
            cap = t.params.max_tokens if t.params.max_tokens is not None else llm.max_model_len - len(t.prompt_ids)
            out.append(Victim(n, handoff_blocks(n, bs), True, max(cap - len(t.tokens), 0)))
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.llm.monitor.instances)))

    def __len__(self) -> int:
        return len(self.llm.monitor.instances)


class _Moves:
    """The migrate coordinator's controller: the moves ``auto`` allows (its migrate instances only)."""

    def __init__(self, auto: AutoPressure):
        self.decide = auto.migrations


class AutoCoordinator(PressureLog):
    def __init__(self, llm: Front, model: ModelMemory, dtype_bytes: int):
        super().__init__()
        self.llm, self.dtype_bytes = llm, dtype_bytes
        self.drop = DropCoordinator(llm, model)
        self.mig = MigrateCoordinator(llm)
        self.auto: AutoPressure | None = None
        self.choices: list[AutoChoice] | None = None  # every choice whole, when a test asks (a list to append to)
        self.initial_mode = llm.config.scheduler.preemption_mode  # what a worker preempts by until told
        self.modes_sent: dict[int, str] = {}  # the preemption mode each worker runs, where it was told or changed

    def on_first_token(self, rid: str, now: float) -> None:
        if self.auto is not None:
            self.auto.first_token(rid, now)

    @property
    def decisions(self) -> Any:
        return self.drop.decisions

    @decisions.setter
    def decisions(self, value: Any) -> None:  # KunServe's plans, with the view each was made on (a test's log)
        self.drop.decisions = value

    def on_layer_bytes(self, layer_bytes: int) -> None:
        self.drop.on_layer_bytes(layer_bytes)

    def _changing(self) -> bool:
        d = self.drop
        return d.executing is not None or bool(d.exchanging) or d.restoring is not None

    def _choice(self, c: AutoChoice) -> None:
        if self.choices is not None:
            self.choices.append(c)

    def tick(self, now: float) -> None:
        """After a report (under the front end's lock): choose at the onsets, then execute."""
        llm = self.llm
        if not llm.ready or not all(r.alive for r in llm.monitor.instances):
            return
        if self.auto is None:  # the undropped pools are the first real reports; the layer bytes are known
            self.auto = AutoPressure(llm.monitor, self.drop.model, runtime_prices(llm, self.drop.model, self.dtype_bytes),
                                     recorder=self._record, decisions=self.drop.decisions, choices=self._choice)
            self.drop.ctl = self.auto  # type: ignore[assignment]  (KunServe's executor drives the gated controller)
            self.mig.ctl = _Moves(self.auto)  # type: ignore[assignment]
        auto = self.auto
        ready = not self._changing() and not self.mig.moving and now >= self.drop.no_restore_until
        for c in auto.onsets(now, _Running(llm), ready, _Running(llm, queue=True)):
            mode = auto.preemption_mode(c.index)
            if self.modes_sent.get(c.index, self.initial_mode) != mode:
                llm.send(c.index, Preemption(mode))
                self.modes_sent[c.index] = mode
        if self.mig.moving:  # a migration in flight: no change of groups until it lands
            auto.observe(now)
        else:
            self.drop.tick(now)
        if not self._changing() and "migrate" in auto.mode.values():
            self.mig.tick(now)

    # the replies, to the coordinator that started what they answer
    # a worker whose layers are dropped preempts by recompute, and as configured once whole again
    # (tidal.engine.pool): what it was told is void
    def on_grouped(self, i: int, *args: Any) -> None:
        self.modes_sent[i] = "recompute"
        self.drop.on_grouped(i, *args)

    def on_exchange_done(self, *args: Any) -> None:
        self.drop.on_exchange_done(*args)

    def on_ungrouped(self, i: int, *args: Any) -> None:
        self.modes_sent.pop(i, None)
        self.drop.on_ungrouped(i, *args)

    def on_restored(self, i: int, role: str, *args: Any) -> None:
        if role != "refused":
            self.modes_sent.pop(i, None)
        self.drop.on_restored(i, role, *args)

    def on_failure(self, i: int, now: float) -> None:
        self.modes_sent.pop(i, None)  # a restarted worker preempts as configured
        self.drop.on_failure(i, now)

    def on_move_end(self, t: Any, move: Any) -> None:
        self.mig.on_move_end(t, move)

    def snapshot(self) -> dict[str, Any]:
        d, m = self.drop.snapshot(), self.mig.snapshot()
        return {**d, "mode": "auto", "migrate": {k: m[k] for k in ("moving", "migrated", "failed")},
                "auto": self.auto.snapshot() if self.auto is not None else None,
                "preemption_modes": {str(k): v for k, v in sorted(self.modes_sent.items())},
                "events_total": dict(self.counts), "events": list(self.events[-32:])}


__all__ = ["AutoCoordinator", "runtime_prices"]
