"""The scale benchmark's figures as tables (every run, then each configuration's median and
spread over its repeats) and the targets of issues 17 and 31, each met or not: a target missed
on a saturated machine is printed as missed, with the CPU busy share beside it, never excused."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.scale_poll_targets import cli_status_lines, poll_targets
from bench.scale_target import Target, check, cpu_share, fmt_num

SCALING_SHARE = 0.60  # each step up in workers adds >= 60% of its ideal throughput
TOP_SCALING_SHARE = 0.70  # the step to the largest count (16->32), where not saturated
MAX_ATTEMPTS_PER_CLAIM = 1.1
MAX_LOCK_SHARE = 0.10  # lock samples over non-idle backend samples
MIN_BIG_LINES_PER_S = 3000.0
MAX_IDLE_COMMITS_PER_S = 1.0
MAX_WAITS_SHOWN = 6
FLOOR_PACE = 100.0  # the floors below are for this paced engine
# Issue 31's re-measure (2-core AMD EPYC, private PostgreSQL, fsync off, paced 100 lines/s a
# worker, 40,000 lines): the lowest of two runs, the floor a change must not fall below.
FLOOR_LINES_PER_S = {8: 721.0, 16: 1162.0, 32: 2092.0}
FLOOR_BIG_LINES_PER_S = 3234.0


@dataclass(frozen=True)
class Summary:
    """One configuration's runs: lines/s median and spread, and the CPU they had."""

    num_workers: int
    engine: str
    num_runs: int
    lines_per_s: float  # median
    low: float
    high: float
    ideal_lines_per_s: float | None
    machine_cpu_busy: float  # median

    @property
    def efficiency(self) -> float | None:
        return self.lines_per_s / self.ideal_lines_per_s if self.ideal_lines_per_s else None

    @property
    def spread(self) -> float:
        """(high - low) over the median."""
        return (self.high - self.low) / self.lines_per_s if self.lines_per_s else 0.0


def summarize(runs: Sequence[Any]) -> list[Summary]:
    """The runs grouped by (workers, engine), in worker order."""
    groups: dict[tuple[int, str], list[Any]] = {}
    for r in runs:
        groups.setdefault((r.num_workers, r.engine), []).append(r)
    found = []
    for (workers, engine), group in sorted(groups.items()):
        rates = [r.lines_per_s for r in group]
        found.append(Summary(workers, engine, len(group), statistics.median(rates), min(rates),
                             max(rates), group[0].ideal_lines_per_s,
                             statistics.median(r.machine_cpu_busy for r in group)))
    return found


def scaling_targets(sweep: Sequence[Any]) -> list[Target]:
    """Each step between paced worker counts, over the medians; the step to the largest count
    against ``TOP_SCALING_SHARE``, the others against ``SCALING_SHARE``. The repeats paired in
    run order give the share's spread."""
    paced = [r for r in sweep if r.engine == "paced"]
    summaries = summarize(paced)
    found = []
    for low, high in zip(summaries, summaries[1:], strict=False):
        pace = next(r.lines_per_s_per_worker for r in paced if r.num_workers == high.num_workers)
        ideal_added = (high.num_workers - low.num_workers) * pace
        share = (high.lines_per_s - low.lines_per_s) / ideal_added
        goal = TOP_SCALING_SHARE if high is summaries[-1] else SCALING_SHARE
        pairs = zip(sorted((r for r in paced if r.num_workers == low.num_workers),
                           key=lambda r: getattr(r, "repeat", 1)),
                    sorted((r for r in paced if r.num_workers == high.num_workers),
                           key=lambda r: getattr(r, "repeat", 1)), strict=False)
        shares = [(h.lines_per_s - lo.lines_per_s) / ideal_added for lo, h in pairs]
        spread = (f"; repeats {100 * min(shares):.0f}-{100 * max(shares):.0f}%"
                  if len(shares) > 1 else "; one run each")
        found.append(Target(
            f"paced {low.num_workers}->{high.num_workers} workers adds >= {goal:.0%} of ideal "
            "(medians)", share, check(share >= goal),
            f"+{high.lines_per_s - low.lines_per_s:,.0f} of +{ideal_added:,.0f} lines/s"
            f"{spread}; {cpu_share(high.machine_cpu_busy)}"))
    return found


