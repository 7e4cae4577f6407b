"""Large CPU tensors on transparent huge pages, where the kernel hands them out only on request.

Linux's ``/sys/kernel/mm/transparent_hugepage/enabled`` is often ``madvise``: memory gets 2 MiB pages
only where the process asks with ``madvise(MADV_HUGEPAGE)`` before touching it. A decode step streams
the whole paged KV cache of its requests; on 4 KiB pages the hardware prefetchers stop at every page
boundary and each page costs a TLB entry (``python benchmarks/native_kernels.py`` times the paged decode
attention over 157 MB of KV on both; 1.06-1.16x on huge pages on a 2-core AVX2 EPYC, 2026-11-25).
:func:`empty` allocates and asks before anything touches the memory, so the first write (:func:`zeros`'
zeroing, or a copy) faults huge pages in. Anywhere the call is missing or refused (another OS, THP
``never``, a small tensor, CUDA) they are plain ``torch.empty`` / ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE = 2 << 20  # x86-64 and arm64 transparent huge page size
_MADV_HUGEPAGE = 14
_MIN_BYTES = 2 * HUGE  # smaller tensors hold no whole aligned huge page worth asking for


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


_MADVISE = _madvise()


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages over the whole 2 MiB pages inside ``t``'s memory; whether the kernel agreed.
    Only pages not yet touched are affected."""
    nbytes = t.numel() * t.element_size()
    if _MADVISE is None or t.device.type != "cpu" or nbytes < _MIN_BYTES:
        return False
    start = t.data_ptr()
    lo, hi = -(-start // HUGE) * HUGE, (start + nbytes) // HUGE * HUGE
    return hi > lo and _MADVISE(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)``; on the CPU backed by huge pages (from its first write) where the kernel gives them."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise(t)
    return t


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``, as :func:`empty` places it."""
    return empty(shape, dtype, device).zero_()
