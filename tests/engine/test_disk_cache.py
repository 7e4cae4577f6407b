"""The disk cache of a GGUF's metadata, tokenizer and dequantized weights: a second process (here:
a second load with the in-process caches cleared) reads the cache instead of the file, gets exactly
what the file gives, and a changed file is read again."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tidal.engine import disk_cache, loader


@pytest.fixture
def gguf_copy(tmp_path, smol_ckpt, monkeypatch):
    """A private copy of the default GGUF and an empty cache folder for it."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(smol_ckpt.path, path)
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TIDAL_DISK_CACHE_MB", raising=False)
    loader.clear_cache()
    yield str(path)
    loader.clear_cache()


def first_weights(ckpt, n: int = 6) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, t in ckpt.weights():
        out.append((name, t))
        if len(out) == n:
            break
    return out


def test_second_load_reads_the_cache_and_gets_the_same(gguf_copy, monkeypatch):
    from tidal.engine.tokenizer import Tokenizer

    first = loader.load_checkpoint(gguf_copy)
    tok1 = Tokenizer.from_checkpoint(first)
    all_first = list(first.weights())  # a full pass writes the weights
    assert os.path.isfile(disk_cache.cache_path(gguf_copy))
    loader.clear_cache()

    def no_reader(*a, **k):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr("gguf.GGUFReader", no_reader)
    monkeypatch.setattr("gguf.quants.dequantize", no_reader)
    second = loader.load_checkpoint(gguf_copy)
    assert second.arch == first.arch and second.weight_names() == first.weight_names()
    got = list(second.weights())
    assert [n for n, _ in got] == [n for n, _ in all_first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, all_first, strict=True))
    tok2 = Tokenizer.from_checkpoint(second)
    text = "Hello, world! 1234 — ünïcödé <|im_end|>"
    assert tok2.encode(text) == tok1.encode(text) and len(tok2) == len(tok1)
    assert tok2.eos_token_ids == tok1.eos_token_ids and tok2.bos_token_id == tok1.bos_token_id
    msgs = [{"role": "user", "content": "hi"}]
    assert tok2.render_chat(msgs) == tok1.render_chat(msgs)


def test_a_changed_file_is_read_again_and_zero_budget_turns_it_off(gguf_copy, monkeypatch):
    before = disk_cache.cache_path(gguf_copy)
    st = os.stat(gguf_copy)
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert disk_cache.cache_path(gguf_copy) != before
    monkeypatch.setenv("TIDAL_DISK_CACHE_MB", "0")
    assert disk_cache.cache_path(gguf_copy) is None and disk_cache.load_meta(gguf_copy) is None
    first_weights(loader.load_checkpoint(gguf_copy))
    assert not os.path.exists(os.path.join(os.environ["TIDAL_CACHE_DIR"], "weights"))


def test_a_torn_cache_file_is_ignored(gguf_copy):
    ckpt = loader.load_checkpoint(gguf_copy)
    ref = first_weights(ckpt)
    path = disk_cache.cache_path(gguf_copy)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"not a safetensors file")
    loader.clear_cache()
    got = first_weights(loader.load_checkpoint(gguf_copy))  # dequantized from the GGUF again
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref, strict=True))
