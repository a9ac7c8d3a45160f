"""A target of the scale benchmark, met or not, and how its figures are written: a target
missed on a saturated machine is missed, with the CPU busy share beside it, never excused."""

from __future__ import annotations

from dataclasses import dataclass

SATURATED = 0.90  # a machine this busy is saturated: its figures judge the machine too


@dataclass
class Target:
    name: str
    value: float | None
    status: str  # met | not met | not measured | info (a figure without a target)
    detail: str = ""


def check(ok: bool) -> str:
    return "met" if ok else "not met"


def cpu_share(busy: float) -> str:
    state = "saturated" if busy >= SATURATED else "not saturated"
    return f"machine CPU {100 * busy:.0f}% busy ({state})"


def fmt_num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)