def floor_targets(sweep: Sequence[Any], big: Sequence[Any]) -> list[Target]:
    """Issue 31's figures as the floor, for the configuration they were measured in."""
    found = []
    for s in summarize([r for r in sweep if r.engine == "paced"
                        and r.lines_per_s_per_worker == FLOOR_PACE]):
        floor = FLOOR_LINES_PER_S.get(s.num_workers)
        if floor is not None:
            found.append(Target(
                f"paced {s.num_workers} workers >= {floor:,.0f} lines/s (issue 31's floor; "
                "median)", s.lines_per_s, check(s.lines_per_s >= floor),
                f"runs {s.low:,.0f}-{s.high:,.0f}; {cpu_share(s.machine_cpu_busy)}"))
    for s in summarize(big):
        found.append(Target(
            f"{big[0].num_lines:,}-line instant batch >= {MIN_BIG_LINES_PER_S:,.0f} lines/s "
            f"({s.num_workers} workers; median; issue 31's floor {FLOOR_BIG_LINES_PER_S:,.0f})",
            s.lines_per_s, check(s.lines_per_s >= MIN_BIG_LINES_PER_S),
            f"runs {s.low:,.0f}-{s.high:,.0f}; "
            f"{'above' if s.lines_per_s >= FLOOR_BIG_LINES_PER_S else 'below'} the floor; "
            f"{cpu_share(s.machine_cpu_busy)}"))
    return found


def lock_target(runs: Sequence[Any]) -> Target:
    """The worst run's lock samples over its non-idle backend samples, with the counts."""
    measured = [r for r in runs if getattr(r, "lock_share_of_non_idle", None) is not None]
    name = f"lock waits < {MAX_LOCK_SHARE:.0%} of non-idle backend samples (worst run)"
    if not measured:
        return Target(name, None, "not measured", "no non-idle backend sample")
    worst = max(measured, key=lambda r: r.lock_share_of_non_idle)
    return Target(name, worst.lock_share_of_non_idle,
                  check(worst.lock_share_of_non_idle < MAX_LOCK_SHARE),
                  f"{worst.num_workers} workers: {worst.lock_samples} lock of "
                  f"{worst.non_idle_samples} non-idle samples, "
                  f"{100 * (worst.lock_share_of_backends or 0):.1f}% of all "
                  f"{worst.backend_samples} backend samples; {worst.client_wait_samples} of its "
                  f"{worst.active_backend_samples} active samples waited on their client")


def contention_target(sweep: Sequence[Any]) -> list[Target]:
    """At the largest worker count: attempts per claim (the old figure, ~1 by construction)
    and the contention it hides, claim statements that lost a wanted shard to another
    worker."""
    if not sweep:
        return []
    top_count = max(r.num_workers for r in sweep)
    top = [r for r in sweep if r.num_workers == top_count]
    found = []
    ratios = [r.attempts_per_claim for r in top if r.attempts_per_claim is not None]
    value = statistics.median(ratios) if ratios else None
    found.append(Target(
        f"attempts per claim <= {MAX_ATTEMPTS_PER_CLAIM} at {top_count} workers (median)", value,
        "not measured" if value is None else check(value <= MAX_ATTEMPTS_PER_CLAIM),
        "" if value is not None else "the workers export no claim counters"))
    counted = [r for r in top if getattr(r, "claim_statements", None)]
    if counted:
        shares = [r.contended_statements / r.claim_statements for r in counted]
        found.append(Target(
            f"claim statements that lost a wanted shard to another worker at {top_count} "
            "workers (median share)", statistics.median(shares), "info",
            "; ".join(f"{r.contended_statements:,.0f} of {r.claim_statements:,.0f} statements, "
                      f"{r.claims_lost:,.0f} shards lost, {r.claims or 0:,.0f} won"
                      for r in counted)))
    else:
        found.append(Target(f"claim contention at {top_count} workers", None, "not measured",
                            "the workers export no contention counters"))
    return found


def kill_target(kill: Sequence[Any]) -> Target:
    name = "a worker SIGKILLed mid-batch: completed, every custom_id exactly once"
    if not kill:
        return Target(name, None, "not measured", "--kill-at 0")
    r = kill[0]
    return Target(name, float(r.exactly_once), check(r.exactly_once and r.killed_workers == 1),
                  f"{r.num_workers} workers, {r.killed_workers} killed, {r.lines_per_s:,.0f} "
                  f"lines/s; {r.missing} missing, {r.duplicated} repeated")


def targets(sweep: Sequence[Any], big: Sequence[Any] = (),
            kill: Sequence[Any] = ()) -> list[Target]:
    runs = [*sweep, *kill, *big]
    found = scaling_targets(sweep) + floor_targets(sweep, big) + contention_target(sweep)
    found.append(lock_target(runs))
    idle = max((r.idle_commits_per_s_per_worker for r in runs), default=None)
    found.append(Target(f"idle commits/s per worker <= {MAX_IDLE_COMMITS_PER_S:.0f} (worst run)",
                        idle, "not measured" if idle is None else check(
                            idle <= MAX_IDLE_COMMITS_PER_S)))
    found += poll_targets(big)
    found.append(kill_target(kill))
    broken = [f"{r.num_workers}#{getattr(r, 'repeat', 1)}" for r in runs if not r.exactly_once]
    found.append(Target("every custom_id exactly once in every run (runs broken)", len(broken),
                        check(not broken), f"broken: {broken}" if broken else ""))
    return found


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


