"""Service test fixtures: the databases (SQLite, PostgreSQL) of tests.conftest_services."""

from tests.conftest_services import *  # noqa: F403
