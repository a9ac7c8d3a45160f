"""The runner's LoRA layout in one pass (``model_runner.group_by_adapter``): the same order as a
stable sort by adapter, and the same segments as the flat batch's rows one by one."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.outputs import ScheduledRequest
from engine.runner.model_runner import group_by_adapter

NAMES = (None, "b", "a", "c")


def merged(runs: list[tuple[str | None, int]]) -> list[tuple[str | None, int]]:
    """Adjacent runs of one adapter (or of the base model) joined, as ``step_batch`` joins
    them into one segment."""
    out: list[tuple[str | None, int]] = []
    for name, rows in runs:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + rows)
        else:
            out.append((name, rows))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_one_pass_equals_the_sort_and_the_rows(seed):
    rng = random.Random(seed)
    count = rng.randint(0, 60)
    scheduled = [ScheduledRequest(f"r{i}", 0, rng.choice([1, 1, 1, rng.randint(2, 40)]), True)
                 for i in range(count)]
    requests = {s.request_id: SimpleNamespace(lora_name=rng.choice(NAMES)) for s in scheduled}

    ordered, runs = group_by_adapter(scheduled, requests)  # type: ignore[arg-type]

    def name(s: ScheduledRequest) -> str | None:
        return requests[s.request_id].lora_name

    assert ordered == sorted(scheduled, key=lambda s: (name(s) is not None, name(s) or ""))
    # the flat batch: one-token rows first, then the others, each in ``ordered`` order
    rows = ([(name(s), 1) for s in ordered if s.num_new_tokens == 1]
            + [(name(s), s.num_new_tokens) for s in ordered if s.num_new_tokens > 1])
    assert merged(runs) == merged(rows)
    assert all(n > 0 for _, n in runs)
    assert len(runs) <= 2 * len(NAMES)  # a run per adapter and kind of row, not per request