COLUMNS = ("workers", "engine", "run", "lines", "lines/s", "eff", "att/claim", "lost/stmts",
           "lock/non-idle", "lock/all", "samples l/n/a", "idle c/s/w", "PG ms/l", "svc ms/l",
           "fresh poll p50/p95 (n)", "CPU busy", "conns", "once")


def run_row(r: Any) -> list[str]:
    lost = (f"{r.contended_statements:,.0f}/{r.claim_statements:,.0f}"
            if getattr(r, "claim_statements", None) is not None else "n/a")
    return [
        str(r.num_workers), r.engine,
        f"{getattr(r, 'repeat', 1)}{'k' if getattr(r, 'killed_workers', 0) else ''}",
        f"{r.num_lines:,}", f"{r.lines_per_s:,.0f}",
        "n/a" if r.efficiency is None else f"{100 * r.efficiency:.0f}%",
        fmt_num(r.attempts_per_claim, ".2f"), lost,
        _pct(getattr(r, "lock_share_of_non_idle", None)),
        _pct(getattr(r, "lock_share_of_backends", None)),
        f"{getattr(r, 'lock_samples', 0)}/{getattr(r, 'non_idle_samples', 0)}/"
        f"{getattr(r, 'backend_samples', 0)}",
        f"{r.idle_commits_per_s_per_worker:.2f}", f"{r.pg_cpu_ms_per_line:.2f}",
        fmt_num(getattr(r, "service_cpu_ms_per_line", None), ".2f"),
        f"{fmt_num(getattr(r, 'fresh_poll_ms_p50', None), '.1f')}/"
        f"{fmt_num(getattr(r, 'fresh_poll_ms_p95', None), '.1f')} "
        f"({getattr(r, 'num_fresh_polls', 0)})",
        f"{100 * r.machine_cpu_busy:.0f}%", str(r.peak_connections),
        "yes" if r.exactly_once else f"NO ({r.missing} missing, {r.duplicated} repeated)",
    ]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
            for row in rows]


def format_report(sweep: Sequence[Any], big: Sequence[Any], kill: Sequence[Any],
                  found: list[Target]) -> str:
    runs = [*sweep, *kill, *big]
    lines = _table([list(COLUMNS)] + [run_row(r) for r in runs])
    lines += ["", "run: repeat (k: the run with a worker SIGKILLed); eff: lines/s over ideal; "
              "att/claim: shards asked for per shard won; lost/stmts: claim statements that "
              "lost a wanted shard to another worker / claim statements; lock/non-idle, "
              "lock/all: pg_stat_activity samples waiting on a lock over non-idle and over all "
              "backend samples (samples l/n/a: their counts); idle c/s/w: commits/s per idle "
              "worker; PG, svc ms/l: CPU per line of PostgreSQL's backends and of the API and "
              "workers; fresh poll: status GETs from a separate process, a new connection "
              "each, while the batch was in progress (ms).", ""]
    summary = [["workers", "engine", "runs", "lines/s median", "spread (low-high)", "eff",
                "CPU busy"]]
    for s in summarize(sweep) + summarize(big):
        summary.append([str(s.num_workers), s.engine, str(s.num_runs), f"{s.lines_per_s:,.0f}",
                        f"{s.low:,.0f}-{s.high:,.0f} ({100 * s.spread:.0f}%)",
                        "n/a" if s.efficiency is None else f"{100 * s.efficiency:.0f}%",
                        f"{100 * s.machine_cpu_busy:.0f}%"])
    lines += _table(summary)
    lines += ["", "targets (issues 17 and 31):"]
    for t in found:
        value = "n/a" if t.value is None else f"{t.value:.3g}"
        detail = f"  ({t.detail})" if t.detail else ""
        lines.append(f"  [{t.status}] {t.name}: {value}{detail}")
    lines += ["", "what active PostgreSQL backends waited on (share of active samples):"]
    for r in runs:
        lines.append(f"  {r.num_workers} workers, {r.engine}, run {getattr(r, 'repeat', 1)}"
                     f"{', one killed' if getattr(r, 'killed_workers', 0) else ''} "
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
        lines += cli_status_lines(r)
        hot = getattr(r, "line_hot_update_share", None)
        if hot is not None:
            lines.append(f"    request_lines: {100 * hot:.0f}% of row updates HOT; "
                         f"{r.line_heap_bytes_per_line:,.0f} heap + "
                         f"{r.line_index_bytes_per_line:,.0f} index bytes a line, "
                         f"rows {r.line_row_bytes:,.0f} bytes")
    return "\n".join(lines)
