"""Polls answered from the API's recent read of a batch (``api.poll_snapshots``): a fresh row
is served without a round trip, one refresh reads every watched batch, a failed refresh sends
the polls back to the database, a batch nobody polls is dropped, and ``forget`` and the tenant
check keep an answer from predating this process's writes or leaking across tenants. A fake
reader and an injected clock; the statement itself runs on PostgreSQL at the end."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from api.app import create_app
from api.poll_reads import (
    _ID_AT,
    POLL_STATEMENT,
    SNAPSHOT_STATEMENT,
    AsyncReader,
    Compiled,
    batch_id_of,
)
from api.poll_snapshots import MAX_WATCHED, REFRESHES_PER_AGE, PollSnapshots
from service.counters import CounterDelta, add
from service.models import IN_PROGRESS, Batch
from tests.api.test_batches import chat_line, make_batch
from tests.conftest_services import make_key


def row_of(batch_id: str, status: str) -> list:
    """A row as the statements give it, as far as the snapshots look: the id in its place."""
    row: list = [None] * (_ID_AT + 2)
    row[_ID_AT], row[-1] = batch_id, status
    return row


class FakeReader:
    """Rows by batch id, as the database would answer; counts the reads."""

    def __init__(self) -> None:
        self.rows: dict[str, list] = {}
        self.tenants: dict[str, str] = {}
        self.single_reads = 0
        self.snapshot_reads: list[list[str]] = []
        self.fail: Exception | None = None

    def put(self, batch_id: str, tenant_id: str, status: str) -> None:
        self.rows[batch_id], self.tenants[batch_id] = row_of(batch_id, status), tenant_id

    async def fetch_one(self, params, statement=None):
        self.single_reads += 1
        if self.fail is not None:
            raise self.fail
        batch_id = params["batch_id"]
        if self.tenants.get(batch_id) != params["tenant_id"]:
            return None
        return list(self.rows[batch_id])

    async def fetch_all(self, params, statement=None, first_only=False):
        self.snapshot_reads.append(sorted(params["batch_ids"]))
        if self.fail is not None:
            raise self.fail
        return [list(self.rows[b]) for b in params["batch_ids"] if b in self.rows]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def never(_seconds: float) -> None:  # the refresh task waits; tests call refresh_once
    await asyncio.Event().wait()


def snapshots(reader: FakeReader, clock: Clock, max_age: float = 0.5) -> PollSnapshots:
    return PollSnapshots(reader, max_age=max_age, watch_s=5, clock=clock, sleep=never)  # type: ignore[arg-type]


def run(coro):
    return asyncio.run(coro)


def test_a_fresh_row_is_served_without_a_read_and_an_old_one_is_read_again():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "in_progress")
        reader.put("b1", "t1", "completed")
        clock.now += 0.49
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "in_progress")
        assert reader.single_reads == 1
        clock.now += 0.02  # older than max_age: the poll reads for itself
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "completed")
        assert reader.single_reads == 2
        await polls.close()

    run(scenario())


def test_one_refresh_reads_every_watched_batch_in_one_statement():
    reader, clock = FakeReader(), Clock()
    for i in range(3):
        reader.put(f"b{i}", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        for i in range(3):
            await polls.row(batch_id=f"b{i}", tenant_id="t1")
        reader.put("b2", "t1", "completed")
        clock.now += 0.3
        await polls.refresh_once()
        assert reader.snapshot_reads == [["b0", "b1", "b2"]]
        clock.now += 0.3  # 0.6 s after the first read, 0.3 s after the refresh
        assert await polls.row(batch_id="b2", tenant_id="t1") == row_of("b2", "completed")
        assert reader.single_reads == 3
        await polls.close()

    run(scenario())


def test_a_row_is_as_old_as_the_start_of_the_read_that_brought_it():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")
    slow_fetch = reader.fetch_all

    async def slow(params, statement=None, first_only=False):
        clock.now += 0.4  # the read took 0.4 s
        return await slow_fetch(params, statement, first_only)

    reader.fetch_all = slow  # type: ignore[method-assign]

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        clock.now += 0.2
        await polls.refresh_once()  # read at 100.2, answered at 100.6
        clock.now += 0.25  # 100.85: 0.65 s after the read began
        await polls.row(batch_id="b1", tenant_id="t1")
        assert reader.single_reads == 2
        await polls.close()

    run(scenario())


def test_a_failed_refresh_sends_every_poll_to_the_database():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        reader.fail = ConnectionError("the database went away")
        with pytest.raises(ConnectionError):
            await polls.refresh_once()
        assert polls.watched == 0
        with pytest.raises(ConnectionError):  # the poll gets the database's error
            await polls.row(batch_id="b1", tenant_id="t1")
        await polls.close()

    run(scenario())


def test_a_batch_nobody_polls_is_dropped_and_one_gone_is_read_again():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")
    reader.put("b2", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        await polls.row(batch_id="b2", tenant_id="t1")
        for _ in range(20):  # b1 polled every 0.3 s (from memory or not), b2 never again
            clock.now += 0.3
            await polls.row(batch_id="b1", tenant_id="t1")
            await polls.refresh_once()
        assert reader.snapshot_reads[-1] == ["b1"]
        del reader.rows["b1"], reader.tenants["b1"]  # deleted meanwhile
        await polls.refresh_once()
        assert polls.watched == 0
        assert await polls.row(batch_id="b1", tenant_id="t1") is None
        await polls.close()

    run(scenario())


def test_another_tenant_never_gets_the_held_row():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        assert await polls.row(batch_id="b1", tenant_id="t2") is None
        assert reader.single_reads == 2  # asked the database, which said no
        await polls.close()

    run(scenario())


def test_forget_drops_the_row_and_a_refresh_in_flight_does_not_bring_it_back():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")
    gate, entered = asyncio.Event(), asyncio.Event()
    plain_fetch = reader.fetch_all

    async def held(params, statement=None, first_only=False):
        rows = await plain_fetch(params, statement, first_only)  # the row as it was
        entered.set()
        await gate.wait()
        return rows

    reader.fetch_all = held  # type: ignore[method-assign]

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        refresh = asyncio.create_task(polls.refresh_once())
        await entered.wait()
        reader.put("b1", "t1", "cancelling")  # this process cancels it...
        polls.forget(tenant_id="t1", batch_id="b1")
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "cancelling")
        gate.set()  # ...and the refresh that began before answers late
        await refresh
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "cancelling")
        await polls.close()

    run(scenario())


def test_forget_from_a_worker_thread_lands_before_the_route_answers():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.row(batch_id="b1", tenant_id="t1")
        reader.put("b1", "t1", "cancelling")
        await asyncio.to_thread(polls.forget, tenant_id="t1", batch_id="b1")  # as a sync route does
        assert await polls.row(batch_id="b1", tenant_id="t1") == row_of("b1", "cancelling")
        await polls.close()

    run(scenario())


def test_max_age_zero_reads_every_time_and_watches_nothing():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock, max_age=0)
        for _ in range(3):
            await polls.row(batch_id="b1", tenant_id="t1")
        assert (reader.single_reads, polls.watched) == (3, 0)

    run(scenario())


def test_the_watched_set_is_bounded():
    reader, clock = FakeReader(), Clock()
    for i in range(MAX_WATCHED + 5):
        reader.put(f"b{i}", "t1", "in_progress")

    async def scenario():
        polls = snapshots(reader, clock)
        for i in range(MAX_WATCHED + 5):
            await polls.row(batch_id=f"b{i}", tenant_id="t1")
        assert polls.watched == MAX_WATCHED
        await polls.close()

    run(scenario())


def test_the_task_refreshes_on_its_own_until_nobody_polls():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1", "in_progress")
    waits: list[float] = []

    async def tick(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds
        await asyncio.sleep(0)

    async def scenario():
        polls = PollSnapshots(reader, max_age=0.6, watch_s=1.1, clock=clock, sleep=tick)  # type: ignore[arg-type]
        await polls.row(batch_id="b1", tenant_id="t1")
        for _ in range(50):
            await asyncio.sleep(0)
        assert polls.watched == 0  # unpolled for over watch_s: the task ended
        assert waits and all(w == pytest.approx(0.6 / REFRESHES_PER_AGE) for w in waits)
        assert len(reader.snapshot_reads) == 5  # at 0.2 ... 1.0 s; dropped at 1.2 s
        await polls.close()

    run(scenario())


# -- on PostgreSQL ------------------------------------------------------------------------


def test_the_snapshot_statement_reads_what_the_poll_statement_reads(pg_context):
    ctx = pg_context
    key = make_key(ctx.db, "acme")
    with TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"}) as c:
        ids = [make_batch(c, [chat_line(f"l{i}", "x") for i in range(4)]).json()["id"]
               for _ in range(3)]
    with ctx.db.session() as session:
        tenant_id = session.scalar(select(Batch.tenant_id).where(Batch.id == ids[0]))
        session.execute(update(Batch).where(Batch.id.in_(ids[:2]))
                        .values(status=IN_PROGRESS, num_total=4))
        add(session, {ids[0]: CounterDelta(num_open=4), ids[1]: CounterDelta(num_open=4)},
            slot=0)
        add(session, {ids[0]: CounterDelta.closed("completed", prompt_tokens=3)}, slot=5)
    reader = AsyncReader(ctx.db.url, POLL_STATEMENT)

    async def read():
        singles = [await reader.fetch_one({"batch_id": b, "tenant_id": tenant_id}) for b in ids]
        many = await reader.fetch_all({"batch_ids": ids + ["batch_nope"]},
                                      Compiled(SNAPSHOT_STATEMENT))
        await reader.close()
        return singles, many

    singles, many = asyncio.run(read())
    assert sorted(many, key=batch_id_of) == sorted(singles, key=batch_id_of)


def test_a_repeated_poll_makes_no_statement_and_cancel_is_seen_at_once(pg_context):
    ctx = pg_context
    key = make_key(ctx.db, "acme")
    with TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"}) as c:
        batch = make_batch(c, [chat_line(f"l{i}", "x") for i in range(4)]).json()
        with ctx.db.session() as session:
            session.execute(update(Batch).where(Batch.id == batch["id"])
                            .values(status=IN_PROGRESS, num_total=4))
        first = c.get(f"/v1/batches/{batch['id']}")
        again = c.get(f"/v1/batches/{batch['id']}")
        assert first.json()["status"] == again.json()["status"] == "in_progress"
        assert 'desc="0 statements"' in again.headers["server-timing"]
        assert ctx.polls is not None and ctx.polls.watched == 1
        assert c.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelling"
        assert c.get(f"/v1/batches/{batch['id']}").json()["status"] == "cancelling"
        other = make_key(ctx.db, f"other-{uuid.uuid4().hex[:6]}")
        stranger = c.get(f"/v1/batches/{batch['id']}",
                         headers={"Authorization": f"Bearer {other}"})
        assert stranger.status_code == 404


class StatusReader(FakeReader):
    """A reader that also answers ``fetch_each`` (the status report's one round trip)."""

    def __init__(self) -> None:
        super().__init__()
        self.status_reads = 0

    async def fetch_each(self, runs, first_only=False):
        self.status_reads += 1
        if self.fail is not None:
            raise self.fail
        return [[["read", self.status_reads]] for _ in runs]


class CountingQuery:
    """A ``StatusQuery`` stand-in: one statement; its report says which read made it."""

    def __init__(self, interval: float = 2.0) -> None:
        self.interval = interval

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountingQuery) and other.interval == self.interval

    def runs(self, now):
        return [(None, {"now": now})]

    def report(self, found, now):
        [[(_, read)]] = found
        return {"read": read}


