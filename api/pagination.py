"""One page of a list endpoint: newest first by default, ``after`` an object's id (its row is
the cursor), ``limit`` rows and whether more follow, in OpenAI's list shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Select
from sqlalchemy.orm import Session

from service.objects import page


def paginate(session: Session, query: Select, *, cursor: Any | None, limit: int,
             render: Callable[[Any], dict[str, Any]], descending: bool = True,
             before_render: Callable[[list[Any]], None] | None = None) -> dict[str, Any]:
    """The rows of ``query`` past ``cursor`` (a row of the same table, or None), in ``pk``
    order, rendered with ``render``. The table is the query's first entity.
    ``before_render`` sees the page's rows first (to read what they need in one statement)."""
    model = query.column_descriptions[0]["entity"]
    if cursor is not None:
        query = query.where(model.pk < cursor.pk if descending else model.pk > cursor.pk)
    query = query.order_by(model.pk.desc() if descending else model.pk.asc())
    rows = session.scalars(query.limit(limit + 1)).all()
    shown = list(rows[:limit])
    if before_render is not None:
        before_render(shown)
    return page([render(row) for row in shown], has_more=len(rows) > limit)
