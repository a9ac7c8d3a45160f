"""What a batch holds against its tenant's quota is released as its lines finish, and all of it
when the batch is cancelled or expires (service.quotas, counted from the counter rows)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select, update

from engine.testing.fake_engine import FakeEngine
from service import quotas
from service.models import Batch, BatchCounter, RequestLine
from tests.conftest_services import chat_line, wait_for


def held(stack) -> int:
    with stack.ctx.db.read_session() as session:
        return sum(quotas.enqueued(session).values())


def lines(n: int, prefix: str = "q") -> list[dict]:
    return [chat_line(f"{prefix}{i}", f"question {i}", max_tokens=4) for i in range(n)]


def test_finished_lines_release_their_tokens(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, max_enqueued_tokens=10**6)
    batch = stack.create_batch(lines(8))
    with stack.ctx.db.read_session() as session:
        reserved = session.scalar(select(Batch.enqueued_tokens).where(Batch.id == batch["id"]))
    assert reserved > 0 and held(stack) == reserved
    stack.add_worker(FakeEngine(max_num_seqs=1, step_time=0.05))
    wait_for(lambda: stack.batch(batch["id"])["request_counts"]["completed"] >= 2, 30, 0.01,
             "two lines to finish")
    partly = held(stack)
    assert 0 < partly < reserved  # released line by line, not at the end
    stack.wait_status(batch["id"], "completed")
    assert held(stack) == 0
    with stack.ctx.db.read_session() as session:
        # Prepare made the hold exact: the sum of its lines' shares.
        lines_sum = session.scalar(select(func.sum(RequestLine.enqueued_tokens))
                                   .where(RequestLine.batch_id == batch["id"]))
        assert session.scalar(select(Batch.enqueued_tokens)
                              .where(Batch.id == batch["id"])) == lines_sum == reserved


def test_cancel_and_expiry_release_what_is_left(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, max_enqueued_tokens=10**6)
    stack.add_worker(FakeEngine(max_num_seqs=1, step_time=0.2))
    cancelled = stack.create_batch(lines(6, "c"))
    expired = stack.create_batch(lines(6, "e"))
    for batch in (cancelled, expired):
        stack.wait_status(batch["id"], "in_progress")
    assert held(stack) > 0
    assert stack.client.post(f"/v1/batches/{cancelled['id']}/cancel").status_code == 200
    with stack.ctx.db.session() as session:  # its window over, as if 24 hours had passed
        session.execute(update(Batch).where(Batch.id == expired["id"]).values(
            expires_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)))
    done = [stack.wait_status(cancelled["id"], "cancelled"),
            stack.wait_status(expired["id"], "expired")]
    assert held(stack) == 0
    with stack.ctx.db.read_session() as session:
        for batch in done:
            assert batch["request_counts"]["failed"] >= 1  # lines left open were closed
            reserved = session.scalar(select(Batch.enqueued_tokens)
                                      .where(Batch.id == batch["id"]))
            released = session.scalar(select(func.sum(BatchCounter.released_tokens))
                                      .where(BatchCounter.batch_id == batch["id"]))
            assert released == reserved > 0  # every line's share came back, none twice
