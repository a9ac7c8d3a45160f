"""The scale benchmark's figures as a table, and issue 17's targets, each met or not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SCALING_SHARE = 0.60  # each step up in workers adds >= 60% of its ideal throughput
MAX_ATTEMPTS_PER_CLAIM = 1.1
MAX_LOCK_WAIT_SHARE = 0.10
MAX_STATUS_POLL_MS = 5.0
MIN_BIG_LINES_PER_S = 3000.0
MAX_IDLE_COMMITS_PER_S = 1.0
MAX_WAITS_SHOWN = 10
CPU_LIMIT = 0.90  # a machine this busy is the limit, not the service


@dataclass
class Target:
    name: str
    value: float | None
    status: str  # met | not met | CPU-limited (not met, the machine's CPU was) | not measured
    detail: str = ""


def _check(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(sweep: Sequence[Any], big: Any | None) -> list[Target]:
    found: list[Target] = []
    paced = sorted((r for r in sweep if r.engine == "paced"), key=lambda r: r.num_workers)
    for low, high in zip(paced, paced[1:], strict=False):
        ideal_added = (high.num_workers - low.num_workers) * high.lines_per_s_per_worker
        share = (high.lines_per_s - low.lines_per_s) / ideal_added
        status = _check(share >= SCALING_SHARE)
        # The CPU the service (API, workers, PostgreSQL) would need for the target's lines/s at
        # the larger run's CPU per line: the machine is the limit when that is (nearly) all of
        # it, or when it was that busy.
        target_lines_per_s = low.lines_per_s + SCALING_SHARE * ideal_added
        needed = target_lines_per_s * cpu_ms_per_line(high) / 1000
        cpus = getattr(high, "num_cpus", 0) or None
        if status != "met" and (high.machine_cpu_busy >= CPU_LIMIT
                                or (cpus is not None and needed >= CPU_LIMIT * cpus)):
            status = "CPU-limited"
        room = (f"; the target's {target_lines_per_s:,.0f} lines/s need {needed:.2f} of "
                f"{cpus} CPUs at {cpu_ms_per_line(high):.2f} ms a line" if cpus else "")
        low_run, high_run = (getattr(r, "run_lines_per_s", None) for r in (low, high))
        if low_run is not None and high_run is not None:
            # The same step over the runs alone, without the one-worker prepare and finalize.
            room += (f"; run phase alone +{high_run - low_run:,.0f} "
                     f"({(high_run - low_run) / ideal_added:.0%} of ideal)")
        found.append(Target(
            f"paced {low.num_workers}->{high.num_workers} workers adds >= 60% of ideal", share,
            status, f"+{high.lines_per_s - low.lines_per_s:,.0f} of +{ideal_added:,.0f} lines/s; "
                    f"machine CPU {100 * high.machine_cpu_busy:.0f}% busy{room}"))
    if sweep:
        top = max(sweep, key=lambda r: r.num_workers)
        value = top.attempts_per_claim
        found.append(Target(
            f"attempts per claim <= {MAX_ATTEMPTS_PER_CLAIM} at {top.num_workers} workers", value,
            "not measured" if value is None else _check(value <= MAX_ATTEMPTS_PER_CLAIM),
            "" if value is not None else "the workers export no claim counters"))
    runs = [*sweep, *([big] if big is not None else [])]
    shares = [r.lock_wait_share for r in runs if r.lock_wait_share is not None]
    worst = max(shares) if shares else None
    found.append(Target("lock waits < 10% of backend active time (worst run)", worst,
                        "not measured" if worst is None else _check(worst < MAX_LOCK_WAIT_SHARE)))
    idle = max((r.idle_commits_per_s_per_worker for r in runs), default=None)
    found.append(Target("idle commits/s per worker <= 1 (worst run)", idle,
                        "not measured" if idle is None else _check(idle <= MAX_IDLE_COMMITS_PER_S)))
    if big is None:
        found.append(Target("status poll of a live 50,000-line batch < 5 ms", None, "not measured",
                            "--big-lines 0"))
        found.append(Target("50,000-line batch >= 3,000 lines/s (instant)", None, "not measured",
                            "--big-lines 0"))
    else:
        found.append(_poll_target(big))
        found.append(Target(
            f"{big.num_lines:,}-line batch >= 3,000 lines/s (instant, {big.num_workers} workers)",
            big.lines_per_s, _check(big.lines_per_s >= MIN_BIG_LINES_PER_S),
            f"machine CPU {100 * big.machine_cpu_busy:.0f}% busy"))
    broken = [r.num_workers for r in runs if not r.exactly_once]
    found.append(Target("every custom_id exactly once in every run (runs broken)", len(broken),
                        _check(not broken), f"broken at {broken} workers" if broken else ""))
    return found


def cpu_ms_per_line(r: Any) -> float:
    """The service's CPU per line: the API and workers, and PostgreSQL's backends."""
    return (getattr(r, "service_cpu_ms_per_line", 0.0) or 0.0) + r.pg_cpu_ms_per_line


def _poll_target(big: Any) -> Target:
    """The status poll as a client sees it, measured where the machine is not saturated (the
    quiet polls, every worker stopped); the polls made under the run's load, as the client and
    as the API timed them, beside it."""
    name = f"status poll of a live {big.num_lines:,}-line batch < 5 ms"
    quiet = getattr(big, "quiet_poll_ms_median", None)
    loaded = (f"under load ({100 * big.machine_cpu_busy:.0f}% CPU busy, {big.num_status_polls} "
              f"polls): client {_num(big.status_poll_ms_median, '.1f')} ms, server "
              f"{_num(getattr(big, 'status_poll_server_ms_median', None), '.1f')} ms")
    if quiet is None:
        poll = big.status_poll_ms_median
        return Target(name, poll, "not measured" if poll is None else _check(
            poll < MAX_STATUS_POLL_MS), f"no quiet polls; {loaded}")
    cpu = big.quiet_machine_cpu_busy
    return Target(name, quiet, _check(quiet < MAX_STATUS_POLL_MS),
                  f"client median of {big.num_quiet_polls} polls with the workers stopped "
                  f"(machine CPU {100 * cpu:.0f}% busy), server "
                  f"{_num(big.quiet_poll_server_ms_median, '.1f')} ms; {loaded}")


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


COLUMNS = ("workers", "engine", "lines", "lines/s", "ideal", "eff", "att/claim", "lock wait",
           "idle commits/s/w", "PG CPU ms/line", "svc CPU ms/line", "poll ms c/s (n)", "CPU busy",
           "conns", "once")


def run_row(r: Any) -> list[str]:
    return [
        str(r.num_workers), r.engine, f"{r.num_lines:,}", f"{r.lines_per_s:,.0f}",
        _num(r.ideal_lines_per_s, ",.0f"),
        "n/a" if r.efficiency is None else f"{100 * r.efficiency:.0f}%",
        _num(r.attempts_per_claim, ".2f"),
        "n/a" if r.lock_wait_share is None else f"{100 * r.lock_wait_share:.1f}%",
        f"{r.idle_commits_per_s_per_worker:.1f}", f"{r.pg_cpu_ms_per_line:.2f}",
        _num(getattr(r, "service_cpu_ms_per_line", None), ".2f"),
        f"{_num(r.status_poll_ms_median, '.1f')}/"
        f"{_num(getattr(r, 'status_poll_server_ms_median', None), '.1f')} ({r.num_status_polls})",
        f"{100 * r.machine_cpu_busy:.0f}%", str(r.peak_connections),
        "yes" if r.exactly_once else f"NO ({r.missing} missing, {r.duplicated} repeated)",
    ]


def format_report(sweep: Sequence[Any], big: Any | None, found: list[Target]) -> str:
    rows = [list(COLUMNS)] + [run_row(r) for r in [*sweep, *([big] if big else [])]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in rows]
    lines += ["", "eff: lines/s over ideal (workers x the paced engine's lines/s); att/claim: "
              "shard claim attempts per claim won; lock wait: share of active PostgreSQL backend "
              "samples waiting on a lock; idle commits/s/w: commits/s per idle worker; svc CPU: "
              "CPU of the API and worker processes per line; poll: "
              "median status GET while the batch ran, as the client (c) and the API's "
              "Server-Timing (s) measured it; conns: peak database connections.", "",
              "targets (issue 17):"]
    for t in found:
        value = "n/a" if t.value is None else f"{t.value:.3g}"
        detail = f"  ({t.detail})" if t.detail else ""
        lines.append(f"  [{t.status}] {t.name}: {value}{detail}")
    lines += ["", "what active PostgreSQL backends waited on (share of active samples; Lock "
              "waits make the lock-wait figure):"]
    for r in [*sweep, *([big] if big else [])]:
        lines.append(f"  {r.num_workers} workers, {r.engine}, {r.num_lines:,} lines "
                     f"({r.active_backend_samples:,} active samples):")
        waits = getattr(r, "waits", None) or []
        lines += [f"    {100 * w['share']:5.1f}%  {w['type']}:{w['event']}  {w['statement']}"
                  for w in waits[:MAX_WAITS_SHOWN]] or ["    none"]
        if getattr(r, "run_s", None) is not None:
            eff = (f", {100 * r.run_efficiency:.0f}% of ideal" if r.run_efficiency is not None
                   else "")
            lines.append(f"    phases: prepare {r.prepare_s:.1f} s, run {r.run_s:.1f} s "
                         f"({r.run_lines_per_s:,.0f} lines/s{eff}), finalize "
                         f"{r.finalize_s:.1f} s")
        hot = getattr(r, "line_hot_update_share", None)
        if hot is not None:
            lines.append(f"    request_lines: {100 * hot:.0f}% of row updates HOT; "
                         f"{r.line_heap_bytes_per_line:,.0f} heap + "
                         f"{r.line_index_bytes_per_line:,.0f} index bytes a line, "
                         f"rows {r.line_row_bytes:,.0f} bytes")
    return "\n".join(lines)
