"""Figures the reliability, load and fuzzing tests measure, printed as tables when the run ends
(``pytest_terminal_summary`` in tests/conftest.py) and, when ``BOXCAR_FIGURES`` names a file,
appended to it as JSON lines."""

from __future__ import annotations

import json
import os
from typing import Any

_TABLES: dict[str, list[dict[str, Any]]] = {}


def record(table: str, **row: Any) -> None:
    """Add one row to ``table`` (columns are the keys, in the order first seen)."""
    _TABLES.setdefault(table, []).append(row)
    path = os.environ.get("BOXCAR_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"table": table, **row}, default=str) + "\n")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return "" if value is None else str(value)


def render() -> str:
    """Every table recorded in this run, as aligned text."""
    blocks = []
    for title, rows in _TABLES.items():
        columns: list[str] = []
        for row in rows:
            columns += [key for key in row if key not in columns]
        cells = [[_cell(row.get(c)) for c in columns] for row in rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        lines = [title,
                 "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
