"""The schema revision this code needs, read from the migration files' own ``revision`` and
``down_revision`` lines without importing Alembic: ``boxcar status`` checks the schema in its one
round trip (``cli.status_reader``), and importing Alembic (``service.migrate.head``) costs a fresh
process 60-90 ms, more than the rest of its reads. ``service.migrate.head`` stays the authority;
tests/cli/test_status_reader.py checks that the two agree."""

from __future__ import annotations

import ast
import os
import re
from functools import cache

VERSIONS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "migrations", "versions")
_ASSIGNMENT = re.compile(r"^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+)$", re.MULTILINE)


@cache
def code_head() -> str:
    """The one revision no other migration revises. ``ValueError`` when the files do not say
    it plainly (a merge, branches, a revision not written as a literal): ask Alembic then."""
    revisions: set[str] = set()
    revised: set[str] = set()
    for name in sorted(os.listdir(VERSIONS_DIR)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(VERSIONS_DIR, name), encoding="utf-8") as f:
            found = {m[1]: m[2] for m in _ASSIGNMENT.finditer(f.read())}
        if "revision" not in found:
            raise ValueError(f"{name} names no revision")
        revisions.add(ast.literal_eval(found["revision"]))
        down = ast.literal_eval(found.get("down_revision", "None"))
        if down is not None and not isinstance(down, str):
            raise ValueError(f"{name} revises more than one revision: {down!r}")
        if down is not None:
            revised.add(down)
    heads = revisions - revised
    if len(heads) != 1:
        raise ValueError(f"not one head among the migrations: {sorted(heads)}")
    return heads.pop()
