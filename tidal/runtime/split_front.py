"""``--mode split`` in the real cluster: the front end's side of DynaServe's micro-requests.

For each new request the planner (:class:`tidal.cluster.split.SplitPlanner`, Alg. 1, the object
the simulator drives too) names a pair of live instances and a split point ``s``. Alpha gets an
``add`` with ``pause_at = s``; beta's part is a move (:class:`tidal.cluster.moves.Move`, kind
``split``, driven by :mod:`tidal.runtime.handoffs`): beta gets a ``reserve``, alpha's worker streams
the KV it computes and, at the split point, says ``split_done`` with the tokens it sampled, which
go to beta as ``finish`` (Sec. 4.3). If beta cannot take its part, alpha keeps the whole request
(``stay``), or, when alpha already let it go, the request is recomputed elsewhere. The planner's step-time model is a
profile table every worker's step report fills (Sec. 4.1: the predictor "continuously calibrates
itself"); until the first report it counts tokens.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from tidal.cluster.moves import MoveKind
from tidal.runtime.front import Front
from tidal.runtime.protocol import Add, Finish
from tidal.runtime.records import Tracked

SPLIT_LOG = 4096  # split decisions kept for /admin/splits


class SplitCoordinator:
    def __init__(self, cluster: Front, planner: Any = None):
        self.c = cluster
        self.step_table: Any = None  # a ProfileTable, when the default planner is used
        self.planner = planner if planner is not None else self._default_planner()
        self.log: deque[dict[str, Any]] = deque(maxlen=SPLIT_LOG)  # the latest split decisions
        self.num_splits = 0

    def _default_planner(self) -> Any:
        from tidal.cluster.split import SplitParams, SplitPlanner
        from tidal.policies.profile_table import ProfileTable

        sc = self.c.config.scheduler
        self.step_table = ProfileTable()
        # DynaServe Sec. 3.1: with --split-placement load (the default) either instance of a pair may be alpha
        return SplitPlanner(SplitParams(token_budget=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
                                        flip_roles=self.c.cluster.split_placement == "load"), self.step_table.predict)

    def record_step(self, status: Any) -> None:
        """A worker's step report (DynaServe Alg. 2 line 1 RECORD, with the prefill chunks' own
        prefix), for Alg. 1's predictor; its token budget joins the instance's recent budgets the
        predictions use (Sec. 4.1), as in the simulator."""
        if not status.step_time_s:
            return
        on_budget = getattr(self.planner, "on_budget", None)  # a planner given by a test may not keep budgets
        if status.token_budget and on_budget is not None:
            on_budget(status.index, status.token_budget)
        if self.step_table is not None:
            self.step_table.record(status.step_prefill_tokens, status.step_decode_context, status.step_decode_count,
                                   status.step_time_s, prefix=status.step_prefill_prefix, sq=status.step_prefill_sq)

    def live_pairs(self) -> list[tuple[int, int]]:
        alive = {r.index for r in self.c.monitor.instances if r.alive}
        return [p for p in self.c.layout.pairs() if p[0] in alive and p[1] in alive]

    def cached(self, t: Tracked) -> dict[int, int] | None:
        """With ``--router cache-aware`` and prefix caching: the prompt tokens each instance holds cached
        (the monitor's views, from the workers' reports), for the planner's placement; else None."""
        c = self.c
        if not c.cache_routing:
            return None
        from tidal.core.block_hash import block_hashes

        names = tuple(block_hashes(t.prompt_ids, c.config.cache.block_size, t.params.cache_salt))
        return {r.index: r.cached_tokens(names) for r in c.monitor.instances if r.alive}

    def place(self, t: Tracked) -> bool | None:
        """The planner's pair and split point (Alg. 1); None when no pair is alive (the request then
        runs whole wherever the router puts it)."""
        c = self.c
        pairs = self.live_pairs()
        if not pairs or t.params.n > 1:  # a hand-off moves one sequence: n > 1 runs whole
            return None
        max_tokens = t.params.max_tokens or max(1, c.max_model_len - len(t.prompt_ids))
        d = self.planner.plan(t.rid, len(t.prompt_ids), max_tokens, None, c.now(), candidates=pairs,
                              cached=self.cached(t))
        alpha, beta = d.pair
        s = d.split
        whole = beta if d.alpha is None else (alpha if d.beta is None else None)
        self.num_splits += whole is None
        self.log.append({"request_id": t.rid, "pair": [alpha, beta], "split": s, "prompt_len": d.prompt_len,
                         "predicted_output": d.predicted_output, "whole_on": whole, "kv_bytes": 0})
        t.split_log = self.log[-1]
        t.instance = alpha if whole is None else whole
        c.monitor.on_dispatch(t.instance, t.rid, c.now())
        if whole is not None:
            c.send(whole, Add(t.wid, t.prompt_ids, t.params, t.priority, t.request_class))
            return True
        blocks = -(-s // c.monitor.instances[beta].block_size)
        c.send(alpha, Add(t.wid, t.prompt_ids, t.params, t.priority, t.request_class, s))
        # the move machine reserves beta (``reserve``); a refusal there ends in alpha keeping it whole
        c.begin_move(t, MoveKind.SPLIT, alpha, blocks, dst=beta, split=s, started=True)
        return True

    def on_split_done(self, i: int, rid: str, tokens: list[int], last_token_time: float | None) -> None:
        """Alpha reached its split point and let its part go (its last chunk is on its way): beta
        gets alpha's tokens and the time of the last one (a monotonic time: one clock for this
        host's processes)."""
        c = self.c
        t = c.by_wid.get(rid)
        if t is None:
            return
        h = t.handoff
        if h is None or h.split is None or h.dst is None:
            c.monitor.on_finish(i, rid)
            c.failover(t)  # alpha let go of a request whose beta part was refused: recompute
            return
        self.planner.on_handoff(rid)
        c.send(h.dst, Finish(rid, list(tokens), t.text_sent, last_token_time))
        c.carry_out(t, h.move.source_freed(c.now()))


__all__ = ["SPLIT_LOG", "SplitCoordinator"]
