"""Status polls of the batches an API process is being asked about, answered from memory.

A client polling a live batch every fraction of a second asked PostgreSQL the same question each
time, and on a machine whose CPUs the workers keep busy, the wait for the poll's backend to be
scheduled was most of a loaded poll (docs/benchmarks.md, "Status polls under load"). Here one
task on the event loop reads every batch polled in the last ``WATCH_S`` seconds, all in one
statement (``SNAPSHOT_STATEMENT``: the poll's own columns and counter sums), every ``max_age /
REFRESHES_PER_AGE`` seconds; a poll takes the newest row while it is younger than ``max_age``.
The database's work for a batch no longer grows with its pollers or their rate, and such a poll
makes no round trip.

What a poll may see: its batch as it was at most ``max_age`` ago (the ETA beside it is already up
to ``api.eta.CACHE_S`` old). A refresh that fails (the database is down) drops every row, so the
polls after it go to the database and get its error (503); a refresh that hangs leaves the rows
to age past ``max_age``, and polls read for themselves. A write this process makes to a batch
(cancel) drops its row (``forget``): its own answers never predate its writes. A poll checks the
row's tenant: a batch of another tenant is not found, as the database's answer would be.

The first page of a tenant's batch list (``GET /v1/batches`` without a cursor: a client
watching its batches) is held the same way, by (tenant, rows asked): the same refresh reads
every held page in one more statement (``FIRST_PAGES_STATEMENT``: each tenant's newest batches
for the most rows any of its pages asks), with the same age, the same failure rule and the same
tenant check (the key). A batch this process creates or cancels drops its tenant's pages, so
its own list shows it at once. A read that was in flight when this process wrote is answered
but not kept: it may predate the write.

The operator's status report (``GET /v1/status``, ``api.status``: its four statements in one
pipeline, then the report made from their rows) is held the same way while it is asked for,
with the same age and failure rule. It is not dropped on this process's writes: it says when it
was read (``read_at``), and other processes' writes reach it no sooner either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from api.poll_reads import (
    FIRST_PAGE_STATEMENT,
    FIRST_PAGES_STATEMENT,
    SNAPSHOT_STATEMENT,
    AsyncReader,
    Compiled,
    batch_id_of,
    tenant_and_pk_of,
)
from api.status import StatusQuery
from service.db import utcnow

log = logging.getLogger(__name__)

WATCH_S = 5.0  # a batch nobody polled for this long is no longer read
REFRESHES_PER_AGE = 3  # reads a row's max age: a late refresh or two still leaves it servable
MAX_WATCHED = 2_000  # beyond these, polls read for themselves (memory and the statement bounded)
MAX_PAGE_ROWS = 5_000  # rows of first pages held, all pages together (the same, for lists)


@dataclass
class _Watched:
    tenant_id: str
    polled_at: float
    row: list[Any]
    read_at: float


@dataclass
class _Status:
    query: StatusQuery
    polled_at: float
    report: dict[str, Any]
    read_at: float


@dataclass
class _Page:
    polled_at: float
    rows: list[list[Any]]  # the tenant's newest batches, newest first
    read_at: float


class PollSnapshots:
    """The rows of the batches polled recently, kept fresh by one task on the event loop that
    first polled (a new loop, as in tests, starts over). ``max_age`` 0 turns it off: every
    poll reads the database."""

    def __init__(self, reader: AsyncReader, *, max_age: float, watch_s: float = WATCH_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._reader = reader
        self._max_age = max_age
        self._interval = max_age / REFRESHES_PER_AGE
        self._watch_s = max(watch_s, max_age)
        self._clock = clock
        self._sleep = sleep
        self._statement = Compiled(SNAPSHOT_STATEMENT)
        self._page_statement = Compiled(FIRST_PAGE_STATEMENT)
        self._pages_statement = Compiled(FIRST_PAGES_STATEMENT)
        self._watched: dict[str, _Watched] = {}
        self._pages: dict[tuple[str, int], _Page] = {}  # by (tenant id, rows asked)
        self._status: _Status | None = None
        self._writes = 0  # this process's writes so far: a read that saw one land is not kept
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def row(self, *, batch_id: str, tenant_id: str) -> list[Any] | None:
        """The batch's ``POLL_STATEMENT`` row, from memory when a fresh one is held; None when
        the tenant has no such batch."""
        self._bind_loop()
        now = self._clock()
        held = self._watched.get(batch_id)
        if held is not None and held.tenant_id == tenant_id and now - held.read_at < self._max_age:
            held.polled_at = now
            return held.row
        writes = self._writes
        row = await self._reader.fetch_one({"batch_id": batch_id, "tenant_id": tenant_id})
        if row is not None and self._max_age > 0 and writes == self._writes and (
                batch_id in self._watched or len(self._watched) < MAX_WATCHED):
            self._watched[batch_id] = _Watched(tenant_id, now, row, now)
            self._start()
        return row

    async def first_page(self, *, tenant_id: str, num_rows: int) -> list[list[Any]]:
        """The tenant's newest ``num_rows`` batches (``FIRST_PAGE_STATEMENT``'s rows, newest
        first), from memory when a fresh copy is held."""
        self._bind_loop()
        now = self._clock()
        key = (tenant_id, num_rows)
        held = self._pages.get(key)
        if held is not None and now - held.read_at < self._max_age:
            held.polled_at = now
            return held.rows
        writes = self._writes
        rows = await self._reader.fetch_all({"tenant_id": tenant_id, "limit": num_rows},
                                            self._page_statement)
        if self._max_age > 0 and writes == self._writes and (
                key in self._pages or self.page_rows + num_rows <= MAX_PAGE_ROWS):
            self._pages[key] = _Page(now, rows, now)
            self._start()
        return rows

    async def status(self, query: StatusQuery) -> dict[str, Any]:
        """The status report (``api.status``), from memory when a fresh one of the same query
        is held."""
        self._bind_loop()
        now = self._clock()
        held = self._status
        if held is not None and held.query == query and now - held.read_at < self._max_age:
            held.polled_at = now
            return held.report
        report = await self._read_status(query)
        if self._max_age > 0:
            self._status = _Status(query, now, report, now)
            self._start()
        return report

    async def _read_status(self, query: StatusQuery) -> dict[str, Any]:
        now = utcnow()
        found = await self._reader.fetch_each(query.runs(now))
        return query.report(found, now)

    def forget(self, *, tenant_id: str, batch_id: str | None = None) -> None:
        """This process wrote the batch (``batch_id``), or created one for the tenant: the
        batch's next poll and the tenant's next first page read the database. Safe from a
        route's worker thread: the rows are dropped on the loop, before the route's answer is
        sent (the loop runs callbacks in order, and the thread's result arrives after this
        one)."""
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or loop is None or loop.is_closed():
            self._drop(tenant_id, batch_id)
        else:
            loop.call_soon_threadsafe(self._drop, tenant_id, batch_id)

    def _drop(self, tenant_id: str, batch_id: str | None) -> None:
        self._writes += 1
        if batch_id is not None:
            self._watched.pop(batch_id, None)
        for key in [key for key in self._pages if key[0] == tenant_id]:
            del self._pages[key]

    @property
    def watched(self) -> int:
        return len(self._watched)

    @property
    def pages(self) -> int:
        return len(self._pages)

    @property
    def page_rows(self) -> int:
        """Rows the held pages may grow to (their rows asked), all together."""
        return sum(num_rows for _, num_rows in self._pages)

    async def refresh_once(self) -> None:
        """One refresh: drop the batches and pages nobody polled for ``watch_s``, read the
        others, the batches in one statement and the pages in one more. A failed read drops
        them all and raises."""
        now = self._clock()
        for batch_id in [b for b, w in self._watched.items() if now - w.polled_at > self._watch_s]:
            del self._watched[batch_id]
        for key in [k for k, p in self._pages.items() if now - p.polled_at > self._watch_s]:
            del self._pages[key]
        if self._status is not None and now - self._status.polled_at > self._watch_s:
            self._status = None
        try:
            if self._watched:
                await self._refresh_batches()
            if self._pages:
                await self._refresh_pages()
            if self._status is not None:
                await self._refresh_status(self._status)
        except BaseException:
            self._watched.clear()
            self._pages.clear()
            self._status = None
            raise

    async def _refresh_batches(self) -> None:
        # Only the entries held now are updated: one that a poll read again meanwhile (after
        # ``forget``) is newer than this read.
        targets = dict(self._watched)
        started = self._clock()  # a row is as old as the read's start
        rows = await self._reader.fetch_all({"batch_ids": list(targets)}, self._statement)
        found = {batch_id_of(row): row for row in rows}
        for batch_id, held in targets.items():
            if self._watched.get(batch_id) is not held:
                continue
            row = found.get(batch_id)
            if row is None:  # gone since: the next poll asks the database
                del self._watched[batch_id]
            else:
                held.row, held.read_at = row, started

    async def _refresh_pages(self) -> None:
        targets = dict(self._pages)
        num_rows: dict[str, int] = {}  # a tenant's largest page serves its smaller ones
        for tenant_id, rows_asked in targets:
            num_rows[tenant_id] = max(num_rows.get(tenant_id, 0), rows_asked)
        started = self._clock()
        rows = await self._reader.fetch_all(
            {"tenant_ids": list(num_rows), "limits": list(num_rows.values())},
            self._pages_statement)
        newest: dict[str, list[tuple[int, list[Any]]]] = {}
        for row in rows:
            tenant_id, pk = tenant_and_pk_of(row)
            newest.setdefault(tenant_id, []).append((pk, row))
        ordered = {tenant_id: [row for _, row in sorted(found, key=lambda f: -f[0])]
                   for tenant_id, found in newest.items()}
        for (tenant_id, rows_asked), held in targets.items():
            if self._pages.get((tenant_id, rows_asked)) is held:
                held.rows, held.read_at = ordered.get(tenant_id, [])[:rows_asked], started

    async def _refresh_status(self, held: _Status) -> None:
        started = self._clock()
        report = await self._read_status(held.query)
        if self._status is held:  # not replaced by a poll's own read meanwhile
            held.report, held.read_at = report, started

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        self._watched.clear()
        self._pages.clear()
        self._status = None

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._task, self._watched, self._pages = loop, None, {}, {}
            self._status = None

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="poll-snapshots")

    async def _run(self) -> None:
        while self._watched or self._pages or self._status is not None:
            await self._sleep(self._interval)
            try:
                await self.refresh_once()
            except Exception as exc:  # the polls now read the database and report its error
                log.warning("refreshing the polled batches, pages and status failed (%s: %s); "
                            "polls read the database", type(exc).__name__, exc)
