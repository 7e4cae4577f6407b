"""``tidal bench serve --workload conversation`` against a real tidal server: each turn sends the
previous answer as the server produced it, and the server's prefix cache hits it (usage
``prompt_tokens_details.cached_tokens``): with token ids, exactly the full blocks of the previous
prompt and answer."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tidal.cli import main as cli_main

BLOCK = 16  # the server's default --block-size
CONV = "conversation:turns=2,user=40,answer=24,user_sigma=0,answer_sigma=0,think=0.05"


def _bench(server, tmp_path, capsys, *flags: str) -> dict:
    out = tmp_path / "conv.json"
    salt = uuid.uuid4().hex  # this run's blocks only: a rerun in the same session shares nothing
    code = cli_main(["bench", "serve", "--base-url", server.url, "--workload", CONV, "--num-requests", "2",
                     "--warmup-requests", "0", "--no-progress", "--no-plots", "--extra-body",
                     json.dumps({"cache_salt": salt}), "--output", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 0, err
    res = json.loads(out.read_text())
    assert res["completed"] == 2, res["errors"]
    return res


def test_token_id_turns_hit_the_previous_prompt_and_answer(server, tmp_path, capsys):
    res = _bench(server, tmp_path, capsys, "--endpoint", "completions", "--prompt-format", "ids")
    first, second = sorted(res["requests"], key=lambda r: r["send_s"])
    p1 = first["prompt_tokens"]
    assert p1 == 40 and first["cached_tokens"] == 0 and first["output_tokens"] == 24
    assert second["prompt_tokens"] == p1 + 24 + 40  # the history: prompt, the answer's 24 ids, a new message
    # every full block of turn 1's prompt and answer (its last token's KV is never computed)
    assert second["cached_tokens"] == (p1 + 24 - 1) // BLOCK * BLOCK
    assert res["cached_prompt_share"] == pytest.approx(second["cached_tokens"] / (p1 + second["prompt_tokens"]))
    assert second["send_s"] >= first["end_s"]


def test_chat_turns_hit_the_previous_prompt(server, tmp_path, capsys):
    res = _bench(server, tmp_path, capsys, "--endpoint", "chat", "--prompt-format", "text")
    first, second = sorted(res["requests"], key=lambda r: r["send_s"])
    p1 = first["prompt_tokens"]
    # the chat template renders turn 1's prompt as the start of turn 2's, then the answer's text
    assert second["prompt_tokens"] > p1 + 40
    assert second["cached_tokens"] >= p1 // BLOCK * BLOCK > 0


def test_completions_return_token_ids(server):
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]
    ids = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
    assert len(ids["choices"][0]["token_ids"]) == 5 and ids["choices"][0]["text"] == plain["choices"][0]["text"]
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "return_token_ids": True, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["token_ids"]
    assert streamed == ids["choices"][0]["token_ids"]
