"""Schema migrations (Alembic, in migrations/) applied from code: ``boxcar db upgrade``, the
embedded mode at start, and the tests; and the start-up check every command and the API make.

SQLite is the embedded mode: it migrates itself (``ensure_schema``). PostgreSQL is shared by many
processes of possibly different versions, so only ``boxcar db upgrade`` (or ``boxcar api
--migrate``) changes it; the others refuse to run on a schema that is not the code's head
(``SchemaNotCurrent``, a message that names the command to run).
"""

from __future__ import annotations

import os
import threading
import time
from functools import cache

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from service.db import Database

MIGRATIONS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "migrations")
_lock = threading.Lock()


class SchemaNotCurrent(RuntimeError):
    """The database's schema is not the revision this code needs."""

    def __init__(self, current: str | None, head: str) -> None:
        self.current = current
        self.head = head
        super().__init__(f"database schema at {current or 'nothing (empty database)'}, "
                         f"needs {head}: run `boxcar db upgrade`")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", MIGRATIONS_DIR)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the database to ``revision`` (idempotent)."""
    # Alembic owns the transaction (migrations/env.py): a migration may step out of it for
    # statements PostgreSQL runs only outside one (CREATE INDEX CONCURRENTLY, 0006).
    with _lock, db.engine.connect() as connection:
        config = alembic_config(db.url)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current(db: Database) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.read_engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@cache
def head() -> str:
    """The revision this code needs (the newest in migrations/)."""
    revision = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    if revision is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS_DIR}")
    return revision


def check_schema(db: Database) -> None:
    """Raise ``SchemaNotCurrent`` unless the database is at ``head()``."""
    revision = current(db)
    if revision != head():
        raise SchemaNotCurrent(revision, head())


def ensure_schema(db: Database) -> None:
    """At a command's start: SQLite is migrated; PostgreSQL is checked (``SchemaNotCurrent``)."""
    if db.is_sqlite:
        upgrade(db)
    else:
        check_schema(db)


class SchemaGate:
    """The API's view of the schema: checked at the first request, then again at most every
    ``recheck_seconds`` until it is current (``boxcar db upgrade`` ran), then never again."""

    def __init__(self, db: Database, *, recheck_seconds: float = 2.0) -> None:
        self.db = db
        self.recheck_seconds = recheck_seconds
        self._problem: str | None = None
        self._current = False
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def is_current(self) -> bool:
        return self._current

    def problem(self) -> str | None:
        """None when the schema is current, else why not (one line). A database that cannot be
        reached raises (the caller's handlers answer 503 for it)."""
        if self._current:
            return None
        with self._lock:
            if not self._current and time.monotonic() - self._checked_at >= self.recheck_seconds:
                try:
                    check_schema(self.db)
                except SchemaNotCurrent as exc:
                    self._problem = str(exc)
                else:
                    self._current, self._problem = True, None
                self._checked_at = time.monotonic()
            return self._problem
