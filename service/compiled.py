"""A SQLAlchemy statement compiled once to SQL text for psycopg, for the readers that run it on
psycopg's own connections (the API's poll reads, ``api.poll_reads``; ``boxcar status``'s one
round trip, ``cli.status_reader``): building and compiling a statement costs more CPU than
PostgreSQL takes to run it, and a session would do it again on every new engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import CompoundSelect, Select
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.engine import make_url


def conninfo(url: str) -> str:
    """The libpq connection string of a SQLAlchemy database URL (``postgresql+psycopg://``)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Compiled:
    """A statement compiled for psycopg once, with its columns' result processing.

    Its constants (a ``literal``, the values of an ``in_`` of a fixed list) are bound here;
    each run gives the values of its ``bindparam``s without one (``params``)."""

    def __init__(self, statement: Select | CompoundSelect) -> None:
        dialect = psycopg_dialect()
        compiled = statement.compile(dialect=dialect)
        required = {key for key, bind in compiled.binds.items() if bind.required}
        # An ``in_`` of a fixed list compiles to one placeholder that each run would expand:
        # expanded here, once, with the run's own parameters left as placeholders.
        expanded = compiled.construct_expanded_state(dict.fromkeys(required))
        self.sql = expanded.statement
        self._constants = {key: value for key, value in expanded.parameters.items()
                           if key not in required}
        self._processors = [column.type.result_processor(dialect, None)
                            for column in statement.selected_columns]

    def params(self, values: Mapping[str, Any]) -> Mapping[str, Any]:
        """The parameters of one run: the statement's constants and ``values``."""
        return {**self._constants, **values} if self._constants else values

    def process(self, row: Sequence[Any]) -> list[Any]:
        return [value if process is None else process(value)
                for value, process in zip(row, self._processors, strict=True)]
