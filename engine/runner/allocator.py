"""Keep the CPU engine's step-sized allocations on the heap instead of fresh mappings.

glibc's malloc serves a request above its mmap threshold (128 KiB at start, raised as large
blocks are freed, at most 32 MiB) with a new ``mmap`` and returns it with ``munmap`` on free,
and it trims the heap's top back to the kernel past 128 KiB free. A decode step allocates and
frees the same activations, logits and attention buffers every step (a few hundred KiB to tens of
MiB at batch sizes of 16-128), so each step faulted its pages in again: zeroed by the kernel,
4 KiB at a time. Pinning the threshold at its maximum and turning trimming off keeps them on the
heap, where the next step reuses the same pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_tuned: bool | None = None


def keep_step_buffers_on_heap() -> bool:
    """Set glibc's mmap and trim thresholds once per process; False where malloc is not
    glibc's (musl, macOS) or refuses. Idempotent."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _tuned:
        log.info("malloc thresholds not set (not glibc?): step buffers may be remapped per step")
    return _tuned
