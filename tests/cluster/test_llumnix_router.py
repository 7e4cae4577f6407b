"""``llumnix``: Llumnix's freeness (free KV blocks per outstanding request) against ``kv-aware``'s
free blocks, worked by hand; and the case it is for, a KunServe group whose pool grew but whose
compute did not."""

from __future__ import annotations

from tidal.cluster.router import KVAwareRouter, LlumnixGroupRouter, LlumnixRouter, RouteRequest, build_router


class Load:
    def __init__(self, outstanding, free, total=100, queued=0):
        self.num_outstanding, self.num_free_blocks, self.num_blocks = outstanding, free, total
        self.queued_block_demand, self.block_size = queued, 16


REQ = RouteRequest("r", 160, 10)  # 161 tokens: 11 blocks


def test_freeness_by_hand():
    # free after the queue and the request: 39, 9, -1, 49; per outstanding request: 13, 9, -1 (x1), 24.5
    loads = [Load(3, 50), Load(1, 20), Load(1, 90, queued=80), Load(2, 60)]
    assert LlumnixRouter().route(REQ, loads) == 3
    # 30 free blocks for 1 request beat 100 for 10; kv-aware takes the larger free share instead
    loads = [Load(10, 111, total=200), Load(1, 41, total=100)]
    assert LlumnixRouter().route(REQ, loads) == 1 and KVAwareRouter().route(REQ, loads) == 0
    # overloaded instances (the request does not fit after the queue) rank by shortage x requests
    loads = [Load(4, 5), Load(1, 0)]  # -6 x 4 = -24 against -11 x 1
    assert LlumnixRouter().route(REQ, loads) == 1
    assert build_router("llumnix").name == "llumnix"


def test_a_merged_group_holding_many_requests_draws_fewer():
    """After a drop, a pair's pool is 4.4 instances' blocks (15,516 against 3,558: the weights it freed)
    and it runs its members' requests and those of the exchange. kv-aware reads the pool: it sends
    the group every arrival until the group's pool is as full, in share, as the others'; llumnix
    reads blocks per request and sends the burst to the singles, so their queues (and throttles) show."""
    def arrivals(router):
        group = Load(200, 7000, total=15516)  # 45 % free, 35 blocks a request
        singles = [Load(20, 1200, total=3558) for _ in range(6)]  # 34 % free, 60 blocks a request
        loads = [group, *singles]
        sent = [0] * len(loads)
        for _ in range(60):
            i = router.route(REQ, loads)
            sent[i] += 1
            loads[i].num_outstanding += 1
            loads[i].queued_block_demand += 11
        return sent

    assert arrivals(KVAwareRouter())[0] == 60
    assert arrivals(LlumnixRouter())[0] < 10


def test_a_group_with_a_prefill_queue_yields_to_an_instance_without_one():
    """llumnix-group (tidal's ablation): a group whose pool grew five-fold (the weights it dropped)
    but whose compute only doubled: by freeness alone (llumnix, the paper's dispatcher) it takes
    every arrival of a burst and queues them for its prefill while the singles' queues stay empty;
    with its queue per member longer than the shortest, llumnix-group does not send it more."""
    group = Load(150, 7000, total=13800)
    group.group, group.num_queued = (6, 3), 4  # 2 a member
    singles = [Load(60, 270, total=2685) for _ in range(6)]
    for s in singles:
        s.num_queued = 0
    assert LlumnixGroupRouter().route(REQ, [group, *singles]) == 1  # the freest single, not the group
    assert LlumnixRouter().route(REQ, [group, *singles]) == 0  # plain freeness: the group
    group.num_queued = 0  # its queue drained: its freeness counts again
    assert LlumnixGroupRouter().route(REQ, [group, *singles]) == 0
    # instances without the attributes (no groups, no queue counts) route by freeness alone
    plain = [Load(150, 7000, total=13800), *[Load(60, 270) for _ in range(6)]]
    assert LlumnixGroupRouter().route(REQ, plain) == LlumnixRouter().route(REQ, plain) == 0
    assert build_router("llumnix-group").name == "llumnix-group"
