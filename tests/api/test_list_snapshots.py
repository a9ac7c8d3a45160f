"""The first page of a tenant's batch list answered from the API's recent read of it
(``api.poll_snapshots``): a fresh page is served without a round trip, one statement refreshes
every held page of every tenant, a failed refresh sends the lists back to the database, a page
nobody asks for is dropped, and this process's creates and cancels drop their tenant's pages so
its own list never predates them. A fake reader and an injected clock; on PostgreSQL at the end,
the statement against the first page's own and the route against the database path."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from api.app import create_app
from api.poll_reads import (
    _ID_AT,
    _PK_AT,
    _TENANT_AT,
    FIRST_PAGE_STATEMENT,
    FIRST_PAGES_STATEMENT,
    AsyncReader,
    Compiled,
)
from api.poll_snapshots import MAX_PAGE_ROWS, PollSnapshots
from service.counters import CounterDelta, add
from service.models import IN_PROGRESS, Batch
from tests.api.test_batches import chat_line, make_batch
from tests.api.test_poll_snapshots import Clock, never, run
from tests.conftest_services import make_key


class FakeReader:
    """Batches of tenants, as the database would list them; records the reads."""

    def __init__(self) -> None:
        self.rows: list[list] = []  # in creation order
        self.page_reads: list[tuple[str, int]] = []
        self.pages_reads: list[list[tuple[str, int]]] = []
        self.single_reads = 0
        self.fail: Exception | None = None

    def put(self, batch_id: str, tenant_id: str, status: str = "in_progress") -> None:
        for row in self.rows:
            if row[_ID_AT] == batch_id:
                row[-1] = status
                return
        row: list = [None] * (max(_ID_AT, _TENANT_AT, _PK_AT) + 2)
        row[_ID_AT], row[_TENANT_AT], row[_PK_AT], row[-1] = (
            batch_id, tenant_id, len(self.rows) + 1, status)
        self.rows.append(row)

    def newest(self, tenant_id: str, num_rows: int) -> list[list]:
        """``FIRST_PAGE_STATEMENT``'s answer."""
        mine = [list(r) for r in reversed(self.rows) if r[_TENANT_AT] == tenant_id]
        return mine[:num_rows]

    async def fetch_one(self, params, statement=None):
        self.single_reads += 1
        rows = [r for r in self.rows if r[_ID_AT] == params["batch_id"]
                and r[_TENANT_AT] == params["tenant_id"]]
        return list(rows[0]) if rows else None

    async def fetch_all(self, params, statement=None, first_only=False):
        if self.fail is not None:
            raise self.fail
        if "tenant_ids" in params:  # every tenant's newest, in no particular order
            asked = list(zip(params["tenant_ids"], params["limits"], strict=True))
            self.pages_reads.append(sorted(asked))
            return [row for t, n in asked for row in sorted(self.newest(t, n), key=str)]
        if "batch_ids" in params:
            return [list(r) for r in self.rows if r[_ID_AT] in params["batch_ids"]]
        self.page_reads.append((params["tenant_id"], params["limit"]))
        return self.newest(params["tenant_id"], params["limit"])


def snapshots(reader: FakeReader, clock: Clock, max_age: float = 0.5) -> PollSnapshots:
    return PollSnapshots(reader, max_age=max_age, watch_s=5, clock=clock, sleep=never)  # type: ignore[arg-type]


def ids(rows: list[list]) -> list[str]:
    return [row[_ID_AT] for row in rows]


def test_a_fresh_first_page_is_served_without_a_read_and_an_old_one_is_read_again():
    reader, clock = FakeReader(), Clock()
    for i in range(3):
        reader.put(f"b{i}", "t1")

    async def scenario():
        polls = snapshots(reader, clock)
        assert ids(await polls.first_page(tenant_id="t1", num_rows=3)) == ["b2", "b1", "b0"]
        reader.put("b3", "t1")
        clock.now += 0.49
        assert ids(await polls.first_page(tenant_id="t1", num_rows=3)) == ["b2", "b1", "b0"]
        assert reader.page_reads == [("t1", 3)]
        clock.now += 0.02  # older than max_age: the list reads for itself
        assert ids(await polls.first_page(tenant_id="t1", num_rows=3)) == ["b3", "b2", "b1"]
        assert len(reader.page_reads) == 2
        await polls.close()

    run(scenario())


