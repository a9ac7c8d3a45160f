"""Scale-out benchmark: the real control plane (``boxcar api``, ``boxcar worker`` processes on
Celery/Redis, PostgreSQL, leases, result writer, finalize, output files) with the engine replaced
by a fake one (``engine.testing.fake_engine``), for N workers at a time.

    python -m bench.scale --workers 8,16,32 --lines 40000 --engine paced --lines-per-s 100 \
        --repeat 3

Each worker count is run ``--repeat`` times, each run on a fresh database (created on the server
of ``--database-url``, dropped after) with its own API, workers, Redis queue namespace and storage
folder. A run measures, in order: PostgreSQL commits/s per worker while every worker is idle
(``--idle-s``, after ``--idle-settle-s``); then one batch of ``--lines`` lines from ``POST
/v1/batches`` to ``completed``: lines/s; pg_stat_activity every 50 ms (lock-wait samples over
every backend sample and over the non-idle ones, with the counts); the database's backend CPU
per line (/proc); the machine's CPU busy share; the status poll as a user sees it, from a
separate client process opening a new connection for every poll while the workers run
(``bench.scale_poller``: median and p95); claim contention (the workers' counters summed on the
API's /metrics: claim statements that lost a wanted shard to another worker, and the shards
lost, beside attempts per claim); and that every custom_id is in the output file exactly once.
Then one more run at ``--kill-at`` workers that SIGKILLs a worker a third of the way in (its
shards come back when their leases run out) and checks the output the same way; then
``--repeat`` ``--big-lines`` batches with the instant engine. ``bench/scale_report.py`` prints
every run, the medians and spreads, and the targets, a missed one as missed.

``BOXCAR_BENCH_CPU_PROFILE=<folder>`` in the environment profiles every worker's threads on their
CPU clocks (``bench/cpu_profile.py``; read with ``python -m bench.cpu_profile <folder>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from api.timing import server_timing_ms
from bench import scale_report
from bench.scale_poller import PollerProcess, TimedPoll, quantile
from bench.scale_probes import (
    PgSampler,
    claim_contention,
    claim_counters,
    commits,
    cpu_busy_share,
    free_connections,
    group_cpu_s,
    machine_cpu_ticks,
    table_stats,
)
from bench.scale_runs import RunConfig, RunResult
from bench.scale_stack import REPO, ScaleStack

LIVE = ("validating", "in_progress", "finalizing")
TERMINAL = ("completed", "failed", "expired", "cancelled")
POLL_INTERVAL_S = 0.25
# A worker's metrics snapshot reaches the database every BOXCAR_WORKER_METRICS_INTERVAL (2 s).
SNAPSHOT_WAIT_S = 3.0


def ok(response: httpx.Response) -> httpx.Response:
    """The response, or an error with the API's own message (e.g. a file over
    BOXCAR_MAX_FILE_LINES)."""
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.method} {response.request.url.path} answered "
                           f"{response.status_code}: {response.text[:500]}")
    return response


def request_lines(num_lines: int) -> bytes:
    lines = (json.dumps({"custom_id": f"L{i:07d}", "method": "POST",
                         "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user",
                                                "content": f"Item {i}: one line of the bench"}],
                                  "max_tokens": 8}})
             for i in range(num_lines))
    return ("\n".join(lines) + "\n").encode()


# Connections one worker process may hold at once (measured on main before issue 17: 4-5 at peak,
# the API 1-3), for the warning below.
CONNECTIONS_PER_WORKER = 5


def run_once(config: RunConfig) -> RunResult:
    free = free_connections(config.database_url)
    if free < CONNECTIONS_PER_WORKER * config.num_workers + 5:
        print(f"warning: the PostgreSQL server has {free} connections free; {config.num_workers} "
              f"workers may hold up to ~{CONNECTIONS_PER_WORKER} each. If they run out, the run "
              "fails or measures a starved service.", file=sys.stderr, flush=True)
    engine_env = {"BOXCAR_BENCH_ENGINE": config.engine}
    if config.engine == "paced":
        engine_env["BOXCAR_BENCH_LINES_PER_S"] = str(config.lines_per_s)
    stack = ScaleStack(server_url=config.database_url, broker_url=config.broker_url,
                       engine_env=engine_env)
    try:
        stack.create_database()
        stack.launch_workers(config.num_workers)  # they start while the API does
        stack.start_api()
        stack.wait_workers()
        with stack.client() as client:
            response = client.post("/v1/files", data={"purpose": "batch"}, files={
                "file": ("bench.jsonl", request_lines(config.num_lines))})
            ok(response)
            file_id = response.json()["id"]
            idle = idle_commits_per_s(stack, config)
            return measure_batch(stack, client, file_id, config, idle)
    finally:
        stack.close()


def idle_commits_per_s(stack: ScaleStack, config: RunConfig) -> float:
    """Commits/s per worker with every worker up and nothing to do, after ``idle_settle_s``
    (an idle worker's polls back off from ``BOXCAR_POLL_INTERVAL`` to the 20 s cap over its
    first ~30 s: the settled figure is what an idle fleet costs) and a second for the upload."""
    time.sleep(1.0 + config.idle_settle_s)
    before, start = commits(config.database_url, stack.name), time.monotonic()
    time.sleep(config.idle_s)
    after, end = commits(config.database_url, stack.name), time.monotonic()
    return (after - before) / (end - start) / config.num_workers


def service_cpu_s(stack: ScaleStack) -> float:
    """CPU seconds the API and the worker processes have used so far (each started in a
    session of its own: its process group)."""
    procs = [p for p in (stack.api, *stack.workers) if p is not None]
    return sum(group_cpu_s(p.pid) for p in procs)


def measure_batch(stack: ScaleStack, client: httpx.Client, file_id: str, config: RunConfig,
                  idle_commits: float) -> RunResult:
    sampler = PgSampler(config.database_url, stack.name).start()
    cpu_before = machine_cpu_ticks()
    service_before = service_cpu_s(stack)
    polls: list[Poll] = []
    pollers: dict[str, PollerProcess] = {}  # by what they poll (``bench.scale_poller``)
    fresh: dict[str, list[TimedPoll]] = {}
    started_run: float | None = None  # when a poll first saw the batch in_progress
    drained: float | None = None  # when a poll first saw every line closed
    start = time.perf_counter()
    try:
        response = client.post("/v1/batches", json={
            "input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})
        ok(response)
        batch = response.json()
        deadline = time.monotonic() + config.timeout_s
        while True:
            poll, batch = poll_batch(client, batch["id"])
            seen = time.perf_counter()
            if batch["status"] in LIVE:
                polls.append(poll)
            if started_run is None and batch["status"] != "validating":
                started_run = seen
            if not pollers and batch["status"] == "in_progress":
                pollers = start_pollers(stack, batch["id"], config)
            counts = batch["request_counts"]
            if drained is None and (batch["status"] in ("finalizing", *TERMINAL) or (
                    counts["total"] and counts["completed"] + counts["failed"] >= counts["total"])):
                drained = seen
            if pollers and drained is not None:  # the workers' part is over: one finalizes
                fresh = {what: poller.stop() for what, poller in pollers.items()}
            if batch["status"] in TERMINAL:
                break
            if (config.kill_one and not stack.killed and batch["status"] == "in_progress"
                    and counts["completed"] >= config.num_lines / 3):
                stack.kill_worker(0)
            stack.check_workers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the batch is still {batch['status']} after "
                                   f"{config.timeout_s:.0f} s: {batch['request_counts']}")
            time.sleep(POLL_INTERVAL_S)
        end = time.perf_counter()
        elapsed = end - start
    finally:
        activity = sampler.stop()
        fresh = {what: poller.stop() for what, poller in pollers.items()}
    cpu_busy = cpu_busy_share(cpu_before, machine_cpu_ticks())
    service_cpu = service_cpu_s(stack) - service_before
    if batch["status"] != "completed":
        raise RuntimeError(f"the batch ended {batch['status']}: {batch.get('errors')}")
    missing, duplicated = check_output(client, batch, config.num_lines)
    time.sleep(SNAPSHOT_WAIT_S)
    response = client.get("/metrics", follow_redirects=True)  # a mounted app: /metrics/
    ok(response)
    counters = claim_counters(response.text)
    contention = claim_contention(response.text)
    lines_table = table_stats(stack.database_url, "request_lines")
    attempts, claims = counters if counters is not None else (None, None)
    lines_per_s = config.num_lines / elapsed
    ideal = (config.num_workers * config.lines_per_s
             if config.engine == "paced" and config.lines_per_s else None)
    # While the workers ran:
    running, listed, api_status, status = (
        [p for p in fresh.get(what, []) if p.status == "in_progress"]
        for what in ("batch", "list", "status", "status_db"))
    client_ms = [p.client_ms for p in running]
    server_ms = [p.server_ms for p in running if p.server_ms is not None]
    connect_ms = [p.connect_ms for p in running]
    list_ms = [p.client_ms for p in listed]
    list_server_ms = [p.server_ms for p in listed if p.server_ms is not None]
    collect_ms = [p.db_ms for p in status if p.db_ms is not None]
    return RunResult(
        num_workers=config.num_workers, num_lines=config.num_lines, engine=config.engine,
        lines_per_s_per_worker=config.lines_per_s if config.engine == "paced" else None,
        lines_per_s=lines_per_s, ideal_lines_per_s=ideal,
        efficiency=lines_per_s / ideal if ideal else None,
        claim_attempts=attempts, claims=claims,
        attempts_per_claim=attempts / claims if attempts is not None and claims else None,
        lock_wait_share=activity.lock_wait_share, active_backend_samples=activity.active,
        idle_commits_per_s_per_worker=idle_commits,
        pg_cpu_ms_per_line=1000 * activity.backend_cpu_s / config.num_lines,
        service_cpu_ms_per_line=1000 * service_cpu / config.num_lines,
        status_poll_ms_median=_median(p.client_ms for p in polls),
        num_status_polls=len(polls), machine_cpu_busy=cpu_busy,
        peak_connections=activity.peak_connections,
        exactly_once=missing == 0 and duplicated == 0, missing=missing, duplicated=duplicated,
        waits=wait_breakdown(activity.waits, activity.active),
        line_hot_update_share=lines_table.hot_share,
        line_heap_bytes_per_line=lines_table.heap_bytes / config.num_lines,
        line_index_bytes_per_line=lines_table.index_bytes / config.num_lines,
        line_row_bytes=lines_table.mean_row_bytes,
        status_poll_server_ms_median=_median(p.server_ms for p in polls),
        status_poll_db_ms_median=_median(p.db_ms for p in polls),
        fresh_poll_ms_p50=quantile(client_ms, 0.5), fresh_poll_ms_p95=quantile(client_ms, 0.95),
        fresh_poll_server_ms_p50=quantile(server_ms, 0.5),
        fresh_poll_server_ms_p95=quantile(server_ms, 0.95), num_fresh_polls=len(running),
        fresh_poll_connect_ms_p50=quantile(connect_ms, 0.5),
        fresh_poll_connect_ms_p95=quantile(connect_ms, 0.95),
        list_poll_ms_p50=quantile(list_ms, 0.5), list_poll_ms_p95=quantile(list_ms, 0.95),
        list_poll_server_ms_p50=quantile(list_server_ms, 0.5),
        list_poll_server_ms_p95=quantile(list_server_ms, 0.95), num_list_polls=len(listed),
        api_status_ms_p50=quantile([p.client_ms for p in api_status], 0.5),
        api_status_ms_p95=quantile([p.client_ms for p in api_status], 0.95),
        api_status_server_ms_p50=quantile(
            [p.server_ms for p in api_status if p.server_ms is not None], 0.5),
        api_status_server_ms_p95=quantile(
            [p.server_ms for p in api_status if p.server_ms is not None], 0.95),
        num_api_status=len(api_status),
        cli_status_ms_p50=quantile([p.client_ms for p in status], 0.5),
        cli_status_ms_p95=quantile([p.client_ms for p in status], 0.95),
        cli_status_collect_ms_p50=quantile(collect_ms, 0.5),
        cli_status_collect_ms_p95=quantile(collect_ms, 0.95), num_cli_status=len(status),
        cli_status_explained=(pollers["status_db"].explained if "status_db" in pollers
                              else None),
        backend_samples=activity.backends, non_idle_samples=activity.non_idle,
        client_wait_samples=activity.client_waits, lock_samples=activity.lock_waits,
        lock_share_of_backends=activity.lock_share_of_backends,
        lock_share_of_non_idle=activity.lock_share_of_non_idle,
        claim_statements=contention.statements if contention else None,
        contended_statements=contention.contended if contention else None,
        claims_lost=contention.lost if contention else None,
        repeat=config.repeat, killed_workers=len(stack.killed),
        num_cpus=os.cpu_count() or 1,
        **phases(start, started_run, drained, end, config.num_lines, ideal),
    )


def start_pollers(stack: ScaleStack, batch_id: str,
                  config: RunConfig) -> dict[str, PollerProcess]:
    """The separate pollers of a batch in progress: its retrieve, the list's first page,
    ``boxcar status --api`` and ``boxcar status``'s database part, as ``config`` asks."""
    intervals = {"batch": config.fresh_poll_interval,
                 "list": config.fresh_poll_interval if config.list_limit else 0.0,
                 "status": config.fresh_poll_interval,
                 "status_db": config.cli_status_interval}
    return {what: PollerProcess(base_url=stack.base_url, api_key=stack.api_key,
                                batch_id=batch_id, interval=interval, cwd=REPO, env=stack.env,
                                what=what, list_limit=config.list_limit or 20)
            for what, interval in intervals.items() if interval > 0}


