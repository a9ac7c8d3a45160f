"""engine/runner/allocator.py: step-sized buffers stay on the heap (glibc's malloc thresholds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.runner import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

_STEPS = textwrap.dedent("""
    import random, resource, sys, torch
    from engine.runner.allocator import keep_step_buffers_on_heap
    if sys.argv[1] == "1":
        assert keep_step_buffers_on_heap() and keep_step_buffers_on_heap()
    rng = random.Random(0)

    def step(rows):  # buffers sized by the batch, a few alive at once, freed out of order
        live = []
        for _ in range(6):
            live.append(torch.empty(rows * rng.randint(20, 60) * 1024, dtype=torch.uint8).fill_(1))
            if len(live) > 2:
                live.pop(rng.randrange(len(live)))

    for _ in range(3):  # the third pass is the steady state the test reads
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for rows in list(range(8, 128, 8)) * 3:
            step(rows)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def steady_faults(tuned: bool) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, "1" if tuned else "0"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_step_buffers_reuse_their_pages_once_tuned():
    # measured: ~16,000 faults a pass with glibc's defaults (mapped and unmapped, trimmed and
    # grown again), 0 once tuned
    untuned, tuned = steady_faults(tuned=False), steady_faults(tuned=True)
    assert tuned * 5 < untuned, (tuned, untuned)


def test_tuning_is_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", True)
    assert allocator.keep_step_buffers_on_heap() is True
