"""A status poll's read: the batch and its counters' sums in one statement (``POLL_STATEMENT``),
and on PostgreSQL its run on the event loop, with no transaction, over psycopg's own async
connections (``AsyncReader``), so the poll never hops to a worker thread and back. On a machine
whose CPUs are busy (workers beside the API) each hop is a wait for a CPU, and the two hops were
half of a loaded poll's time. SQLite has no such driver here: the route reads on a thread.

The statement is compiled once for psycopg; its rows go through the columns' own result
processing, so the ``Batch`` built from them is the one a session would have loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from sqlalchemy import Select, bindparam, exc, select
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.engine import make_url

from api.timing import add_statement_time
from service import counters
from service.counters import CounterDelta
from service.db import PING_AFTER_IDLE_S
from service.models import Batch

# The batch's columns and its counters' sums: a few rows, one per worker that wrote to it,
# whatever the batch's size.
_SUMS = counters.sums_of_one(bindparam("batch_id"))
_BATCH_COLUMNS = list(Batch.__table__.columns)
_BATCH_ATTRS = [Batch.__mapper__.get_property_by_column(c).key for c in _BATCH_COLUMNS]
POLL_STATEMENT = (
    select(*_BATCH_COLUMNS, *counters.sums_columns(_SUMS))
    .select_from(Batch.__table__.outerjoin(_SUMS, _SUMS.c.batch_id == Batch.id))
    .where(Batch.id == bindparam("batch_id"), Batch.tenant_id == bindparam("tenant_id")))


def batch_and_sums(row: Sequence[Any]) -> tuple[Batch, CounterDelta]:
    """A ``POLL_STATEMENT`` row as the batch (detached, as a session would have loaded it) and
    its summed counters."""
    num = len(_BATCH_ATTRS)
    return Batch(**dict(zip(_BATCH_ATTRS, row[:num], strict=True))), counters.delta_of(row[num:])


APPLICATION_NAME = "boxcar-api-polls"  # how pg_stat_activity names these connections
MAX_CONNECTIONS = 4  # polls waiting for the database beyond these wait for a connection


class AsyncReader:
    """Runs one compiled statement on a small pool of autocommit psycopg connections, bound to
    the event loop that first used it (a new loop, as in tests, starts a new pool). A
    connection idle ``ping_after_s`` or longer is pinged before use and replaced if dead, as
    the thread path's pool does (``service.db.ping_when_idle``)."""

    def __init__(self, url: str, statement: Select, *, max_connections: int = MAX_CONNECTIONS,
                 ping_after_s: float = PING_AFTER_IDLE_S,
                 clock: Callable[[], float] = time.monotonic,
                 application_name: str = APPLICATION_NAME) -> None:
        self._conninfo = make_url(url).set(drivername="postgresql").render_as_string(
            hide_password=False)
        dialect = psycopg_dialect()
        compiled = statement.compile(dialect=dialect)
        self._sql = str(compiled)
        self._processors = [column.type.result_processor(dialect, None)
                            for column in statement.selected_columns]
        self._application_name = application_name
        self._max = max_connections
        self._ping_after_s = ping_after_s
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[tuple[psycopg.AsyncConnection, float]] = []

    async def fetch_one(self, params: dict[str, Any]) -> list[Any] | None:
        """The statement's first row, its values processed; None for no row."""
        slots = self._bind_loop()
        async with slots:
            conn = await self._checkout()
            start = time.perf_counter()
            try:
                cursor = await conn.execute(self._sql, params)
                row = await cursor.fetchone()
            except psycopg.OperationalError as err:
                await conn.close()
                raise exc.OperationalError(self._sql, params, err) from err
            except BaseException:
                await conn.close()
                raise
            finally:
                add_statement_time(time.perf_counter() - start)
            self._idle.append((conn, self._clock()))
        if row is None:
            return None
        return [value if process is None else process(value)
                for value, process in zip(row, self._processors, strict=True)]

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
