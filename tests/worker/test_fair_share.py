"""A worker's fair share of a short queue (``LeaseKeeper._fair_bulk``): when the claimable bulk
shards are few for the fleet (a batch's head while prepare commits it, its tail), a worker takes
the shards that bring its backlog up to ceil(claimable lines / live workers of its model), not
up to its engine's low water, so the workers woken by one chunk all get some of it."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import delete, select

from service.db import utcnow
from service.models import Shard, WorkerStatus
from tests.conftest_services import chat_line
from worker import lease_keeper
from worker.items import HeldShards
from worker.lease_keeper import LeaseKeeper
from worker.prepare import prepare_batch


class Backlog:
    """The drainer as the lease keeper sees it: lines handed over and not finished."""

    def __init__(self, low_water: int) -> None:
        self.low_water = low_water
        self.lines: list = []

    def add(self, lines, *, is_job: bool) -> None:
        self.lines += lines

    @property
    def num_queued(self) -> int:
        return len(self.lines)

    num_backlog = num_queued


@pytest.fixture
def queue_of_16_shards(make_stack, any_db_url):
    """16 claimable shards of 4 lines (shard_size 4: the plan's tail is 4 too), no
    worker running, and four live workers of their model in the ``workers`` table."""
    stack = make_stack(any_db_url)
    batch = stack.create_batch([chat_line(f"c{i}", f"line {i}") for i in range(64)])
    db = stack.ctx.db
    assert prepare_batch(db, stack.ctx.storage, batch["id"], worker_id="prep", shard_size=4)
    with db.session() as session:
        model = session.scalars(select(Shard.model)).first()
        session.add_all(WorkerStatus(id=f"w{i}", model=model, heartbeat_at=utcnow())
                        for i in range(4))
    return stack, model


def keeper(stack, model: str, name: str, *, low_water: int = 1000) -> LeaseKeeper:
    """A lease keeper no thread runs (the test turns its claims), with room for the queue."""
    found = LeaseKeeper(stack.ctx.db, stack.settings, worker_id=name, held=HeldShards(),
                        drainer=Backlog(low_water), announce_shards=lambda ids: None,
                        on_batches_touched=lambda ids: None, model=model)
    found._stop = threading.Event()
    return found


def claim_all(keeper: LeaseKeeper) -> int:
    """Claim as the lease loop does (until a claim takes nothing); the lines held."""
    while keeper.claim_some():
        pass
    return keeper.drainer.num_backlog


def test_each_worker_takes_its_share_of_a_short_queue(queue_of_16_shards):
    stack, model = queue_of_16_shards
    # 64 lines for 4 workers: 16 each, where one worker's low water would have taken them all.
    first = keeper(stack, model, "k1")
    assert claim_all(first) == 16
    # The next sees 48 lines left: 12 (three shards); the next 36 and 28 lines, 9 and 7: two
    # shards each (the share is rechecked after each claim, against what is left then).
    held = [16] + [claim_all(keeper(stack, model, f"k{i}")) for i in (2, 3, 4)]
    assert held == [16, 12, 8, 8]
    # Its share held, a worker takes nothing more (and its hungry engine does not spin the
    # claim loop until the next poll); with nothing held it takes at least a shard.
    assert first.claim_some() == 0 and first._dry_until > time.monotonic()
    # 20 lines left: a share of 5 takes two shards (the one that reaches it is whole).
    assert claim_all(keeper(stack, model, "k5")) == 8
    assert claim_all(keeper(stack, model, "k6")) == 4


def test_a_lone_worker_or_a_deep_queue_takes_its_fill(queue_of_16_shards, monkeypatch):
    stack, model = queue_of_16_shards
    # Deeper than SHARE_SHARDS_PER_WORKER shards a worker: nothing to share out.
    monkeypatch.setattr(lease_keeper, "SHARE_SHARDS_PER_WORKER", 2)
    assert claim_all(keeper(stack, model, "k1", low_water=24)) == 24
    monkeypatch.undo()
    # The fleet is one worker: it takes up to its low water, as before the share.
    with stack.ctx.db.session() as session:
        session.execute(delete(WorkerStatus).where(WorkerStatus.id != "w0"))
    assert claim_all(keeper(stack, model, "k2", low_water=24)) == 24
    # No live worker row at all (its first heartbeat not yet written): no share either.
    with stack.ctx.db.session() as session:
        session.execute(delete(WorkerStatus))
    assert claim_all(keeper(stack, model, "k3", low_water=12)) == 12
