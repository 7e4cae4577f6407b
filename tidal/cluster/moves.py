"""A request moving between instances with its KV, as one pure state machine (both shells drive it).

Every way tidal moves a request is the same few steps: pause it on the source, reserve a paused
copy on the destination, send its KV in chunks, land them, resume the copy and free the source;
refusals, failures and time-outs end it in a fallback. :class:`Move` is that machine with no I/O:
the shell (the simulator's event loop, or the real front end) feeds it events and carries out the
commands it returns. The kinds differ only in what a refusal means (:class:`MoveKind`):

- ``handoff`` (BucketServe's P/D hand-off): a refusal is retried on another decode instance
  when one has room (the chunks wait with the shell); a failure recomputes (a prefill instance
  does not decode);
- ``migrate`` (the Llumnix-like baseline) and ``split`` (DynaServe's beta part: alpha keeps the
  whole request): a refusal or a failure leaves the request on its source while the source still
  holds it, else it is recomputed;
- ``exchange`` (KunServe's drop, Sec. 4.2: a member's requests move to the group that replaces
  it): the source retires into the group as the move starts (it holds the request no more), so a
  refusal or a failure recomputes the request (on the group: the shell places a fail-over).

Every step has a deadline (:class:`MoveDeadlines`): a move that cannot finish falls back (the
request stays on its source while its KV is there, else it is recomputed: ``FailOver``), it never
hangs. :func:`moved_request` is the one definition of the copy a destination takes (the arrival
time kept, so the request's latency and its place in any order are the client's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tidal.core.request import Request


class MoveKind(str, Enum):
    HANDOFF = "handoff"
    MIGRATE = "migrate"
    SPLIT = "split"
    EXCHANGE = "exchange"


class Phase(str, Enum):
    RESERVING = "reserving"  # paused on the source; waiting for a destination to hold its copy
    SENDING = "sending"  # reserved: chunks on their way
    LANDED = "landed"  # every chunk written and the copy resumed; waiting for the source to free it
    DONE = "done"  # the copy runs on the destination and the source freed its own: the move is over
    STAYED = "stayed"  # fell back while the KV was on the source: it runs on there
    FAILED_OVER = "failed_over"  # fell back after the source let its KV go: recomputed elsewhere


# ---------------------------------------------------------------- commands (to the shell)
@dataclass(frozen=True)
class Pause:
    instance: int


@dataclass(frozen=True)
class Reserve:
    """Find a destination and reserve ``blocks`` there (the shell answers ``reserved`` or ``refused``)."""

    blocks: int
    dst: int | None = None  # a destination already chosen (a migration's, a split's beta)


@dataclass(frozen=True)
class SendChunk:
    dst: int
    index: int


@dataclass(frozen=True)
class Resume:
    instance: int


@dataclass(frozen=True)
class Release:
    """Drop the destination's reservation (and any KV already there)."""

    instance: int


@dataclass(frozen=True)
class FreeSource:
    instance: int


@dataclass(frozen=True)
class Retry:
    """Ask for a reservation again (``Reserve``) at or after ``at``."""

    at: float


@dataclass(frozen=True)
class FailOver:
    """Recompute the request elsewhere from its prompt and its tokens so far."""

    reason: str


Command = Pause | Reserve | SendChunk | Resume | Release | FreeSource | Retry | FailOver


@dataclass(frozen=True)
class MoveDeadlines:
    """How long each step may take before the move falls back (seconds)."""

    reserve_s: float = 30.0  # paused, waiting for room somewhere
    transfer_s: float = 30.0  # reserved, waiting for the last chunk
    free_s: float = 30.0  # landed, waiting for the source to say it freed the request
    retry_s: float = 0.0  # after a refusal, ask again this much later (0: at the next report)


# a shell where nothing can fail or stall (the simulator): no step times out
NO_DEADLINES = MoveDeadlines(reserve_s=float("inf"), transfer_s=float("inf"), free_s=float("inf"))


