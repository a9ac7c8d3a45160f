"""``PrepareError``: why a line cannot run, as every part of the request pipeline returns it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrepareError:
    """Why a line cannot run: a line error code, a message naming the field, the field."""

    code: str
    message: str
    param: str | None = None
