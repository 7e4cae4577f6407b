"""The typed worker protocol (tidal.runtime.protocol): frames carry a version and only its
messages; every command has a worker handler and every reply a front-end handler; a client's
RequestRejected is answered as a rejection while any other exception in a worker is the worker's
failure, which the front end counts and fails over (the request re-runs on another instance)."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import RequestRejected
from tidal.runtime import protocol as P

PARAMS = SamplingParams(temperature=0, max_tokens=4)


def test_frames_round_trip_and_refuse_other_versions_and_untyped_messages():
    cmd = P.Add("r", [1, 2], PARAMS, 0, "online", 3)
    assert P.decode_command(P.encode_command(cmd)) == cmd
    assert P.decode_reply(P.encode_reply(2, 5, P.Landed("r"))) == (2, 5, P.Landed("r"))
    with pytest.raises(P.ProtocolError, match="version 0"):
        P.decode_command(pickle.dumps((0, cmd)))
    with pytest.raises(P.ProtocolError, match="not a frame"):
        P.decode_command(pickle.dumps(("add", "r", [1], PARAMS, 0, "online", None)))  # the old tuples
    with pytest.raises(P.ProtocolError, match="not a worker command"):
        P.decode_command(pickle.dumps((P.PROTOCOL_VERSION, P.Landed("r"))))
    with pytest.raises(TypeError):
        P.encode_command(("abort", "r"))
    with pytest.raises(TypeError):
        P.encode_reply(0, 0, P.Abort("r"))


def test_every_message_has_a_handler_on_its_receiving_side():
    from tidal.runtime.cluster import ClusterLLM
    from tidal.runtime.worker import Worker

    assert set(Worker.__new__(Worker)._handler_table()) == set(P.COMMANDS)
    assert set(ClusterLLM.__new__(ClusterLLM)._reply_table()) == set(P.REPLIES)


class _Engine:
    """A stand-in engine whose add_request fails as told."""

    def __init__(self, error: BaseException):
        self.error = error

    def add_request(self, *args, **kwargs):
        raise self.error


def _worker(error: BaseException):
    from tidal.runtime.worker import Worker

    w = Worker.__new__(Worker)
    w.engine, w.exports, w.said = _Engine(error), [], []
    w.send = w.said.append
    w._handlers = w._handler_table()
    return w


def test_only_a_rejection_is_a_clients_error_in_a_worker():
    w = _worker(RequestRejected("too long", param="max_tokens"))
    w.handle(P.Add("r", [1], PARAMS))
    assert w.said == [P.Rejected("r", "too long", "max_tokens")]
    w = _worker(ValueError("an internal bug"))  # once answered as a rejection: now the worker fails
    with pytest.raises(ValueError, match="internal bug"):
        w.handle(P.Add("r", [1], PARAMS))
    assert w.said == []


class _Handle:
    sentinel, pid = None, 4242

    def __init__(self):
        self.joined = False

    def alive(self) -> bool:
        return not self.joined

    def join(self, timeout: float) -> None:
        self.joined = True


def test_a_fatal_reply_is_counted_as_a_failure_and_its_requests_fail_over():
    """No worker process: the front end's books only (ClusterLLM built, never started)."""
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig
    from tidal.runtime.records import Tracked

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(dtype="float32"),
        ClusterConfig(layout=ClusterLayout(2, "colocate"), restart=False, threads_per_instance=1)))
    try:
        for rec in llm.monitor.instances:
            rec.alive = True
        llm.handles = [_Handle(), _Handle()]
        loop = asyncio.new_event_loop()
        t = Tracked("r", [1, 2, 3], PARAMS, 0, "online", loop, asyncio.Queue(), instance=0, tokens=[7])
        llm.requests["r"] = llm.by_wid["r"] = t
        llm.monitor.on_dispatch(0, "r", 0.0)
        llm._on_reply(0, 0, P.Fatal("KeyError: 'x'", "traceback"))
        assert llm.num_failures == 1 and llm.num_failovers == 1 and llm.handles[0] is None
        assert not llm.monitor.instances[0].alive and llm.generation[0] == 1
        assert t.instance == 1 and t.wid == "r~1" and llm.by_wid == {"r~1": t}
        (i, cmd), = list(llm.outbox.queue)  # re-run on 1 from its prompt and the token streamed
        assert i == 1 and isinstance(cmd, P.Import) and cmd.snapshot.output_token_ids == [7]
        llm._on_reply(0, 0, P.Out([], SimpleNamespace()))  # late news from the dead generation: ignored
        loop.close()
    finally:
        llm.handles = [None, None]
        llm.shutdown()
