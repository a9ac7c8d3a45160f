"""engine/allocator.py: step-sized buffers stay on the heap (glibc's malloc thresholds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

_CYCLES = textwrap.dedent("""
    import resource, sys, torch
    from engine.allocator import keep_step_buffers_on_heap
    if sys.argv[1] == "1":
        assert keep_step_buffers_on_heap() and keep_step_buffers_on_heap()
    pages = (24 << 20) // 4096
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):  # a step's buffer: allocated, written, freed, again
        torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages)
""")


def faults_per_buffer(tuned: bool) -> float:
    out = subprocess.run([sys.executable, "-c", _CYCLES, "1" if tuned else "0"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def test_a_buffer_freed_and_allocated_again_reuses_its_pages():
    # tuned: the first buffer faults its pages in once, the other 19 reuse them
    assert faults_per_buffer(tuned=True) < 1.5
    # glibc's defaults map the first buffer, unmap it, then grow the heap: twice at least
    assert faults_per_buffer(tuned=False) >= 1.5


def test_tuning_is_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", True)
    assert allocator.keep_step_buffers_on_heap() is True