@dataclass
class Move:
    """One request's move from ``src``. Feed it events; each returns the commands to carry out."""

    request_id: str
    kind: MoveKind
    src: int
    blocks: int
    num_chunks: int
    dst: int | None = None  # known from the start for a migration and a split
    deadlines: MoveDeadlines = field(default_factory=MoveDeadlines)
    phase: Phase = Phase.RESERVING
    landed: set[int] = field(default_factory=set)
    paused: bool = False  # the source stopped scheduling it
    source_free: bool = False  # the source let its copy (and KV) go: it can no longer resume it
    refusals: int = 0
    deadline: float = float("inf")
    log: list[tuple[float, str]] = field(default_factory=list)  # (time, event): what both shells record

    def start(self, now: float) -> list[Command]:
        """A move to a known destination reserves there first and pauses the source once it has
        room (a migration, a split); a P/D hand-off pauses first (its prefill is done) and waits
        for a decode instance."""
        self.deadline = now + self.deadlines.reserve_s
        self.log.append((now, "start"))
        if self.kind is MoveKind.EXCHANGE:  # the source stopped it and retires into the group
            self.paused = self.source_free = True
        if self.dst is not None:
            return [Reserve(self.blocks, self.dst)]
        self.paused = True
        return [Pause(self.src), Reserve(self.blocks)]

    @property
    def over(self) -> bool:
        return self.phase in (Phase.DONE, Phase.STAYED, Phase.FAILED_OVER)

    # ---------------------------------------------------------------- events
    def reserved(self, dst: int, now: float) -> list[Command]:
        if self.phase is not Phase.RESERVING:
            return []
        self.dst, self.phase = dst, Phase.SENDING
        self.deadline = now + self.deadlines.transfer_s
        self.log.append((now, f"reserved {dst}"))
        out: list[Command] = [] if self.paused else [Pause(self.src)]
        self.paused = True
        return [*out, *(SendChunk(dst, k) for k in range(self.num_chunks))]

    def refused(self, dst: int | None, now: float) -> list[Command]:
        """The destination (or, ``dst`` None, the source: the request finished or was preempted
        before it could move) cannot take the request."""
        if self.over or self.phase is Phase.LANDED or (dst is not None and self.dst is not None and dst != self.dst):
            return []
        self.refusals += 1
        self.log.append((now, f"refused {'source' if dst is None else dst}"))
        if dst is None:  # a destination already reserved lets its reservation (and any KV) go
            return self._stay(now, release=self.dst is not None)
        if self.kind is MoveKind.HANDOFF:  # the chunks wait with the shell: another decode instance may take them
            self.dst, self.phase = None, Phase.RESERVING
            self.landed.clear()
            self.deadline = now + self.deadlines.reserve_s
            return [Retry(now + self.deadlines.retry_s)]
        return self._fall_back(now, "the destination refused it", release=False)

    def unplaceable(self, now: float) -> list[Command]:
        """No instance that could take the request is alive (a P/D hand-off while every decode
        instance is down): it stays on its source while that holds it (P/D degrades to colocated),
        else it is recomputed. Only while it waits for a destination."""
        if self.phase is not Phase.RESERVING:
            return []
        self.log.append((now, "no destination alive"))
        return self._fall_back(now, "no destination is alive", release=False)

    def chunk_landed(self, index: int, now: float) -> list[Command]:
        if self.phase is not Phase.SENDING or not 0 <= index < self.num_chunks or index in self.landed:
            return []
        self.landed.add(index)
        return self._all_landed(now) if len(self.landed) >= self.num_chunks else []

    def all_landed(self, now: float) -> list[Command]:
        """The destination says every chunk landed at once (the runtime's ``Landed``: its worker
        counts the chunks, and a streamed split's count is known only when alpha reaches its
        split point)."""
        if self.phase is not Phase.SENDING:
            return []
        self.landed = set(range(self.num_chunks))
        return self._all_landed(now)

    def _all_landed(self, now: float) -> list[Command]:
        assert self.dst is not None
        self.phase = Phase.LANDED
        self.deadline = now + self.deadlines.free_s
        self.log.append((now, f"landed {self.dst}"))
        out: list[Command] = [Resume(self.dst)]
        if self.source_free:
            return out + self._done(now)
        return [*out, FreeSource(self.src)]

    def source_freed(self, now: float) -> list[Command]:
        """The source let its copy go (after its last chunk, or told to by ``FreeSource``)."""
        if self.over or self.source_free:
            return []
        self.source_free = True
        return self._done(now) if self.phase is Phase.LANDED else []

    def failed(self, instance: int, now: float) -> list[Command]:
        """Instance ``instance`` died."""
        if self.over or instance not in (self.src, self.dst):
            return []
        self.log.append((now, f"failed {instance}"))
        if instance == self.src:
            self.source_free = True  # whatever it held is gone
            if self.phase is Phase.LANDED:  # the copy runs on the destination already
                return self._done(now)
            return self._fall_back(now, "the source failed mid-move", release=self.dst is not None)
        if self.phase is Phase.LANDED:  # the new copy is lost with its instance
            return self._fail_over(now, "the destination failed", release=False)
        if self.kind is MoveKind.HANDOFF:  # recompute: a prefill instance does not decode
            return self._fail_over(now, "the destination failed mid-move", release=False)
        return self._fall_back(now, "the destination failed mid-move", release=False)

    def lost(self, now: float) -> list[Command]:
        """The KV on its way cannot be read any more (its owner died, or it was released): the
        move cannot finish. A hand-off is recomputed (a prefill instance does not decode); any
        other move falls back (the source keeps the request while it holds it)."""
        if self.over or self.phase is Phase.LANDED:
            return []
        self.log.append((now, "lost"))
        if self.kind is MoveKind.HANDOFF:
            return self._fail_over(now, "its KV was lost on the way", release=self.dst is not None)
        return self._fall_back(now, "its KV was lost on the way", release=self.dst is not None)

    def tick(self, now: float) -> list[Command]:
        """Time passed: a step past its deadline falls back (the move never hangs)."""
        if self.over or now < self.deadline:
            return []
        self.log.append((now, f"timed out {self.phase.value}"))
        if self.phase is Phase.LANDED:  # the copy runs: the source's is freed regardless
            self.source_free = True
            return [FreeSource(self.src), *self._done(now)]
        return self._fall_back(now, f"the move timed out {self.phase.value}", release=self.dst is not None)

    # ---------------------------------------------------------------- endings
    def _done(self, now: float) -> list[Command]:
        self.phase = Phase.DONE
        self.log.append((now, "done"))
        return []

    def _fall_back(self, now: float, reason: str, release: bool) -> list[Command]:
        """The request stays on its source while that still holds it, else it is recomputed."""
        return self._fail_over(now, reason, release) if self.source_free else self._stay(now, release)

    def _stay(self, now: float, release: bool = False) -> list[Command]:
        out: list[Command] = [Release(self.dst)] if release and self.dst is not None else []
        self.phase = Phase.STAYED
        self.log.append((now, "stayed"))
        return [*out, Resume(self.src)] if self.paused and not self.source_free else out

    def _fail_over(self, now: float, reason: str, release: bool) -> list[Command]:
        out: list[Command] = [Release(self.dst)] if release and self.dst is not None else []
        if not self.source_free:
            out.append(FreeSource(self.src))
        self.phase = Phase.FAILED_OVER
        self.log.append((now, f"failed over: {reason}"))
        return [*out, FailOver(reason)]


