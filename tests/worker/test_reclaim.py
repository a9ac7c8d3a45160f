"""A worker that lost a shard's lease and claims the same shard again before its drain loop
turns (a worker paused past its lease, then thawed: tests/system/test_redelivery.py) runs the
new claim's lines: the drop of the lost claim's lines removes those, not the new claim's."""

from __future__ import annotations

from sqlalchemy import select, update

from engine.testing.fake_engine import FakeEngine, StepGate
from service.models import SHARD_PENDING, SHARD_RUNNING, Shard
from tests.conftest_services import chat_line, wait_for


def test_a_shard_lost_and_claimed_again_runs_its_lines(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, shard_size=8)
    gate = StepGate()
    worker = stack.add_worker(FakeEngine(before_step=gate.wait))
    batch = stack.create_batch([chat_line(f"r{i}", f"line {i}", max_tokens=3) for i in range(8)])
    assert gate.wait_blocked(20), "the engine never took the shard's lines"

    def shard() -> tuple[str | None, str, int]:
        with stack.ctx.db.read_session() as session:
            row = session.execute(select(Shard.lease_owner, Shard.status, Shard.attempts)
                                  .where(Shard.batch_id == batch["id"])).one()
        return row.lease_owner, row.status, row.attempts

    assert shard() == (worker.worker_id, SHARD_RUNNING, 1)
    # The drain loop is held in a step; meanwhile the lease ran out and was reaped (as another
    # worker's claim poll does), so the shard is claimable again.
    with stack.ctx.db.session() as session:
        session.execute(update(Shard).where(Shard.batch_id == batch["id"])
                        .values(status=SHARD_PENDING, lease_owner=None, lease_expires_at=None))
    worker.leases.wake(check=True)  # the heartbeat finds it lost; the claim takes it again
    wait_for(lambda: shard() == (worker.worker_id, SHARD_RUNNING, 2), 20, 0.02,
             "the worker to claim the shard again")
    gate.open()
    done = stack.wait_status(batch["id"], "completed", timeout=20)
    output = stack.lines_of(done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(8))
