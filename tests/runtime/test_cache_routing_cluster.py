"""Cache-aware routing on real workers: conversations whose turns resend their history land on the
instance that holds it, the instances share the conversations, every greedy answer equals one
engine's, and every routing decision replays from its log (the dispatcher is the simulator's)."""

from __future__ import annotations

import asyncio

from tests.runtime.test_cluster import no_leak, settle, wait_gone
from tidal.cluster.decisions import Decision, replay
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONVERSATIONS, TURNS = 6, 4


def user_turns(tokenizer) -> list[list[list[int]]]:
    """Each conversation's user messages as token ids: a long opening, then short follow-ups."""
    topics = ["gardening", "sailing", "chess", "baking", "astronomy", "cycling"]
    out = []
    for k in range(CONVERSATIONS):
        first = tokenizer.encode(f"Let us talk about {topics[k]}. " * 12)
        out.append([first] + [tokenizer.encode(f" Tell me more, part {j}.", add_special_tokens=False)
                              for j in range(1, TURNS)])
    return out


def reference_answers(make_engine, turns) -> list[list[list[int]]]:
    from tidal import LLM

    llm = LLM.from_engine(make_engine(dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False))
    answers = []
    for conv in turns:
        history: list[int] = []
        mine = []
        for msg in conv:
            history = history + msg
            (o,) = llm.generate([{"prompt_token_ids": history}], PARAMS)
            mine.append(o.outputs[0].token_ids)
            history = history + mine[-1]
        answers.append(mine)
    return answers


async def converse(llm, k: int, conv: list[list[int]]) -> list[list[int]]:
    history: list[int] = []
    answers = []
    for j, msg in enumerate(conv):
        history = history + msg
        toks: list[int] = []
        async for o in llm.generate(None, PARAMS, f"c{k}t{j}", prompt_token_ids=history):
            toks += o.outputs[0].delta_token_ids
        answers.append(toks)
        history = history + toks
    return answers


def serve_conversations(make_engine, smol_tokenizer, layout: ClusterLayout, attach) -> None:
    """Two real cache-aware workers in ``layout`` run the conversations (``attach(llm)`` first hooks
    a recorder); every greedy answer equals one engine's, the cache hits, nothing is left behind."""
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    turns = user_turns(smol_tokenizer)
    want = reference_answers(make_engine, turns)
    llm = ClusterLLM(ServingConfig(EngineConfig.from_kwargs(**ENGINE),
                                   ClusterConfig(layout=layout, router="cache-aware", threads_per_instance=1)))
    attach(llm)
    pids: list[int] = []
    try:
        llm.start()
        pids = [h.pid for h in llm.handles if h is not None]

        async def run():
            return await asyncio.gather(*[converse(llm, k, conv) for k, conv in enumerate(turns)])

        assert asyncio.run(run()) == want
        settle(llm)
        no_leak(llm)
        assert llm.stats["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
        wait_gone(pids)


def test_conversations_stay_where_their_history_is_cached(make_engine, smol_tokenizer):
    log: list[Decision] = []

    def attach(llm):
        llm.dispatcher.recorder = log.append

    serve_conversations(make_engine, smol_tokenizer, ClusterLayout(2), attach)
    where = {d.request_id: d.choice for d in log}
    follow = [where[f"c{k}t{j}"] == where[f"c{k}t{j - 1}"] for k in range(CONVERSATIONS) for j in range(1, TURNS)]
    # most later turns go where their history is cached; the rest where load said (the router's cost weighs
    # the queue ahead, and on a loaded machine the workers' progress and so those queues vary: 16 of 18 on
    # one full-suite run, 18 of 18 alone or beside CPU burners)
    assert sum(follow) >= 0.8 * len(follow), where
    assert len({where[f"c{k}t0"] for k in range(CONVERSATIONS)}) == 2  # both instances took conversations
    assert all(d.request.cached for d in log)  # the router saw each instance's cached prefix
    assert [replay(d, ClusterLayout(2), "cache-aware") for d in log] == [d.choice for d in log]


def test_split_mode_places_alpha_where_the_history_is_cached(make_engine, smol_tokenizer):
    """``--mode split --router cache-aware``: the workers' cache reports reach DynaServe's planner,
    which starts most later turns past a cached prefix; every greedy answer equals one engine's."""
    records = []
    planners = []

    def attach(llm):
        planners.append(llm.split.planner)
        llm.split.planner.recorder = records.append

    serve_conversations(make_engine, smol_tokenizer, ClusterLayout(2, "split"), attach)
    assert planners[0].params.flip_roles  # --split-placement load, the default
    later = [r for r in records if not r.decision.request_id.endswith("t0")]
    starts = [(r.decision.alpha or r.decision.beta).context for r in later]
    assert sum(c > 0 for c in starts) >= 0.5 * len(later), starts  # placed past a prefix the view showed
