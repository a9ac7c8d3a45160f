"""The shard plan: full shards, then a tail shrinking with the lines left (guided
self-scheduling), the same cut whether prepare ran once or was resumed."""

from __future__ import annotations

import math

import pytest

from tests.worker.test_chunked_prepare import (
    Killed,
    _expire_lease,
    _stopping_at,
    layout,
    lines,
    prepared_whole,
)
from worker import prepare_rows, shard_plan
from worker.prepare import prepare_batch
from worker.shard_plan import MIN_TAIL_LINES, TAIL_SPREAD, ShardPlan


def test_full_shards_until_the_tail_then_each_at_most_its_share_of_what_is_left():
    plan = ShardPlan(40_000, 256)
    assert sum(plan.sizes) == 40_000
    left = 40_000
    for size in plan.sizes:
        assert size == min(left, max(MIN_TAIL_LINES, min(256, math.ceil(left / TAIL_SPREAD))))
        left -= size
    assert plan.sizes == sorted(plan.sizes, reverse=True)[:-1] + plan.sizes[-1:]
    full = [s for s in plan.sizes if s == 256]
    # Full until fewer than TAIL_SPREAD full shards' lines are left.
    assert 40_000 - 256 * len(full) <= 256 * TAIL_SPREAD
    assert plan.sizes[len(full)] < 256 and plan.sizes[-2] == MIN_TAIL_LINES
    # The tail's extra shards are bounded whatever the batch's size.
    extra = [len(ShardPlan(n, 256)) - math.ceil(n / 256) for n in (40_000, 400_000)]
    assert extra[0] == extra[1] and 0 < extra[0] <= TAIL_SPREAD * (1 + math.log(256 / 32))


def test_a_small_batch_is_cut_for_many_workers_and_a_small_shard_size_is_kept():
    assert ShardPlan(500, 256).sizes == [32] * 15 + [20]
    assert ShardPlan(10, 2).sizes == [2] * 5
    assert ShardPlan(0, 256).sizes == []
    with pytest.raises(ValueError, match="shard_size"):
        ShardPlan(10, 0)


def test_cut_follows_the_plan_and_goes_on_in_the_smallest_shards_past_it():
    plan = ShardPlan(500, 256)
    assert plan.cut(0, 70) == [32, 32, 6]
    assert plan.lines(14, 2) == 32 + 20
    assert plan.cut(15, 20 + 70) == [20, 32, 32, 6]  # past the plan: MIN_TAIL_LINES each
    assert plan.cut(3, 0) == []


@pytest.fixture
def tight_tail(monkeypatch):
    """A tail that starts within a few lines, for batches of a test's size: at shard_size 4
    and 47 planned lines, shards of 4 down to 1."""
    monkeypatch.setattr(shard_plan, "TAIL_SPREAD", 4)
    monkeypatch.setattr(shard_plan, "MIN_TAIL_LINES", 1)


def test_prepare_cuts_the_plans_shards_and_a_resumed_prepare_cuts_the_same(
        make_stack, any_db_url, monkeypatch, tight_tail):
    stack = make_stack(any_db_url)
    db, storage = stack.ctx.db, stack.ctx.storage
    whole, expected = prepared_whole(stack, shard_size=4)
    # The plan is for the file's lines without an upload error: the 47 valid ones.
    file = stack.client.get(f"/v1/files/{stack.batch(whole)['input_file_id']}").json()
    assert file["line_count"] - file["error_count"] == 47
    sizes = [n for _, n in expected["shards"]]
    assert sizes == ShardPlan(47, 4).sizes
    assert sizes[0] == 4 and sizes[-1] < 4 and sizes == sorted(sizes, reverse=True)
    # A line's shard is the plan's for its run position.
    ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
    for line in expected["lines"]:
        if line[5] is not None:
            assert int(line[6]) == next(k for k, end in enumerate(ends) if line[5] < end)

    batch_id = stack.create_batch(lines(60))["id"]
    with monkeypatch.context() as patch:
        patch.setattr(prepare_rows, "iter_lines", _stopping_at(40, Killed()))
        with pytest.raises(Killed):
            prepare_batch(db, storage, batch_id, worker_id="prep", shard_size=4)
    half = layout(db, batch_id)
    assert 0 < len(half["shards"]) < len(sizes)
    _expire_lease(db, batch_id)
    assert prepare_batch(db, storage, batch_id, worker_id="other", shard_size=4)
    assert layout(db, batch_id) == expected
