"""A cache on disk of what loading a GGUF costs most, shared by every process that loads the file.

Building the tokenizer from a GGUF's metadata (transformers parses ~150k vocabulary fields: 11 s
for the default model on one busy core here) and dequantizing its tensors take seconds, and every
process pays them: each worker of ``tidal serve --instances N``, a worker restarted after a
failure, every server a benchmark starts. The first load saves the tokenizer (``save_pretrained``)
and the fp32 tensors (safetensors); later loads read those instead. The key is the GGUF's resolved
path, size and mtime (and this format's version), so a changed file is read again. Weights whose
fp32 size exceeds the budget are not cached. The start-up timings of the 4-bit kernels against float
matmuls (engine/quant.py, seconds per process) are kept here too, keyed by the machine. Settings, read through :func:`tidal.config.env_str`: ``TIDAL_CACHE_DIR`` (default
``~/.cache/tidal``) and ``TIDAL_DISK_CACHE_MB`` (default 2048; 0 turns the cache off).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tidal.common.locks import LockTimeout, exclusive
from tidal.common.progress import startup_line, startup_phase
from tidal.config import env_str, start_wait_s

log = logging.getLogger("tidal.loader")
VERSION = 1  # bump when what the loader yields for a GGUF changes (a permutation fix, say)
DEFAULT_BUDGET_MB = 2048


def cache_dir() -> str:
    return env_str("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")


def budget_bytes() -> int:
    raw = (env_str("TIDAL_DISK_CACHE_MB") or "").strip()
    try:
        return max(0, int(float(raw) * 1024**2)) if raw else DEFAULT_BUDGET_MB * 1024**2
    except ValueError:
        return DEFAULT_BUDGET_MB * 1024**2


def _entry(gguf_path: str, kind: str, suffix: str) -> str | None:
    if budget_bytes() <= 0:
        return None
    try:
        st = os.stat(gguf_path)
    except OSError:
        return None
    ident = json.dumps([os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns, VERSION])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), kind, f"{os.path.basename(gguf_path)}.{digest}{suffix}")


def cache_path(gguf_path: str) -> str | None:
    """Where the dequantized weights of ``gguf_path`` live (or would), None when caching is off."""
    return _entry(gguf_path, "weights", ".safetensors")


def load_tokenizer(gguf_path: str) -> Any:
    """The Hugging Face tokenizer of ``gguf_path``: from the cache, else built from the GGUF and saved."""
    from transformers import AutoTokenizer

    where = _entry(gguf_path, "tokenizers", "")
    if where is not None and os.path.isfile(os.path.join(where, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(where)
        except Exception as e:  # noqa: BLE001 - a torn cache entry: build it again
            log.warning("ignoring the tokenizer cache %s: %s", where, e)
    with startup_phase(f"building the tokenizer of {os.path.basename(gguf_path)} (once per file)", "tokenizer built"):
        hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    if where is not None:
        tmp = f"{where}.{os.getpid()}.tmp"
        try:
            hf.save_pretrained(tmp)
            os.replace(tmp, where)  # a directory rename: readers see all of it or none
        except OSError as e:
            log.warning("could not write the tokenizer cache %s: %s", where, e)
            shutil.rmtree(tmp, ignore_errors=True)
    return hf


def load_meta(gguf_path: str) -> dict[str, Any] | None:
    """What an earlier process read of the GGUF's metadata (architecture, tensor names), or None."""
    where = _entry(gguf_path, "meta", ".json")
    return _read_json(where) if where is not None else None


def _read_json(where: str) -> Any:
    """The JSON in ``where``, or None when it is missing or torn."""
    try:
        with open(where, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def store_meta(gguf_path: str, arch: dict[str, Any], names: dict[str, str]) -> None:
    where = _entry(gguf_path, "meta", ".json")
    if where is not None:
        _write_json(where, {"arch": arch, "names": names}, "metadata")


def _write_json(where: str, obj: Any, what: str) -> None:
    """Write ``obj`` to ``where`` atomically (a reader sees the old file or the new one); failures only log."""
    tmp = f"{where}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f)
        os.replace(tmp, where)
    except (OSError, TypeError, ValueError) as e:
        log.warning("could not write the %s cache %s: %s", what, where, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def crossovers_path() -> str | None:
    """The file of start-up timings (engine/quant.py's 4-bit/float crossovers), None when caching is off."""
    return os.path.join(cache_dir(), "crossovers.json") if budget_bytes() > 0 else None


def _crossovers() -> dict[str, int]:
    where = crossovers_path()
    table = _read_json(where) if where is not None else None
    return table if isinstance(table, dict) else {}


def load_crossover(key: str) -> int | None:
    """A crossover an earlier process timed under ``key`` (the shape, the kernels, the machine), or None."""
    value = _crossovers().get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@contextlib.contextmanager
def crossover_lock() -> Iterator[bool]:
    """Held while a process times a crossover: the workers of ``tidal serve --instances N`` start at once
    on a fresh machine, and N timings run side by side would each see the others' load and cache
    that for good. The next one waits (saying for whom), then finds the timing in the file (a flock
    on a file beside it, released by the kernel if the holder dies: :func:`tidal.common.locks.exclusive`;
    no lock where there is no fcntl or no cache). Yields whether it holds the lock: a wait past
    :func:`tidal.config.start_wait_s` gives up and times without it."""
    where = crossovers_path()
    if where is None:
        yield False
        return
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(exclusive(f"{where}.lock", "timing this machine's matmuls", start_wait_s()))
        except LockTimeout as e:
            startup_line(f"warning: {e}; timing without the lock")
            held = False
        yield held


def store_crossover(key: str, value: int) -> None:
    """Add one timing to the file (read, update, replace: two processes storing at once may lose one
    entry, which is then timed again, never a torn file)."""
    where = crossovers_path()
    if where is not None:
        _write_json(where, {**_crossovers(), key: value}, "crossover")


def timed_once(key: str, measure: Callable[[], int]) -> int:
    """The start-up timing stored under ``key``, else ``measure()``'d and stored: one process at a
    time (:func:`crossover_lock`), each looking again once it holds the lock, so processes that start
    together time it once and read what the first stored."""
    value = load_crossover(key)
    if value is None:
        with crossover_lock():
            value = load_crossover(key)
            if value is None:
                value = measure()
                store_crossover(key, value)
    return value


def load(path: str) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The cached tensors in the order they were stored, or None if there is no usable file."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        f = safe_open(path, framework="pt")
        order = json.loads((f.metadata() or {}).get("order", "[]"))
    except Exception as e:  # noqa: BLE001 - a torn or foreign file is just not a cache hit
        log.warning("ignoring the weight cache %s: %s", path, e)
        return None

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for name in order:
            yield name, f.get_tensor(name)

    return gen()


def store(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write the tensors (atomically: a reader never sees half a file); failures only log."""
    from safetensors.torch import save_file

    if sum(t.numel() * t.element_size() for _, t in tensors) > budget_bytes():
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file({n: t.contiguous() for n, t in tensors}, tmp, metadata={"order": json.dumps([n for n, _ in tensors])})
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write the weight cache %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


__all__ = ["budget_bytes", "cache_dir", "cache_path", "load", "load_meta", "load_tokenizer", "store", "store_meta", "timed_once"]
