"""The typed control protocol between the cluster front end and its workers.

One frozen dataclass per command (front end -> worker) and per reply (worker -> front end); each
side dispatches on the message's type through a table, so a new message is a class and a handler,
never a tuple position. Every frame carries :data:`PROTOCOL_VERSION`: a worker started from another
checkout (a Ray actor, say) fails loudly instead of misreading fields. KV never travels here,
only :class:`tidal.runtime.kv_transfer.KVHandle`s naming the chunks.

The commands and what they do are described on :class:`tidal.runtime.worker.Worker`'s handlers.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 4


class ProtocolError(RuntimeError):
    """A frame that is not this protocol (another version, or not a message at all)."""


# ---------------------------------------------------------------- commands (front end -> worker)
@dataclass(frozen=True)
class Add:
    """A new request; ``pause_at``: DynaServe's alpha part, which pauses at its split point and
    streams its KV to its beta part; ``whole``: a prefill instance runs it to its end (no decode
    instance is alive to hand it to)."""

    request_id: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    priority: int = 0
    request_class: str = "online"
    pause_at: int | None = None
    whole: bool = False


@dataclass(frozen=True)
class Reserve:
    """DynaServe's beta part: a paused request whose first ``num_kv_tokens`` of KV stream in."""

    request_id: str
    prompt_ids: list[int]
    params: Any
    priority: int
    request_class: str
    num_kv_tokens: int


@dataclass(frozen=True)
class Import:
    """A snapshot without KV: ``paused`` when its KV follows in chunks, recomputed otherwise
    (``whole``: as :class:`Add`'s)."""

    snapshot: Any  # RequestSnapshot
    paused: bool
    whole: bool = False


@dataclass(frozen=True)
class KVChunk:
    """One chunk of a request's KV: a reply from the exporting worker, then a command to the
    importing one (the last chunk of a hand-off resumes the request)."""

    request_id: str
    handle: Any  # KVHandle
    last: bool


@dataclass(frozen=True)
class Finish:
    """Alpha's sampled tokens, for its beta part: resumes it once all its KV is here."""

    request_id: str
    tokens: list[int]
    text_sent: int
    last_token_time: float | None


@dataclass(frozen=True)
class Stay:
    """A move fell back while this source still held the request: keep it (stop its export, clear
    a split point) and run it on to its end (a prefill instance hands it off no more). A source
    that already let it go answers ``Refused``."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Migrate:
    """Move a running request with its KV, as a hand-off (the Llumnix-like baseline)."""

    request_id: str


@dataclass(frozen=True)
class Group:
    """KunServe: become the head or a stage of a pipeline group."""

    spec: Any  # tidal.runtime.group.GroupSpec


@dataclass(frozen=True)
class Ungroup:
    """A member of this worker's group failed: restore the dropped layers and serve alone."""


@dataclass(frozen=True)
class Restore:
    """KunServe Sec. 4.4: the pressure is gone; restore the group's layers, overlapped with serving."""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget every cached prefix block (``POST /reset_prefix_cache``); blocks in use stay."""


@dataclass(frozen=True)
class Preemption:
    """``--kv-pressure auto``: preempt by ``mode`` (recompute or swap) from now on."""

    mode: str


COMMANDS = (Add, Reserve, Import, KVChunk, Finish, Stay, Abort, Migrate, Group, Ungroup, Restore, Shutdown,
            ResetPrefixCache, Preemption)


# ---------------------------------------------------------------- replies (worker -> front end)
@dataclass(frozen=True)
class Ready:
    status: Any  # InstanceStatus
    weights: str
    layer_bytes: int
    node: str = ""  # where it runs: the Ray node's id, or the host's name
    pid: int = 0
    host: str = ""  # the host's name (a Ray actor's too)


@dataclass(frozen=True)
class Out:
    """The outputs of a step and the instance's status after it."""

    outputs: list[Any]  # RequestOutput
    status: Any


@dataclass(frozen=True)
class Idle:
    status: Any


@dataclass(frozen=True)
class Rejected:
    """The request can never run here (:class:`tidal.core.scheduler.RequestRejected`): the
    client's error, with the parameter to blame."""

    request_id: str
    message: str
    param: str | None = None


@dataclass(frozen=True)
class HandoffStarted:
    """A request paused for a hand-off: its snapshot (no KV); ``num_chunks`` chunks follow."""

    request_id: str
    snapshot: Any
    blocks: int
    num_chunks: int