def test_one_statement_refreshes_every_page_of_every_tenant():
    reader, clock = FakeReader(), Clock()
    for i in range(5):
        reader.put(f"a{i}", "t1")
        reader.put(f"b{i}", "t2")

    async def scenario():
        polls = snapshots(reader, clock)
        for tenant_id, num_rows in (("t1", 3), ("t1", 21), ("t2", 2)):
            await polls.first_page(tenant_id=tenant_id, num_rows=num_rows)
        reader.put("a5", "t1")  # a worker's writes: seen at the next refresh
        reader.put("b4", "t2", "completed")
        clock.now += 0.3
        await polls.refresh_once()
        assert reader.pages_reads == [[("t1", 21), ("t2", 2)]]  # a tenant's largest page
        clock.now += 0.3  # 0.6 s after the first reads, 0.3 s after the refresh
        for tenant_id, num_rows in (("t1", 3), ("t1", 21), ("t2", 2), ("t2", 2)):
            page = await polls.first_page(tenant_id=tenant_id, num_rows=num_rows)
            assert page == reader.newest(tenant_id, num_rows)  # order and size the database's
        assert len(reader.page_reads) == 3
        assert ids(await polls.first_page(tenant_id="t2", num_rows=3)) == ["b4", "b3", "b2"]
        await polls.close()

    run(scenario())


def test_a_failed_refresh_sends_every_list_to_the_database():
    reader, clock = FakeReader(), Clock()
    reader.put("b1", "t1")

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.first_page(tenant_id="t1", num_rows=21)
        await polls.row(batch_id="b1", tenant_id="t1")
        reader.fail = ConnectionError("the database went away")
        with pytest.raises(ConnectionError):
            await polls.refresh_once()
        assert (polls.pages, polls.watched) == (0, 0)
        with pytest.raises(ConnectionError):  # the list gets the database's error
            await polls.first_page(tenant_id="t1", num_rows=21)
        await polls.close()

    run(scenario())


def test_this_processs_write_drops_its_tenants_pages_and_a_refresh_in_flight_keeps_out():
    reader, clock = FakeReader(), Clock()
    reader.put("a1", "t1")
    reader.put("b1", "t2")
    gate, entered = asyncio.Event(), asyncio.Event()
    plain_fetch = reader.fetch_all

    async def held(params, statement=None, first_only=False):
        rows = await plain_fetch(params, statement, first_only)  # the pages as they were
        if "tenant_ids" in params:
            entered.set()
            await gate.wait()
        return rows

    reader.fetch_all = held  # type: ignore[method-assign]

    async def scenario():
        polls = snapshots(reader, clock)
        await polls.first_page(tenant_id="t1", num_rows=21)
        await polls.first_page(tenant_id="t2", num_rows=21)
        refresh = asyncio.create_task(polls.refresh_once())
        await entered.wait()
        reader.put("a2", "t1")  # this process creates a batch...
        await asyncio.to_thread(polls.forget, tenant_id="t1")  # as the sync route does
        assert polls.pages == 1  # t2's page stays
        assert ids(await polls.first_page(tenant_id="t1", num_rows=21)) == ["a2", "a1"]
        gate.set()  # ...and the refresh that began before answers late
        await refresh
        assert ids(await polls.first_page(tenant_id="t1", num_rows=21)) == ["a2", "a1"]
        assert len(reader.page_reads) == 3
        await polls.close()

    run(scenario())


def test_a_read_in_flight_when_this_process_writes_is_answered_but_not_kept():
    reader, clock = FakeReader(), Clock()
    reader.put("a1", "t1")
    gate, entered = asyncio.Event(), asyncio.Event()
    plain_fetch, plain_one = reader.fetch_all, reader.fetch_one

    async def held(params, statement=None, first_only=False):
        rows = await plain_fetch(params, statement, first_only)
        entered.set()
        await gate.wait()
        return rows

    async def held_one(params, statement=None):
        row = await plain_one(params, statement)
        entered.set()
        await gate.wait()
        return row

    reader.fetch_all, reader.fetch_one = held, held_one  # type: ignore[method-assign]

    async def scenario():
        polls = snapshots(reader, clock)
        for read in (polls.first_page(tenant_id="t1", num_rows=21),
                     polls.row(batch_id="a1", tenant_id="t1")):
            gate.clear()
            entered.clear()
            poll = asyncio.create_task(read)
            await entered.wait()  # read before the write...
            reader.put("a1", "t1", "cancelling")
            polls.forget(tenant_id="t1", batch_id="a1")  # ...which lands before its answer
            gate.set()
            await poll
            assert (polls.pages, polls.watched) == (0, 0)
        await polls.close()

    run(scenario())


