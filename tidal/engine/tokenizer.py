"""Tokenizer wrapper (transformers) and a streaming detokenizer.

:class:`Tokenizer` wraps the Hugging Face tokenizer of a checkpoint: for a GGUF file transformers
rebuilds it from the ``tokenizer.ggml.*`` metadata (a few seconds for a 49k vocabulary; nothing is
cached here), for an HF directory it reads ``tokenizer.json``/``tokenizer_config.json``.

:class:`IncrementalDetokenizer` turns a growing list of output token ids into text deltas for
streaming. Byte-level BPE tokens are often fragments of a UTF-8 character (an emoji is typically 2-4
tokens), and SentencePiece decoders strip or add spaces depending on what precedes a token, so one
cannot decode token by token. Instead it keeps a small window of token ids:

    ids:   ... | context [q, p) | pending [p, n)
    text:        ctx_text         decode(ids[q:n])[len(ctx_text):]  ->  the pending text

The context (a few tokens whose text has already been emitted) is decoded with the pending tokens so
that spacing rules see the right neighbour; only the pending part's text is ever emitted. A trailing
run of U+FFFD in the pending text may be an incomplete character, so it is held back; everything
before it is final and is emitted at once. When the pending text ends on a complete character the
window slides: the last few tokens become the new context. Each step therefore decodes O(window)
tokens, independent of the output length.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Sequence
from typing import Any

from tidal.engine.loader import LoadedCheckpoint, ModelLoadError

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # already-emitted tokens decoded in front of the pending ones
_MAX_PENDING = 16  # pending tokens (stuck on U+FFFD) before trying to commit part of them anyway
_FORCE_TAIL = 4  # a forced commit keeps at least this many tokens pending (a UTF-8 char is <= 4 bytes)


class Tokenizer:
    """A thin, typed facade over a transformers tokenizer.

    Thread-safe by construction: every call into the Hugging Face tokenizer (a Rust object that
    raises "Already borrowed" when one thread mutates it, e.g. its truncation settings, while
    another uses it; vllm#40949) holds this instance's lock. Threads with different roles (the
    engine thread detokenizing, the server's encoder pool) each get their own :meth:`clone` so
    that they never wait on one another.
    """

    def __init__(self, hf: Any, name: str = "", eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None) -> None:
        self.hf = hf
        self._lock = threading.RLock()
        self.name = name
        eos = hf.eos_token_id if hf.eos_token_id is not None else (eos_token_ids[0] if eos_token_ids else None)
        self.eos_token_id: int | None = eos
        self.bos_token_id: int | None = hf.bos_token_id if hf.bos_token_id is not None else bos_token_id
        ids = [] if eos is None else [int(eos)]
        ids += [int(i) for i in eos_token_ids if int(i) not in ids]
        #: every id that ends generation (the tokenizer's eos plus the checkpoint's eos/eot ids)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.vocab_size: int = len(hf)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_checkpoint(cls, ckpt: LoadedCheckpoint) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            if ckpt.format == "gguf":
                from tidal.engine.disk_cache import load_tokenizer

                hf = load_tokenizer(ckpt.path)
            else:
                hf = AutoTokenizer.from_pretrained(ckpt.path)
        except Exception as e:
            msg = " ".join(str(e).split()) or type(e).__name__
            raise ModelLoadError(f"cannot load the tokenizer of {ckpt.path}: {msg}") from e
        eos = ckpt.arch.eos_token_ids
        if ckpt.format == "gguf" and eos and hf.eos_token_id not in eos:
            # the GGUF's own tokenizer.ggml.eos_token_id wins: transformers 5.17 read SmolLM2's as
            # <|im_start|> (seen on a GPU machine's image), which would end every reply at once
            with contextlib.suppress(Exception):
                hf.eos_token = hf.convert_ids_to_tokens(int(eos[0]))
        return cls(hf, name=ckpt.arch.name, eos_token_ids=ckpt.arch.eos_token_ids,
                   bos_token_id=ckpt.arch.bos_token_id)

    def clone(self) -> Tokenizer:
        """An independent copy (its own Rust tokenizer and lock) for another thread's role."""
        with self._lock:
            hf = copy.deepcopy(self.hf)
        twin = copy.copy(self)
        twin.hf, twin._lock = hf, threading.RLock()
        return twin

    def __getstate__(self) -> dict[str, Any]:  # a lock does not pickle: the copy gets its own
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            rust = self._rust()
            if rust is not None:  # what hf.decode returns, without its per-call argument conversions
                return rust.decode(list(ids), skip_special_tokens=skip_special_tokens)
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _rust(self) -> Any:
        """The fast tokenizer's Rust object, where ``hf.decode`` is exactly its ``decode``: no clean-up of
        tokenization spaces (which transformers applies after it). None otherwise. The detokenizer decodes
        twice a token per request: at batch 32 transformers' wrapper cost ~3x the decode itself."""
        rust = getattr(self.hf, "_tokenizer", None)
        if rust is None or getattr(self.hf, "clean_up_tokenization_spaces", True) or not hasattr(rust, "decode"):
            return None
        return rust

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        with self._lock:
            if isinstance(ids, int):
                return self.hf.convert_ids_to_tokens(ids)
            return self.hf.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs); a partial UTF-8 character shows as U+FFFD."""
        with self._lock:
            return self.hf.decode([int(token_id)], skip_special_tokens=False)

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text the model's chat template produces for ``messages``."""
        if not self.has_chat_template:
            raise ValueError(
                f"model {self.name or '(unnamed)'} has no chat template; send a plain text prompt "
                "(the completions API) instead of chat messages")
        try:
            with self._lock:
                text = self.hf.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as e:  # jinja2 errors (raise_exception in templates), bad message shapes
            msg = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"chat template failed: {msg}") from e
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (special tokens come from the template, none are added)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs),
                           add_special_tokens=False)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


