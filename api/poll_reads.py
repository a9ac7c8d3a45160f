"""A status poll's read: the batch and its counters' sums in one statement (``POLL_STATEMENT``),
and on PostgreSQL its run on the event loop, with no transaction, over psycopg's own async
connections (``AsyncReader``), so the poll never hops to a worker thread and back. On a machine
whose CPUs are busy (workers beside the API) each hop is a wait for a CPU, and the two hops were
half of a loaded poll's time. SQLite has no such driver here: the route reads on a thread.

The statement is compiled once for psycopg (``service.compiled``); its rows go through the
columns' own result processing, so the ``Batch`` built from them is the one a session would
have loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg
from sqlalchemy import (
    ColumnElement,
    Integer,
    Select,
    String,
    and_,
    any_,
    bindparam,
    exc,
    func,
    select,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY

from api.timing import add_statement_time
from service import counters
from service.compiled import Compiled, conninfo
from service.counters import CounterDelta
from service.db import PING_AFTER_IDLE_S
from service.models import Batch, BatchCounter

_BATCH_COLUMNS = list(Batch.__table__.columns)
_BATCH_ATTRS = [Batch.__mapper__.get_property_by_column(c).key for c in _BATCH_COLUMNS]


def _with_sums(batches: ColumnElement[bool], counter_rows: ColumnElement[bool]) -> Select:
    """The columns of the ``batches`` rows and their counters' sums: a few counter rows a
    batch (one per worker that wrote to it), whatever the batch's size."""
    sums = counters.sums_where(counter_rows)
    return (select(*_BATCH_COLUMNS, *counters.sums_columns(sums))
            .select_from(Batch.__table__.outerjoin(sums, sums.c.batch_id == Batch.id))
            .where(batches))


POLL_STATEMENT = _with_sums(
    and_(Batch.id == bindparam("batch_id"), Batch.tenant_id == bindparam("tenant_id")),
    BatchCounter.batch_id == bindparam("batch_id"))
# Every batch of ``batch_ids`` (a list) in one statement, whatever its tenant
# (``api.poll_snapshots``, PostgreSQL only: the ids travel as one array).
_IDS = bindparam("batch_ids", type_=ARRAY(String))
SNAPSHOT_STATEMENT = _with_sums(Batch.id == any_(_IDS), BatchCounter.batch_id == any_(_IDS))


# A tenant's newest ``limit`` batches (``GET /v1/batches``' first page; ask one more than the
# page to learn whether more follow), newest first, with their counters' sums.
_NEWEST = (select(Batch.id).where(Batch.tenant_id == bindparam("tenant_id"))
           .order_by(Batch.pk.desc()).limit(bindparam("limit")))
FIRST_PAGE_STATEMENT = _with_sums(Batch.id.in_(_NEWEST), BatchCounter.batch_id.in_(_NEWEST)
                                  ).order_by(Batch.pk.desc())
# The newest ``limits[i]`` batches of each tenant ``tenant_ids[i]`` (two arrays), with their
# counters' sums, in one statement (``api.poll_snapshots``' first pages; PostgreSQL only): a
# tenant's rows are ``FIRST_PAGE_STATEMENT``'s for its limit, in no particular order.
_HEADS = func.unnest(bindparam("tenant_ids", type_=ARRAY(String)),
                     bindparam("limits", type_=ARRAY(Integer))
                     ).table_valued("tenant_id", "num").render_derived(name="heads")
_NEWEST_OF_HEAD = (select(Batch.id).where(Batch.tenant_id == _HEADS.c.tenant_id)
                   .order_by(Batch.pk.desc()).limit(_HEADS.c.num).lateral("newest"))
_NEWEST_OF_HEADS = select(_NEWEST_OF_HEAD.c.id).select_from(_HEADS.join(_NEWEST_OF_HEAD, true()))
FIRST_PAGES_STATEMENT = _with_sums(Batch.id.in_(_NEWEST_OF_HEADS),
                                   BatchCounter.batch_id.in_(_NEWEST_OF_HEADS))


_ID_AT = _BATCH_COLUMNS.index(Batch.__table__.c.id)
_TENANT_AT = _BATCH_COLUMNS.index(Batch.__table__.c.tenant_id)
_PK_AT = _BATCH_COLUMNS.index(Batch.__table__.c.pk)


def batch_id_of(row: Sequence[Any]) -> str:
    """The batch id of a ``POLL_STATEMENT`` or ``SNAPSHOT_STATEMENT`` row."""
    return row[_ID_AT]