def phases(start: float, started_run: float | None, drained: float | None, end: float,
           num_lines: int, ideal: float | None) -> dict[str, float | None]:
    """Prepare, run and finalize seconds from the poll times; the run's lines/s and efficiency.
    One-worker stages (prepare, finalize) do not scale with workers: the end-to-end lines/s
    includes them, the run's does not."""
    if started_run is None or drained is None or drained <= started_run:
        return {}
    run_s = drained - started_run
    return {"prepare_s": started_run - start, "run_s": run_s, "finalize_s": end - drained,
            "run_lines_per_s": num_lines / run_s,
            "run_efficiency": num_lines / run_s / ideal if ideal else None}


@dataclass(frozen=True)
class Poll:
    client_ms: float  # the client's, from the request sent to the body read
    server_ms: float | None  # the API's own (Server-Timing ``app``)
    db_ms: float | None  # of which in its database statements (Server-Timing ``db``)


def _median(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def poll_batch(client: httpx.Client, batch_id: str) -> tuple[Poll, dict[str, Any]]:
    start = time.perf_counter()
    response = client.get(f"/v1/batches/{batch_id}")
    took = time.perf_counter() - start
    ok(response)
    header = response.headers.get("server-timing")
    return Poll(1000 * took, server_timing_ms(header), server_timing_ms(header, "db")), \
        response.json()


# Waits below this share of active samples are left out of a run's breakdown.
MIN_WAIT_SHARE = 0.002


def wait_breakdown(waits: Counter[tuple[str, str, str]], active: int) -> list[dict[str, Any]]:
    return [{"type": wait_type, "event": event, "statement": statement,
             "samples": n, "share": n / active}
            for (wait_type, event, statement), n in waits.most_common()
            if active and n / active >= MIN_WAIT_SHARE]


def check_output(client: httpx.Client, batch: dict, num_lines: int) -> tuple[int, int]:
    """(custom_ids missing from the output file, custom_ids in it more than once)."""
    seen: Counter[str] = Counter()
    if batch.get("output_file_id"):
        response = client.get(f"/v1/files/{batch['output_file_id']}/content")
        ok(response)
        seen.update(json.loads(line)["custom_id"] for line in response.text.splitlines()
                    if line.strip())
    expected = {f"L{i:07d}" for i in range(num_lines)}
    missing = len(expected - set(seen))
    duplicated = sum(1 for n in seen.values() if n > 1) + len(set(seen) - expected)
    return missing, duplicated


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--workers takes worker counts separated by commas (e.g. 8,16,32), got {text!r}"
        ) from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--workers counts must be >= 1, got {text!r}")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=worker_counts, default=[8, 16, 32],
                        help="worker counts, --repeat runs each (default 8,16,32)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each worker count and of the big batch, interleaved "
                             "(8,16,32,8,16,32,...); figures are their median and spread "
                             "(default 3)")
    parser.add_argument("--kill-at", type=int, default=None,
                        help="workers of one more run that SIGKILLs a worker a third of the "
                             "way in and checks the output exactly once (default: the largest "
                             "--workers count; 0: no such run)")
    parser.add_argument("--poll-interval", type=float, default=0.1,
                        help="seconds between the separate poller's status polls, each on a "
                             "new connection, while a batch is in progress (default 0.1; "
                             "0: no poller)")
    parser.add_argument("--list-limit", type=int, default=20,
                        help="a second poller asks the list's first page of this size the same "
                             "way (default 20; 0: no list poller)")
    parser.add_argument("--status-interval", type=float, default=0.5,
                        help="seconds between a third poller's runs of `boxcar status`'s "
                             "database part (default 0.5; 0: none)")
    parser.add_argument("--lines", type=int, default=20000,
                        help="lines in each run's batch (default 20000)")
    parser.add_argument("--engine", choices=("instant", "paced"), default="paced")
    parser.add_argument("--lines-per-s", type=float, default=None,
                        help="the paced engine's pace per worker (default 100)")
    parser.add_argument("--big-lines", type=int, default=50000,
                        help="lines of the instant-engine batch measured last for the "
                             "status-poll and throughput targets (default 50000; 0: skip)")
    parser.add_argument("--big-workers", type=int, default=4,
                        help="workers for that batch (default 4)")
    parser.add_argument("--idle-s", type=float, default=20.0,
                        help="seconds of idle workers to count commits over (default 20: one "
                             "period of the idle polls at their cap)")
    parser.add_argument("--idle-settle-s", type=float, default=30.0,
                        help="seconds to wait after the workers are up before counting idle "
                             "commits: their polls' back-off reaches its cap (default 30)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one batch may take before the run fails (default 900)")
    parser.add_argument("--database-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test",
                        help="a database on the PostgreSQL server to use; each run creates and "
                             "drops its own database there")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    if args.engine == "instant" and args.lines_per_s is not None:
        parser.error("--lines-per-s is the paced engine's pace: give it with --engine paced")
    if args.lines_per_s is None and args.engine == "paced":
        args.lines_per_s = 100.0
    if args.lines_per_s is not None and args.lines_per_s <= 0:
        parser.error(f"--lines-per-s must be > 0, got {args.lines_per_s}")
    if args.lines < 1:
        parser.error(f"--lines must be >= 1, got {args.lines}")
    if args.big_lines < 0 or args.big_workers < 1:
        parser.error("--big-lines must be >= 0 and --big-workers >= 1, got "
                     f"{args.big_lines} and {args.big_workers}")
    if args.idle_s <= 0 or args.timeout <= 0:
        parser.error(f"--idle-s and --timeout must be > 0, got {args.idle_s} and {args.timeout}")
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.kill_at is None:
        args.kill_at = max(args.workers)
    if args.kill_at < 0 or args.kill_at == 1:
        parser.error(f"--kill-at needs >= 2 workers (one to kill, one to take over) or 0, "
                     f"got {args.kill_at}")
    if args.poll_interval < 0:
        parser.error(f"--poll-interval must be >= 0, got {args.poll_interval}")
    if not 0 <= args.list_limit <= 100 or args.status_interval < 0:
        parser.error(f"--list-limit must be 0-100 and --status-interval >= 0, got "
                     f"{args.list_limit} and {args.status_interval}")
    if args.idle_settle_s < 0:
        parser.error(f"--idle-settle-s must be >= 0, got {args.idle_settle_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common = dict(idle_s=args.idle_s, timeout_s=args.timeout, database_url=args.database_url,
                  broker_url=args.broker_url, idle_settle_s=args.idle_settle_s,
                  fresh_poll_interval=args.poll_interval, list_limit=args.list_limit,
                  cli_status_interval=args.status_interval)
    # Interleaved, so a spell of load from elsewhere on the machine falls on every count.
    sweep = [RunConfig(n, args.lines, args.engine, args.lines_per_s, repeat=r, **common)
             for r in range(1, args.repeat + 1) for n in args.workers]
    kill = [RunConfig(args.kill_at, args.lines, args.engine, args.lines_per_s, kill_one=True,
                      **common)] if args.kill_at else []
    big = [RunConfig(args.big_workers, args.big_lines, "instant", None, repeat=r, **common)
           for r in range(1, args.repeat + 1)] if args.big_lines else []
    results: dict[str, list[RunResult]] = {"sweep": [], "kill": [], "big": []}
    for part, configs in (("sweep", sweep), ("kill", kill), ("big", big)):
        for config in configs:
            if not args.json:
                print(f"{time.strftime('%H:%M:%S')} running {config.num_workers} workers, "
                      f"{config.engine} engine, {config.num_lines:,} lines"
                      f"{', one SIGKILLed' if config.kill_one else ''} (load average "
                      f"{os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
            results[part].append(run_once(config))
    targets = scale_report.targets(results["sweep"], results["big"], results["kill"])
    if args.json:
        print(json.dumps({part: [asdict(r) for r in runs] for part, runs in results.items()}
                         | {"targets": [asdict(t) for t in targets]}, indent=2))
    else:
        print(scale_report.format_report(results["sweep"], results["big"], results["kill"],
                                         targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
