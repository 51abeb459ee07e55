"""Handing freed heap memory back to the system (glibc's malloc_trim), for code that frees
large short-lived buffers while small allocations keep arriving (engine/models/packed.py's
oneDNN layouts). A no-op where the C library is not glibc."""

from __future__ import annotations

import functools


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):      # not glibc: its allocator returns memory its own way
        return None


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim).

    Why: the dequantized rows a layout is reordered from are freed at once, but glibc keeps
    them in its heap, and small allocations made meanwhile (a profiler's records, autograd's)
    split them, so the next block's rows take fresh memory: filling gemma's layouts in a step
    under the FLOP-counting profiler (`StepFlops`) peaked at 2957 MB, 2475 MB with the trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
