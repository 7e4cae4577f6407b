"""Tokenizer wrapper and the streaming (incremental) detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.engine.loader import load_checkpoint
from tidal.engine.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "héllo naïve café — Ünïcödé façade, crème brûlée",
    "世界你好，这是一个测试。日本語のテキストも。한국어 문장",
    "emoji: 🎉🎉 👩‍👩‍👧‍👦 🇫🇷 ✨ done",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # ok\n\tTAB",
    "  leading and trailing spaces  \n\n",
    "mixed: a€b𝄞c\u00a0d\u200be",
]

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(smol_tokenizer) -> Tokenizer:
    """``Tokenizer.from_checkpoint(load_checkpoint(None))``, built once per session (conftest)."""
    return smol_tokenizer


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, chunks: list[int] | None = None,
            skip_special_tokens: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens=skip_special_tokens)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        step = chunks[k % len(chunks)] if chunks else 1
        deltas.append(d.add_tokens(ids[i:i + step]))
        i, k = i + step, k + 1
    deltas.append(d.flush())
    return deltas, d


# ------------------------------------------------------------------------------------ Tokenizer
def test_attributes(tok: Tokenizer):
    assert tok.vocab_size == len(tok.hf) == 49152
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.name == "SmolLM2-135M-Instruct.Q4_1"
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True) == text
    assert tok.encode(text, add_special_tokens=False) == tok.hf.encode(text, add_special_tokens=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans())
def test_decode_takes_the_rust_path_and_equals_transformers(tok: Tokenizer, ids: list[int], skip: bool):
    """Any ids (special tokens, partial characters): the Rust object's decode, which tidal calls directly,
    gives transformers' text."""
    assert tok._rust() is not None
    assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_decode_with_space_clean_up_goes_through_transformers(tok: Tokenizer, monkeypatch):
    twin = tok.clone()
    monkeypatch.setattr(twin.hf, "clean_up_tokenization_spaces", True, raising=False)
    assert twin._rust() is None
    ids = twin.encode("a , b .")
    assert twin.decode(ids) == twin.hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_decode(tok: Tokenizer):
    ids = tok.encode("hi") + [2]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"
    assert tok.token_str(2) == "<|im_end|>"
    assert tok.token_str(tok.encode(" world")[0]) == " world"


def test_chat_template_chatml(tok: Tokenizer):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.render_chat(msgs)
    assert text == SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(msgs, add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.apply_chat_template(msgs)
    assert ids == list(tok.hf.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... <|im_end|> (system, user)
    assert tok.decode(ids, skip_special_tokens=False) == text
    with_system = [{"role": "system", "content": "Be brief."}] + msgs
    assert tok.render_chat(with_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_no_chat_template(tok: Tokenizer, monkeypatch):
    monkeypatch.setattr(tok.hf, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_directory_tokenizer(tok: Tokenizer, tmp_path):
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=tok.vocab_size)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path), safe_serialization=True)
    tok.hf.save_pretrained(str(tmp_path))
    t2 = Tokenizer.from_checkpoint(load_checkpoint(str(tmp_path)))
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert t2.render_chat([{"role": "user", "content": "x"}]) == tok.render_chat([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------------------------ detokenizer
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [None, [2, 1, 3], [7]])
def test_detokenizer_streams_exact_text(tok: Tokenizer, text: str, chunks):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "say something"}])
    deltas, d = _stream(tok, ids, prompt, chunks)
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    assert d.output_ids == ids
    for delta in deltas:
        assert "\ufffd" not in delta


def test_detokenizer_holds_back_partial_characters(tok: Tokenizer):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # an emoji is split over several byte-level tokens
    d = IncrementalDetokenizer(tok, [])
    assert [d.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    # a character cut off at the end of the request comes out as U+FFFD on flush, like decode() does
    d = IncrementalDetokenizer(tok, [])
    assert d.add_tokens(ids[:-1]) == ""
    assert d.flush() == tok.decode(ids[:-1]) == "\ufffd"


def test_detokenizer_special_tokens(tok: Tokenizer):
    ids = tok.encode("Hi there", add_special_tokens=False) + [2]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas) == "Hi there"
    deltas, _ = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "Hi there<|im_end|>"


def test_detokenizer_window_is_bounded(tok: Tokenizer):
    """Per-token cost must not grow with the output: every decode call sees a short window, even for a
    stream of byte fragments that never forms valid UTF-8."""
    fragments = [i for i in range(300) if "\ufffd" in tok.token_str(i)]
    assert len(fragments) > 20
    long_text_ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 60, add_special_tokens=False)
    garbage = [fragments[(i * 7) % len(fragments)] for i in range(600)]
    seen: list[int] = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = Spy(tok.hf, tok.name)
    for ids in (long_text_ids, garbage):
        seen.clear()
        deltas, _ = _stream(spy, ids)
        assert "".join(deltas) == tok.decode(ids)
        assert max(seen) <= 24


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detokenizer_random_ids(tok: Tokenizer, data):
    """Any id sequence, fed in any chunking after any prompt: the deltas concatenate to decode(ids)."""
    # bias towards byte-fragment tokens (ids < 300 are mostly single bytes) to exercise the hold-back
    token = st.one_of(st.integers(0, 299), st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=48), label="ids")
    prompt = data.draw(st.lists(token, max_size=6), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    deltas, d = _stream(tok, ids, prompt, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_prompt_ending_inside_a_character(tok: Tokenizer):
    """Found by the test above: prompt [171] and output [111] are byte tokens whose bytes decode to a
    single U+FFFD together (and one each alone); the output's own U+FFFD must still come out."""
    assert tok.decode([171, 111]) == tok.decode([111]) == "\ufffd"
    for skip in (True, False):
        deltas, d = _stream(tok, [111], [171], [1], skip_special_tokens=skip)
        assert "".join(deltas) == d.text == tok.decode([111], skip_special_tokens=skip)


def test_detokenizer_sentencepiece_spacing():
    """A SentencePiece-style decoder (Metaspace + byte fallback + leading-space strip): the prompt context
    keeps the first token's leading space; without a prompt the text equals decode(ids)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ("▁Hello", "▁world", ","):
        vocab[w] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    sp = Tokenizer(hf, "sp")
    ids = [vocab["▁Hello"], vocab["▁world"]] + [vocab[f"<0x{b:02X}>"] for b in "🎉".encode()] + [vocab[","], 2]
    deltas, d = _stream(sp, ids)
    assert deltas == ["Hello", " world", "", "", "", "🎉", ",", "", ""]
    assert d.text == sp.decode(ids) == "Hello world🎉,"
    deltas, d = _stream(sp, ids, prompt=[vocab["▁Hello"]])
    assert d.text == " Hello world🎉,"
