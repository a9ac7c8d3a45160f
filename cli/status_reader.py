"""``boxcar status`` on PostgreSQL in one round trip after connecting: a psycopg connection of
its own, and in one pipeline the schema's revision and ``api.status.statements`` (compiled for
psycopg once, ``service.compiled``), then the report made from their rows as ``collect`` makes
it (``api.status.report``).

The command runs on a machine whose CPUs the workers keep busy, from a new process with a new
connection each time. ``open_database``'s path (a SQLAlchemy engine: the dialect's own queries
on its first connection, Alembic's check of the schema, a session's BEGIN, nine statements
compiled again for the new engine, COMMIT) cost 25 round trips after connecting and tens of
milliseconds of Python; every round trip is a wait for a CPU twice over (the server's process,
then ours). Here: connect, one pipeline, close.

Any failure of it (no connection, a schema not at the code's revision, anything else) falls
back to ``open_database``'s path (``StatusCommand``): its messages say why, as before.
SQLite has no such path; ``collect`` reads it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from functools import cache
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import String, column, select, table

from api.status import StatusRows, collect, compiled_statements, report, statements
from service.compiled import Compiled, conninfo
from service.db import Database, utcnow
from service.revisions import code_head

log = logging.getLogger(__name__)

APPLICATION_NAME = "boxcar-status"  # how pg_stat_activity names its connection
# Unless the URL says otherwise: a server that does not answer costs this much before the
# fallback waits for it as open_database always did (a refused connection fails at once).
CONNECT_TIMEOUT_S = 10

# The schema's revision (Alembic's table): checked in the same round trip as the reads.
_REVISION = select(table("alembic_version", column("version_num", String)).c.version_num)


@cache
def _compiled() -> list[Compiled]:
    """``_REVISION`` and ``api.status.STATEMENTS``, compiled once a process."""
    return [Compiled(_REVISION), *compiled_statements()]


class SchemaNotAtHead(Exception):
    """The schema is not the code's revision: ``open_database`` refuses with its message."""


class StatusReader:
    """One report's reads on a connection of its own, in one pipeline. ``connect_s``: the
    last report's seconds to connect."""

    def __init__(self, url: str) -> None:
        self._conninfo = conninfo(url)
        given = conninfo_to_dict(self._conninfo)
        self._timeout: dict[str, Any] = (
            {} if "connect_timeout" in given else {"connect_timeout": CONNECT_TIMEOUT_S})
        self.connect_s = 0.0
        # A statement that fails (an empty database: no such table) aborts the pipeline, and
        # psycopg logs its "error ignored terminating" warning to stderr beside the fallback's
        # one-line answer; the error itself reaches the caller, which falls back. Once a
        # reader, not once a read (``--watch`` reads every interval).
        logging.getLogger("psycopg").setLevel(logging.ERROR)

    def connect(self) -> psycopg.Connection[Any]:
        # Autocommit: no BEGIN before the reads; the pipeline's one Sync ends its implicit
        # transaction. Nothing is prepared: the connection runs each statement once.
        return psycopg.connect(self._conninfo, autocommit=True, prepare_threshold=None,
                               application_name=APPLICATION_NAME, **self._timeout)

    def sql(self, *, now: dt.datetime, interval: float) -> list[tuple[str, Any]]:
        """(SQL, parameters) of each statement ``read`` sends, the revision's first."""
        params: list[dict[str, Any]] = [{}, *(p for _, p in statements(now=now, interval=interval))]
        return [(c.sql, c.params(p)) for c, p in zip(_compiled(), params, strict=True)]

    def read(self, conn: psycopg.Connection[Any], *, now: dt.datetime,
             interval: float) -> StatusRows:
        """Every statement in one pipeline: one round trip. Raises ``SchemaNotAtHead``."""
        with conn.pipeline():
            cursors = [conn.execute(sql, params)
                       for sql, params in self.sql(now=now, interval=interval)]
        revision, *found = ([c.process(row) for row in cursor.fetchall()]
                            for c, cursor in zip(_compiled(), cursors, strict=True))
        if revision != [[code_head()]]:
            raise SchemaNotAtHead(f"schema at {revision}, the code's is {code_head()}")
        return StatusRows(*found)

    def collect(self, *, interval: float,
                max_enqueued_tokens: int | None = None) -> dict[str, Any]:
        """``api.status.collect``'s report."""
        start = time.perf_counter()
        with self.connect() as conn:
            self.connect_s = time.perf_counter() - start
            now = utcnow()
            rows = self.read(conn, now=now, interval=interval)
        return report(rows, now=now, max_enqueued_tokens=max_enqueued_tokens)


class StatusCommand:
    """Where ``boxcar status`` gets its reports: ``StatusReader`` on PostgreSQL while it works,
    else ``open_database`` (which refuses, ``Refused``, with today's message) and ``collect``.
    ``connect_s``: the last report's seconds to connect (or open the database and check its
    schema), ``fast``: whether it came the fast way."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._reader = None if url.startswith("sqlite") else StatusReader(url)
        self._db: Database | None = None
        self.connect_s = 0.0
        self.fast = False

    def collect(self, *, interval: float,
                max_enqueued_tokens: int | None = None) -> dict[str, Any]:
        if self._reader is not None:
            try:
                found = self._reader.collect(interval=interval,
                                             max_enqueued_tokens=max_enqueued_tokens)
                self.connect_s, self.fast = self._reader.connect_s, True
                return found
            except Exception as exc:  # whatever it was, the way below says it or works
                log.debug("boxcar status: the one-round-trip read failed (%s: %s)",
                          type(exc).__name__, exc)
                self._reader = None
        self.fast = False
        if self._db is None:
            from cli.database import open_database

            start = time.perf_counter()
            self._db = open_database(self._url)
            self.connect_s = time.perf_counter() - start
        else:
            self.connect_s = 0.0
        return collect(self._db, interval=interval, max_enqueued_tokens=max_enqueued_tokens)

    def close(self) -> None:
        if self._db is not None:
            self._db.dispose()
            self._db = None
