"""Schema migrations (Alembic, in migrations/) applied from code: ``boxcar db upgrade``, the
embedded mode at start, and the tests."""

from __future__ import annotations

import os
import threading

from alembic import command
from alembic.config import Config

from service.db import Database

MIGRATIONS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "migrations")
_lock = threading.Lock()


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", MIGRATIONS_DIR)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the database to ``revision`` (idempotent)."""
    with _lock, db.engine.begin() as connection:
        config = alembic_config(db.url)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current(db: Database) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.read_engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