def tenant_and_pk_of(row: Sequence[Any]) -> tuple[str, int]:
    """The tenant and the list order (``pk``) of a ``FIRST_PAGES_STATEMENT`` row."""
    return row[_TENANT_AT], row[_PK_AT]


def batch_and_sums(row: Sequence[Any]) -> tuple[Batch, CounterDelta]:
    """A ``POLL_STATEMENT`` row as the batch (detached, as a session would have loaded it) and
    its summed counters."""
    num = len(_BATCH_ATTRS)
    return Batch(**dict(zip(_BATCH_ATTRS, row[:num], strict=True))), counters.delta_of(row[num:])


APPLICATION_NAME = "boxcar-api-polls"  # how pg_stat_activity names these connections
MAX_CONNECTIONS = 4  # polls waiting for the database beyond these wait for a connection


Run = tuple[Compiled, Mapping[str, Any]]  # a statement and the parameters of one run


async def _execute(conn: psycopg.AsyncConnection, runs: Sequence[Run], *,
                   first_only: bool) -> list[list[Any]]:
    if len(runs) == 1:  # no pipeline: its Sync would cost one more message
        compiled, params = runs[0]
        cursor = await conn.execute(compiled.sql, compiled.params(params))
        return [[await cursor.fetchone()] if first_only else await cursor.fetchall()]
    async with conn.pipeline():
        cursors = [await conn.execute(compiled.sql, compiled.params(params))
                   for compiled, params in runs]
    return [[await cursor.fetchone()] if first_only else await cursor.fetchall()
            for cursor in cursors]


class AsyncReader:
    """Runs one compiled statement on a small pool of autocommit psycopg connections, bound to
    the event loop that first used it (a new loop, as in tests, starts a new pool). A
    connection idle ``ping_after_s`` or longer is pinged before use and replaced if dead, as
    the thread path's pool does (``service.db.ping_when_idle``)."""

    def __init__(self, url: str, statement: Select, *, max_connections: int = MAX_CONNECTIONS,
                 ping_after_s: float = PING_AFTER_IDLE_S,
                 clock: Callable[[], float] = time.monotonic,
                 application_name: str = APPLICATION_NAME) -> None:
        self._conninfo = conninfo(url)
        self._statement = Compiled(statement)
        self._application_name = application_name
        self._max = max_connections
        self._ping_after_s = ping_after_s
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[tuple[psycopg.AsyncConnection, float]] = []

    async def fetch_one(self, params: dict[str, Any],
                        statement: Compiled | None = None) -> list[Any] | None:
        """The statement's first row (the reader's own, or ``statement``), its values
        processed; None for no row."""
        rows = await self.fetch_all(params, statement, first_only=True)
        return rows[0] if rows else None

    async def fetch_all(self, params: dict[str, Any], statement: Compiled | None = None, *,
                        first_only: bool = False) -> list[list[Any]]:
        """The statement's rows, their values processed."""
        [rows] = await self.fetch_each([(statement or self._statement, params)],
                                       first_only=first_only)
        return rows

    async def fetch_each(self, runs: Sequence[Run], *,
                         first_only: bool = False) -> list[list[list[Any]]]:
        """Each run's rows (a statement and its parameters), their values processed; several
        runs go in one pipeline on one connection: one round trip."""
        slots = self._bind_loop()
        async with slots:
            conn = await self._checkout()
            start = time.perf_counter()
            try:
                found = await _execute(conn, runs, first_only=first_only)
            except psycopg.OperationalError as err:
                await conn.close()
                raise exc.OperationalError(runs[0][0].sql, runs[0][1], err) from err
            except BaseException:
                await conn.close()
                raise
            finally:
                add_statement_time(time.perf_counter() - start)
            self._idle.append((conn, self._clock()))
        return [[compiled.process(row) for row in rows if row is not None]
                for (compiled, _), rows in zip(runs, found, strict=True)]

    def _bind_loop(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._slots is None:
            self._loop, self._slots, self._idle = loop, asyncio.Semaphore(self._max), []
        return self._slots

    async def _checkout(self) -> psycopg.AsyncConnection:
        while self._idle:
            conn, since = self._idle.pop()
            if conn.closed:
                continue
            if self._clock() - since < self._ping_after_s:
                return conn
            try:
                await conn.execute("SELECT 1")
                return conn
            except psycopg.Error:
                await conn.close()
        try:
            return await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, application_name=self._application_name)
        except psycopg.OperationalError as err:
            raise exc.OperationalError("connect", {}, err) from err

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.close()
