"""The tokenizer is safe to share between threads by construction: every call into the Rust
tokenizer holds the wrapper's lock, and each role (engine thread, server encoder pool) can have
its own clone. vLLM hit "Already borrowed" exactly here (vllm#40949)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tidal.engine.tokenizer import Tokenizer


class BorrowCheckingHF:
    """Stands in for a Rust tokenizer behind PyO3: a call that enters while another is inside
    raises, as a mutable borrow does."""

    eos_token_id = 0
    bos_token_id = None

    def __init__(self):
        self.inside = 0

    def __len__(self) -> int:
        return 256

    def _enter(self):
        if self.inside:
            raise RuntimeError("Already borrowed")
        self.inside += 1
        time.sleep(0.0005)
        self.inside -= 1

    def encode(self, text, add_special_tokens=True):
        self._enter()
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        self._enter()
        return "".join(chr(i) for i in ids)


def _hammer(tok: Tokenizer, threads: int = 4, rounds: int = 60) -> list[BaseException]:
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(rounds):
                text = f"thread {k} round {i}"
                assert tok.decode(tok.encode(text)) == text
        except BaseException as e:  # collected: the assertion is on the list
            errors.append(e)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def test_concurrent_calls_never_overlap_inside_the_tokenizer():
    errors = _hammer(Tokenizer(BorrowCheckingHF()))
    assert errors == []


def test_concurrent_encode_decode_is_correct_and_clones_are_independent(smol_tokenizer):
    texts = [f"Thread {k}: naïve café ☕ {'emoji 🎉 ' * k} and some ordinary words {k * 37}." * (k + 1)
             for k in range(8)]
    expected = [(smol_tokenizer.encode(t), t) for t in texts]
    clone = smol_tokenizer.clone()
    assert clone.hf is not smol_tokenizer.hf and clone.eos_token_ids == smol_tokenizer.eos_token_ids

    def round_trip(k: int) -> list[tuple[list[int], str]]:
        tok = smol_tokenizer if k % 2 else clone
        out = []
        for _ in range(25):
            ids = tok.encode(texts[k % len(texts)])
            out.append((ids, tok.decode(ids, skip_special_tokens=False)))
        return out

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(round_trip, range(16)))
    for k, res in enumerate(results):
        assert all(r == expected[k % len(texts)] for r in res)


def test_the_server_never_shares_the_engine_threads_tokenizer(smol_tokenizer):
    from tests.server.test_app_unit import FakeAsyncLLM
    from tidal.server.app import build_app

    llm = FakeAsyncLLM("ok")
    llm.engine.tokenizer = smol_tokenizer
    serving = build_app(llm).state.serving
    try:
        for tok in (serving.tokenizer, serving.encoder):
            assert tok is not smol_tokenizer and tok.hf is not smol_tokenizer.hf
        assert serving.encoder.hf is not serving.tokenizer.hf
    finally:
        serving.close()
