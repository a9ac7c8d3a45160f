"""The scale benchmark's status-poll targets (issue 31): a fresh client's retrieve and first
page of the list of a live batch while its workers run, p50 and p95 of the worst run against
the limits; and ``boxcar status``'s database part, a figure with the rows its statements read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.scale_target import Target, check, cpu_share, fmt_num

MAX_POLL_P50_MS = 5.0  # a fresh client's poll of a live batch, its workers running
MAX_POLL_P95_MS = 15.0


def poll_target(big: Sequence[Any], what: str = "fresh_poll") -> Target:
    """A fresh client's poll of the live batch while its workers run (the separate poller):
    the worst run's p50 and p95 against the limits. ``what``: ``fresh_poll`` (the batch's
    retrieve), ``list_poll`` (the list's first page) or ``api_status`` (``boxcar status
    --api``)."""
    asked = {"fresh_poll": "status poll of a live batch",
             "list_poll": "first page of the batch list",
             "api_status": "`boxcar status --api`"}[what]
    name = (f"{asked}, new connection, workers running: p50 <= {MAX_POLL_P50_MS:.0f} ms and "
            f"p95 <= {MAX_POLL_P95_MS:.0f} ms (worst run)")
    measured = [r for r in big if getattr(r, f"{what}_ms_p50", None) is not None]
    if not measured:
        return Target(name, None, "not measured", "no --big-lines run, or no poll while in "
                      "progress")
    p50 = max(getattr(r, f"{what}_ms_p50") for r in measured)
    p95 = max(getattr(r, f"{what}_ms_p95") for r in measured)
    count = {"fresh_poll": "num_fresh_polls", "list_poll": "num_list_polls",
             "api_status": "num_api_status"}[what]
    runs = "; ".join(
        f"p50 {getattr(r, f'{what}_ms_p50'):.1f} p95 {getattr(r, f'{what}_ms_p95'):.1f} ms of "
        f"{getattr(r, count, 0)} (server {fmt_num(getattr(r, f'{what}_server_ms_p50'), '.1f')}/"
        f"{fmt_num(getattr(r, f'{what}_server_ms_p95'), '.1f')}"
        + (f", connect {fmt_num(getattr(r, 'fresh_poll_connect_ms_p50', None), '.1f')}/"
           f"{fmt_num(getattr(r, 'fresh_poll_connect_ms_p95', None), '.1f')}"
           if what == "fresh_poll" else "")
        + f"), {cpu_share(r.machine_cpu_busy)}"
        for r in measured)
    return Target(name, p50, check(p50 <= MAX_POLL_P50_MS and p95 <= MAX_POLL_P95_MS),
                  f"worst p95 {p95:.1f} ms; {runs}")


def cli_status_target(big: Sequence[Any]) -> Target:
    """``boxcar status``'s database part while the workers run: a figure (worst run's p50)."""
    name = ("`boxcar status`'s database part, without --api (connect, one round trip, report), "
            "workers running: p50")
    measured = [r for r in big if getattr(r, "cli_status_ms_p50", None) is not None]
    if not measured:
        return Target(name, None, "not measured", "no --big-lines run, or --status-interval 0")
    runs = "; ".join(
        f"p50 {r.cli_status_ms_p50:.1f} p95 {r.cli_status_ms_p95:.1f} ms of {r.num_cli_status} "
        f"(after connecting {fmt_num(r.cli_status_collect_ms_p50, '.1f')}/"
        f"{fmt_num(r.cli_status_collect_ms_p95, '.1f')})" for r in measured)
    return Target(name, max(r.cli_status_ms_p50 for r in measured), "info", runs)


def poll_targets(big: Sequence[Any]) -> list[Target]:
    return [poll_target(big), poll_target(big, "list_poll"), poll_target(big, "api_status"),
            cli_status_target(big)]


def cli_status_lines(r: Any) -> list[str]:
    """The run's ``boxcar status`` statements, explained once: rows read by table."""
    explained = getattr(r, "cli_status_explained", None)
    if not explained:
        return []
    rows = ", ".join(f"{table} {n:,}" for table, n in explained["rows_read"].items())
    return [f"    boxcar status: {explained['statements']} statements, "
            f"{explained['execution_ms']:.1f} ms in PostgreSQL; rows read: {rows or 'none'}"]