class IncrementalDetokenizer:
    """Streams text for a growing list of output token ids.

    Never emits part of a UTF-8 character (no U+FFFD mid-stream unless the final text has one there);
    after :meth:`flush`, ``text`` (the concatenation of all deltas) equals
    ``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers (GPT-2 style: SmolLM2, Llama 3,
    Qwen2). The last prompt tokens are used as decoding context, so for SentencePiece tokenizers the
    first output token keeps the leading space it has after the prompt (as the completions API needs).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = [int(i) for i in list(prompt_ids)[-_CONTEXT_TOKENS:]]
        self._ids: list[int] = ctx  # prompt tail, then every output id
        self._n_ctx0 = len(ctx)
        self._q = 0  # window start (context tokens [q, p) are already emitted)
        self._p = len(ctx)  # first pending token
        self._ctx_text = self._decode(0, len(ctx))
        self._emitted = 0  # characters of the pending text already emitted
        self.text = ""

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._n_ctx0:]

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append output ids; return the text that became final (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(int(i) for i in new_ids)
        n = len(self._ids)
        pending = self._pending_text()
        stable = len(pending.rstrip(_REPLACEMENT))
        delta = ""
        if stable > self._emitted:
            delta = pending[self._emitted:stable]
            self._emitted = stable
        if stable == len(pending):
            self._slide(n)
        elif n - self._p > _MAX_PENDING:
            delta += self._force_commit(pending)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of the request: emit the held-back tail (e.g. a final incomplete character as U+FFFD)."""
        n = len(self._ids)
        if self._p == n:
            return ""
        pending = self._pending_text()
        delta = pending[self._emitted:]
        self._slide(n)
        self.text += delta
        return delta

    # ------------------------------------------------------------------ internals
    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self) -> str:
        n = len(self._ids)
        full = self._decode(self._q, n)
        # a context that ends inside a character (U+FFFD) can merge with the new bytes into one
        # U+FFFD, which would hide theirs: then the prefix says nothing and they decode alone
        if full.startswith(self._ctx_text) and not self._ctx_text.endswith(_REPLACEMENT):
            return full[len(self._ctx_text):]
        # the new tokens changed how the context decodes (e.g. a prompt given as ids that ends inside a
        # character): decode the pending tokens on their own
        return self._decode(self._p, n)

    def _slide(self, n: int) -> None:
        """Everything up to token n is emitted: the last few tokens become the context."""
        self._q = max(0, n - _CONTEXT_TOKENS)
        self._p = n
        self._ctx_text = self._decode(self._q, n)
        self._emitted = 0

    def _force_commit(self, pending: str) -> str:
        """The pending text has ended in U+FFFD for many tokens (invalid bytes, not a character being
        spelled out): commit a prefix of the pending tokens whose text provably does not depend on what
        follows, so the window stays bounded. Returns newly final text (held-back U+FFFDs)."""
        n = len(self._ids)
        for b in range(n - _FORCE_TAIL, max(self._p, n - _FORCE_TAIL - 4), -1):
            head = self._decode(self._q, b)
            if not head.startswith(self._ctx_text):
                continue
            head_text = head[len(self._ctx_text):]
            if not pending.startswith(head_text):
                continue
            q2 = max(0, b - _CONTEXT_TOKENS)
            ctx2 = self._decode(q2, b)
            full2 = self._decode(q2, n)
            if not full2.startswith(ctx2) or full2[len(ctx2):] != pending[len(head_text):]:
                continue
            out = pending[self._emitted:len(head_text)] if self._emitted < len(head_text) else ""
            self._emitted = max(0, self._emitted - len(head_text))
            self._q, self._p, self._ctx_text = q2, b, ctx2
            return out
        return ""


__all__ = ["IncrementalDetokenizer", "Tokenizer"]
