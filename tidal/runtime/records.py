"""The front end's records: what it knows of each request, and the model facts the HTTP server
reads (no weights: those live in the workers). The configuration is :mod:`tidal.cluster.config`'s
(``ClusterConfig`` is re-exported here)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tidal.cluster.config import ClusterConfig
from tidal.cluster.moves import Move
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams
from tidal.engine.llm_engine import RequestSnapshot
from tidal.runtime.kv_transfer import KVHandle


@dataclass
class Handoff:
    """A move of the request in flight: its state is the pure machine's (:class:`~tidal.cluster.moves.Move`,
    the simulator drives the same one); the rest is what the front end holds for it."""

    move: Move
    meta: RequestSnapshot | None = None  # the snapshot the destination imports (not for a split's beta)
    handles: list[KVHandle] = field(default_factory=list)  # the chunks the source put, in order
    split: int | None = None  # DynaServe: alpha computes KV [0, split) for beta, reserved from the start
    started: bool = False  # the source began (a hand-off's snapshot came, an alpha part was added)
    told: bool = False  # a migration's source was told to start: it will, unless told to stay (or it answers it cannot)
    forwarded: int = 0  # chunks sent on to the current destination
    imported: bool = False  # the current destination got the snapshot
    last_put: bool = False  # the source put its last chunk (and freed the request)
    ended: bool = False

    @property
    def src(self) -> int:
        return self.move.src

    @property
    def dst(self) -> int | None:
        return self.move.dst


@dataclass
class Tracked:
    """The front end's record of a request: enough to re-run it anywhere."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    request_class: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    instance: int = -1
    tokens: list[int] = field(default_factory=list)  # output tokens streamed so far
    text_sent: int = 0
    finished: bool = False
    handoff: Handoff | None = None
    failovers: int = 0
    wid: str = ""  # the id this run has on the workers: rid, then a new one after each fail-over
    split_log: dict[str, Any] | None = None  # its entry in ClusterLLM.splits (split mode)
    arrival_s: float = 0.0  # when the client sent it, on the front end's clock (a re-run keeps its age)
    delivered: bool = False  # an output of it went to the client
    sampled_on: dict[int, int] = field(default_factory=dict)  # split mode: tokens each instance's part sampled

    def __post_init__(self) -> None:
        self.wid = self.wid or self.rid


class FrontEngine:
    """What the server reads of ``llm.engine``: tokenizer, shapes and config (no weights here)."""

    def __init__(self, config: EngineConfig, checkpoint: Any = None):
        from tidal.engine.loader import load_checkpoint
        from tidal.engine.tokenizer import Tokenizer

        self.config = config
        # metadata only: weights load in the workers
        self.checkpoint = checkpoint if checkpoint is not None else load_checkpoint(config.model.model)
        self.arch = self.checkpoint.arch
        self.tokenizer = Tokenizer.from_checkpoint(self.checkpoint)
        mc = config.model
        self.max_model_len = min(mc.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.device, self.dtype = mc.device, mc.dtype


__all__ = ["ClusterConfig", "FrontEngine", "Handoff", "Tracked"]