def test_the_status_report_is_held_refreshed_and_dropped_like_a_poll():
    reader, clock = StatusReader(), Clock()

    async def scenario():
        polls = snapshots(reader, clock)  # type: ignore[arg-type]
        query = CountingQuery()
        assert await polls.status(query) == {"read": 1}  # type: ignore[arg-type]
        clock.now += 0.3
        assert await polls.status(query) == {"read": 1}  # type: ignore[arg-type]
        assert reader.status_reads == 1
        # Another deployment's question (another interval) is not this report.
        assert await polls.status(CountingQuery(5.0)) == {"read": 2}  # type: ignore[arg-type]
        assert await polls.status(query) == {"read": 3}  # type: ignore[arg-type]
        clock.now += 0.3
        await polls.refresh_once()  # the refresh reads it again: the next poll reads nothing
        assert await polls.status(query) == {"read": 4}  # type: ignore[arg-type]
        assert reader.status_reads == 4
        clock.now += 0.6  # older than max_age, and no refresh came: the poll reads for itself
        assert await polls.status(query) == {"read": 5}  # type: ignore[arg-type]
        clock.now += 6  # nobody asked for longer than watch_s: no longer read
        await polls.refresh_once()
        assert reader.status_reads == 5
        await polls.close()

    run(scenario())


def test_a_failed_status_refresh_sends_the_next_poll_to_the_database():
    reader, clock = StatusReader(), Clock()

    async def scenario():
        polls = snapshots(reader, clock)  # type: ignore[arg-type]
        query = CountingQuery()
        assert await polls.status(query) == {"read": 1}  # type: ignore[arg-type]
        reader.fail = RuntimeError("the database is down")
        with pytest.raises(RuntimeError):
            await polls.refresh_once()
        with pytest.raises(RuntimeError, match="down"):  # not the held report: the error
            await polls.status(query)  # type: ignore[arg-type]
        reader.fail = None
        assert await polls.status(query) == {"read": 4}  # type: ignore[arg-type]
        await polls.close()

    run(scenario())