@dataclass(frozen=True)
class SplitDone:
    """An alpha part reached its split point; all its chunks were sent."""

    request_id: str
    tokens: list[int]
    last_token_time: float | None


@dataclass(frozen=True)
class Landed:
    """An import (a hand-off's, or a reservation) has all its KV and runs."""

    request_id: str


@dataclass(frozen=True)
class Refused:
    """An import or reservation found no room, or (``kv_lost``) its KV could not be read: gone
    with its owner, or released; a retry with the same chunks would fail the same way."""

    request_id: str
    reason: str
    kv_lost: bool = False


@dataclass(frozen=True)
class Unmoved:
    """A migration the source cannot start (the request finished or waits preempted)."""

    request_id: str


@dataclass(frozen=True)
class Grouped:
    """A drop took effect: ``role`` head (``request_ids`` moved here) or tail (``request_ids`` it
    could not move: re-run them)."""

    role: str
    members: tuple[int, ...]
    request_ids: list[str]
    num_blocks: int
    layer_ids: list[int]


@dataclass(frozen=True)
class ExchangeDone:
    """Every request's KV is where the group needs it; ``moves``: how each request's move into the
    group went (:class:`tidal.cluster.moves.MoveRecord`, kind ``exchange``)."""

    members: tuple[int, ...]
    exchanged: int
    moved: int
    moves: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Ungrouped:
    """This worker left a failed group: ``lost`` lost their KV of the peers' layers."""

    lost: list[str]
    num_blocks: int


@dataclass(frozen=True)
class Restored:
    """A member reloaded its layers (``role`` head / tail) or the head refused (``refused``)."""

    role: str
    num_blocks: int
    layer_ids: list[int]
    num_back: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Log:
    """A line the worker printed while it started (a Ray actor's own output goes to Ray's logs):
    the front end prints it on its own stderr."""

    line: str


@dataclass(frozen=True)
class Fatal:
    """The worker failed (an exception other than a client's rejection): it exits after this."""

    error: str
    traceback: str = ""


REPLIES = (Ready, Out, Idle, Rejected, HandoffStarted, KVChunk, SplitDone, Landed, Refused, Unmoved, Grouped,
           ExchangeDone, Ungrouped, Restored, Log, Fatal)


# ---------------------------------------------------------------- frames
def encode_command(cmd: Any) -> bytes:
    if not isinstance(cmd, COMMANDS):
        raise TypeError(f"not a worker command: {cmd!r}")
    return pickle.dumps((PROTOCOL_VERSION, cmd), protocol=pickle.HIGHEST_PROTOCOL)


def decode_command(raw: bytes) -> Any:
    version, cmd = _frame(raw, 2)
    if not isinstance(cmd, COMMANDS):
        raise ProtocolError(f"not a worker command: {type(cmd).__name__}")
    return cmd


def encode_reply(index: int, generation: int, reply: Any) -> bytes:
    if not isinstance(reply, REPLIES):
        raise TypeError(f"not a worker reply: {reply!r}")
    return pickle.dumps((PROTOCOL_VERSION, index, generation, reply), protocol=pickle.HIGHEST_PROTOCOL)


def decode_reply(raw: bytes) -> tuple[int, int, Any]:
    """(worker index, its generation, the reply)."""
    _, index, generation, reply = _frame(raw, 4)
    if not isinstance(reply, REPLIES):
        raise ProtocolError(f"not a worker reply: {type(reply).__name__}")
    return index, generation, reply


def _frame(raw: bytes, size: int) -> tuple:
    frame = pickle.loads(raw)
    if not isinstance(frame, tuple) or len(frame) != size:
        raise ProtocolError("not a frame of tidal's worker protocol")
    if frame[0] != PROTOCOL_VERSION:
        raise ProtocolError(f"worker protocol version {frame[0]!r}, this front end speaks {PROTOCOL_VERSION}: "
                            "the front end and its workers run different tidal versions")
    return frame


__all__ = ["COMMANDS", "PROTOCOL_VERSION", "REPLIES", "Abort", "Add", "ExchangeDone", "Fatal", "Finish", "Group",
           "Grouped", "HandoffStarted", "Idle", "Import", "KVChunk", "Landed", "Log", "Migrate", "Out", "ProtocolError",
           "Ready", "Refused", "Rejected", "Reserve", "Restore", "Restored", "Shutdown", "SplitDone", "Ungroup",
           "Stay", "Ungrouped", "Unmoved", "decode_command", "decode_reply", "encode_command", "encode_reply"]
