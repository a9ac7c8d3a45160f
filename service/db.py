"""Database engines and sessions: PostgreSQL (psycopg 3) in production, SQLite embedded.

SQLite allows one writer at a time; a deferred transaction that turns into a writer can fail at
once with "database is locked" instead of waiting. Sessions that write therefore start with
``BEGIN IMMEDIATE`` (they queue on the busy timeout), and pure reads use a second engine with
plain ``BEGIN`` so they never wait for a writer (WAL mode).
"""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import DateTime, Engine, create_engine, event, exc, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

UTC = dt.UTC


def utcnow() -> dt.datetime:
    return dt.datetime.now(UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dt.datetime: UTCDateTime}


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    engine = create_engine(
        url, connect_args={"check_same_thread": False, "timeout": 60}, pool_size=8,
        max_overflow=16,
    )

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        # Take transaction control away from pysqlite so BEGIN is ours to emit.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


# A pooled connection back in use within this long is not pinged before it is handed out.
PING_AFTER_IDLE_S = 1.0


def ping_when_idle(engine: Engine, idle_s: float, *,
                   clock: Callable[[], float] = time.monotonic) -> None:
    """SQLAlchemy's ``pool_pre_ping``, for connections idle ``idle_s`` or longer only: the ping
    is a round trip to the server, and on a busy machine a round trip is two waits for a CPU
    (the server's process, then ours). A connection used a moment ago has not been cut by a
    firewall or a restart in between, or not more often than the statement after a ping could
    meet the same fate; one that sat idle is checked as before, and a dead one replaced."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, record) -> None:
        record.info["boxcar_idle_since"] = clock()  # fresh: nothing to check

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_conn, record) -> None:
        if record is not None:
            record.info["boxcar_idle_since"] = clock()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn, record, proxy) -> None:
        since = record.info.get("boxcar_idle_since")
        if since is not None and clock() - since < idle_s:
            return
        dialect = engine.dialect
        try:
            dialect.do_ping(dbapi_conn)
        except dialect.loaded_dbapi.Error as err:
            if dialect.is_disconnect(err, dbapi_conn, None):
                raise exc.DisconnectionError(f"the pooled connection is gone: {err}") from err
            raise


class Database:
    """The service's engines and session factories for one URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            self.engine = _sqlite_engine(url, immediate=True)
            self.read_engine = _sqlite_engine(url, immediate=False)
        else:
            self.engine = create_engine(url, pool_size=10, max_overflow=20)
            ping_when_idle(self.engine, PING_AFTER_IDLE_S)
            self.read_engine = self.engine
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._read_sessions = sessionmaker(self.read_engine, expire_on_commit=False)
        # PostgreSQL: the same pool, each statement its own transaction (psycopg's autocommit,
        # a client-side switch): no BEGIN and no COMMIT round trip around a one-statement read.
        self._autocommit_sessions = self._read_sessions if self.is_sqlite else sessionmaker(
            self.engine.execution_options(isolation_level="AUTOCOMMIT"),
            expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A read-write transaction: committed on success, rolled back on error."""
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A read-only transaction that never waits for a writer."""
        with self._read_sessions() as session, session.begin():
            yield session

    @contextmanager
    def autocommit_session(self) -> Iterator[Session]:
        """Reads with no transaction around them on PostgreSQL: each statement sees its own
        snapshot, so only a read that is one statement (a status poll's) is consistent here;
        ``read_session`` for anything more. On a busy machine each round trip to the server is
        a wait for a CPU twice over, and BEGIN and COMMIT were two of a poll's five. SQLite:
        ``read_session``."""
        with self._autocommit_sessions() as session, session.begin():
            yield session

    def ping(self) -> None:
        with self.read_engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self.engine.dispose()
        if self.read_engine is not self.engine:
            self.read_engine.dispose()


@contextmanager
def temporary_schema(server_url: str, prefix: str = "bx_") -> Iterator[str]:
    """The URL of a fresh schema in ``server_url``'s PostgreSQL database (its tables apart from
    everyone else's), dropped with everything in it afterwards: tests and benchmarks."""
    schema = f"{prefix}{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{server_url}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
