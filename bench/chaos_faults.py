"""The chaos run's faults: a schedule drawn from ``random.Random(seed)`` before the run starts
(so a seed replays the same faults in the same order, whatever the timing), and the injector
that applies it, one fault at a time, to a ``PrivateStack`` (tests/system/stack.py)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

KINDS = ("worker_sigkill", "worker_sigstop", "api_sigkill", "postgres_restart",
         "redis_restart", "s3_away", "db_delay", "db_stall")
# How long each kind keeps its part away, in seconds (min, max): a killed worker or API is
# started again at once, so its outage is its start-up. db_delay slows the database link
# (bench/chaos_proxy.py: each chunk held DB_DELAY_S) for its outage; db_stall holds it still.
OUTAGE_S = {"worker_sigkill": (0.0, 0.0), "worker_sigstop": (2.0, 8.0),
            "api_sigkill": (0.0, 0.0), "postgres_restart": (1.0, 5.0),
            "redis_restart": (1.0, 5.0), "s3_away": (5.0, 30.0),
            "db_delay": (5.0, 20.0), "db_stall": (1.0, 5.0)}
DB_DELAY_S = (0.05, 0.5)  # per chunk, each way
# The part a fault of each kind hits (workers and APIs: one drawn from the run's).
TARGETS = {"postgres_restart": "postgres", "redis_restart": "redis", "s3_away": "s3",
           "db_delay": "db_link", "db_stall": "db_link"}


@dataclass(frozen=True)
class Fault:
    at_s: float  # from the run's start
    kind: str
    target: str  # a worker's name, or the part
    outage_s: float


def schedule(seed: int, *, run_s: float, mean_gap_s: float, workers: tuple[str, ...],
             max_outage_s: float, apis: tuple[str, ...] = ("api",)) -> list[Fault]:
    """Faults from 5 s into the run until its end, ``mean_gap_s`` apart on average; every kind
    at least once when the run is long enough. Outages are capped at ``max_outage_s`` (short
    runs)."""
    if mean_gap_s <= 0 or run_s <= 0:
        raise ValueError(f"run_s and mean_gap_s must be > 0, got {run_s} and {mean_gap_s}")
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = 5.0
    kinds = list(KINDS)
    rng.shuffle(kinds)  # the first len(KINDS) faults cover every kind, in a seeded order
    while at < run_s:
        kind = kinds[len(faults)] if len(faults) < len(kinds) else rng.choice(KINDS)
        low, high = OUTAGE_S[kind]
        outage = min(rng.uniform(low, high), max(low, max_outage_s))
        target = (rng.choice(workers) if kind.startswith("worker")
                  else rng.choice(apis) if kind == "api_sigkill" else TARGETS[kind])
        faults.append(Fault(round(at, 1), kind, target, round(outage, 1)))
        at += outage + rng.uniform(0.5 * mean_gap_s, 1.5 * mean_gap_s)
    return faults


class Injector:
    """Applies a schedule in a thread; every part is back when a fault ends (a killed process
    started again, a stopped one continued, a server restarted, the database link clear).
    APIs are named ``api``, ``api2``, ... (the stack's first, second, ...)."""

    def __init__(self, stack, faults: list[Fault], started: float, *, proxy=None) -> None:
        self.stack, self.faults, self.started = stack, faults, started
        self.proxy = proxy  # a bench.chaos_proxy.DelayProxy the services reach PostgreSQL by
        self.injected: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Injector:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No new fault; waits for the current one to end."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for fault in self.faults:
            if self._stop.wait(max(0.0, self.started + fault.at_s - time.monotonic())):
                return
            try:
                self.apply(fault)
                self.injected[fault.kind] += 1
            except Exception as exc:  # a part that will not come back is a finding, not a crash
                self.errors.append(f"{fault}: {type(exc).__name__}: {exc}")
            print(f"[chaos] {time.monotonic() - self.started:6.1f}s {fault.kind} "
                  f"{fault.target} {fault.outage_s}s", flush=True)

    def apply(self, fault: Fault) -> None:
        stack = self.stack
        if fault.kind == "worker_sigkill":
            stack.kill_worker(fault.target)
            stack.restart_worker(fault.target)
        elif fault.kind == "worker_sigstop":
            pid = stack.workers[fault.target].pid
            os.killpg(pid, signal.SIGSTOP)
            try:
                time.sleep(fault.outage_s)
            finally:
                os.killpg(pid, signal.SIGCONT)
        elif fault.kind == "api_sigkill":
            index = int(fault.target.removeprefix("api") or 1) - 1
            stack.kill_api(index)
            stack.start_api(index)
        elif fault.kind == "postgres_restart":
            # A clean stop: the private server runs with synchronous_commit=off, so a crash
            # (``immediate``) loses commits it had acknowledged, which no service survives.
            stack.pg.stop("fast")
            time.sleep(fault.outage_s)
            stack.pg.start()
        elif fault.kind == "redis_restart":
            stack.redis.stop()
            time.sleep(fault.outage_s)
            stack.redis.start()
        elif fault.kind == "s3_away":
            stack.weed.stop()
            time.sleep(fault.outage_s)
            stack.weed.start()
        elif fault.kind in ("db_delay", "db_stall"):
            if self.proxy is None:
                raise ValueError(f"{fault.kind} needs the database proxy")
            if fault.kind == "db_delay":
                self.proxy.delay(*DB_DELAY_S)
            else:
                self.proxy.stall(fault.outage_s)
            try:
                time.sleep(fault.outage_s)
            finally:
                self.proxy.clear()
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