@dataclass(frozen=True)
class MoveRecord:
    """How one move went, as both shells record it (their same-decision tests compare these): the
    request, the kind, where from and to, how it ended and its events in order (times left out:
    the shells' clocks differ)."""

    request_id: str
    kind: str
    src: int
    dst: int | None
    outcome: str  # done | stayed | failed_over | dropped (ended from outside: the request finished, was aborted)
    events: tuple[str, ...]

    @classmethod
    def of(cls, move: Move, request_id: str | None = None) -> MoveRecord:
        return cls(request_id or move.request_id, move.kind.value, move.src, move.dst,
                   move.phase.value if move.over else "dropped", tuple(e for _, e in move.log))


def moved_request(req: Request, with_kv: bool) -> Request:
    """The copy a destination takes: the request's tokens, parameters, priority and class, its
    arrival time and first-token times (its latency is the client's, not the move's), and its
    computed KV when that moves with it (else it recomputes). Its last token's time stays with
    the source (a split's beta part takes alpha's with alpha's tokens)."""
    new = Request(req.request_id, list(req.prompt_token_ids), req.sampling_params, arrival_time=req.arrival_time,
                  eos_token_ids=req.eos_token_ids, priority=req.priority, request_class=req.request_class)
    new.block_hashes = list(req.block_hashes)  # its blocks' names (the simulator's come from a trace, not its tokens)
    new.num_cached_tokens = req.num_cached_tokens
    new.output_token_ids = list(req.output_token_ids)
    new.num_computed_tokens = req.num_computed_tokens if with_kv else 0
    new.num_preemptions = req.num_preemptions
    new.first_scheduled_time, new.first_token_time = req.first_scheduled_time, req.first_token_time
    return new


__all__ = ["NO_DEADLINES", "Command", "FailOver", "FreeSource", "Move", "MoveDeadlines", "MoveKind", "MoveRecord", "Pause", "Phase", "Release",
           "Reserve", "Resume", "Retry", "SendChunk", "moved_request"]