def test_a_page_nobody_asks_for_is_dropped_and_the_task_ends():
    reader, clock = FakeReader(), Clock()
    reader.put("a1", "t1")
    waits: list[float] = []

    async def tick(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds
        await asyncio.sleep(0)

    async def scenario():
        polls = PollSnapshots(reader, max_age=0.6, watch_s=1.1, clock=clock, sleep=tick)  # type: ignore[arg-type]
        await polls.first_page(tenant_id="t1", num_rows=21)
        for _ in range(50):
            await asyncio.sleep(0)
        assert polls.pages == 0
        assert len(reader.pages_reads) == 5  # at 0.2 ... 1.0 s; dropped at 1.2 s
        await polls.close()

    run(scenario())


def test_max_age_zero_reads_every_time_and_holds_no_page():
    reader, clock = FakeReader(), Clock()
    reader.put("a1", "t1")

    async def scenario():
        polls = snapshots(reader, clock, max_age=0)
        for _ in range(3):
            await polls.first_page(tenant_id="t1", num_rows=21)
        assert (len(reader.page_reads), polls.pages) == (3, 0)

    run(scenario())


def test_the_rows_held_are_bounded():
    reader, clock = FakeReader(), Clock()

    async def scenario():
        polls = snapshots(reader, clock)
        num_tenants = MAX_PAGE_ROWS // 101 + 3
        for i in range(num_tenants):
            await polls.first_page(tenant_id=f"t{i}", num_rows=101)
        assert polls.pages == MAX_PAGE_ROWS // 101
        assert polls.page_rows <= MAX_PAGE_ROWS
        await polls.close()

    run(scenario())


# -- on PostgreSQL ------------------------------------------------------------------------


def test_the_pages_statement_reads_what_the_first_page_reads(pg_context):
    ctx = pg_context
    tenants = []
    for name in (f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"):
        key = make_key(ctx.db, name)
        with TestClient(create_app(context=ctx),
                        headers={"Authorization": f"Bearer {key}"}) as c:
            made = [make_batch(c, [chat_line(f"l{i}", "x") for i in range(4)]).json()["id"]
                    for _ in range(3)]
        with ctx.db.session() as session:
            tenants.append(session.scalar(select(Batch.tenant_id).where(Batch.id == made[0])))
            session.execute(update(Batch).where(Batch.id.in_(made[1:]))
                            .values(status=IN_PROGRESS, num_total=4))
            add(session, {made[1]: CounterDelta(num_open=4), made[2]: CounterDelta(num_open=4)},
                slot=0)
            add(session, {made[2]: CounterDelta.closed("completed", prompt_tokens=3)}, slot=5)
    reader = AsyncReader(ctx.db.url, FIRST_PAGE_STATEMENT)

    async def read():
        pages = {}
        for tenant_id in tenants:
            for n in (1, 2, 4):
                pages[tenant_id, n] = await reader.fetch_all({"tenant_id": tenant_id, "limit": n})
        every = await reader.fetch_all({"tenant_ids": [*tenants, "tenant_nope"],
                                        "limits": [2, 4, 3]}, Compiled(FIRST_PAGES_STATEMENT))
        await reader.close()
        return pages, every

    pages, every = asyncio.run(read())
    assert len(pages[tenants[0], 4]) == 3 and pages[tenants[0], 2] == pages[tenants[0], 4][:2]
    for tenant_id, n in ((tenants[0], 2), (tenants[1], 4)):
        mine = sorted((r for r in every if r[_TENANT_AT] == tenant_id), key=lambda r: -r[_PK_AT])
        assert mine == pages[tenant_id, n]


def test_the_list_from_memory_is_the_databases_and_sees_this_processs_writes(pg_context):
    ctx = pg_context
    key = make_key(ctx.db, f"acme-{uuid.uuid4().hex[:6]}")
    with TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"}) as c:
        made = [make_batch(c).json()["id"] for _ in range(3)]
        with ctx.db.session() as session:
            session.execute(update(Batch).where(Batch.id == made[0])
                            .values(status=IN_PROGRESS, num_total=2))
        queries = ["", "?limit=1", "?limit=2", "?limit=3", "?limit=4", f"?after={made[2]}",
                   f"?after={made[1]}&limit=1"]
        polls = ctx.polls
        ctx.polls = None  # the thread's path, as on SQLite
        expected = {q: c.get(f"/v1/batches{q}").json() for q in queries}
        ctx.polls = polls
        for q in queries:
            assert c.get(f"/v1/batches{q}").json() == expected[q]
        again = c.get("/v1/batches?limit=2")  # from memory
        assert again.json() == expected["?limit=2"]
        assert 'desc="0 statements"' in again.headers["server-timing"]
        assert ctx.polls is not None and ctx.polls.pages == 5
        newer = make_batch(c).json()["id"]
        assert c.get("/v1/batches?limit=2").json()["first_id"] == newer
        c.post(f"/v1/batches/{made[0]}/cancel")
        assert c.get("/v1/batches?limit=4").json()["data"][-1]["status"] == "cancelling"
        other = make_key(ctx.db, f"other-{uuid.uuid4().hex[:6]}")
        stranger = c.get("/v1/batches?limit=2", headers={"Authorization": f"Bearer {other}"})
        assert stranger.json()["data"] == []
