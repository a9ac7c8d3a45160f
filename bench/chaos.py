"""A seeded chaos run with an auditor (issue 50, part 1):

    python -m bench.chaos --seed 7 --minutes 2

starts the production stack on private servers (tests/system/stack.py: PostgreSQL, Redis,
SeaweedFS S3, ``boxcar api``, three ``boxcar worker`` processes on the paced fake engine of
``bench.scale_worker``), has three tenants (two with enqueued-token quotas) submit batches of
chat and completions lines (some cancelled, some with a 4 s window so they expire) while a
schedule drawn from ``random.Random(seed)`` (bench/chaos_faults.py) SIGKILLs and SIGSTOPs
workers, SIGKILLs the API, restarts PostgreSQL and Redis and takes S3 away. Then every part is
healed, the batches drain, and the auditor (bench/chaos_audit.py) checks every batch and
tenant. Prints one table and exits 1 on any violation, with the seed to replay.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chaos_audit import Audit, StatusWatch, audit, batch_rows
from bench.chaos_faults import Fault, Injector, schedule

WORKERS = ("w1", "w2", "w3")
# name -> its key's max_enqueued_tokens (None: no quota). A batch of 120 lines holds about
# 120 * (prompt + max_tokens) ~ 4,000 tokens; the quotas let a tenant hold a few at once.
TENANTS = {"tenant-a": 12_000, "tenant-b": 5_000, "tenant-c": None}
LINES_PER_S = 20  # per worker, paced like a GPU: about twice what the workload submits
DRAIN_S = 180.0


@dataclass
class Workload:
    """Submits batches in a thread until stopped; what it asked for, and what it was told."""

    base_url: str
    keys: dict[str, str]
    rng: random.Random
    counts: Counter[str] = field(default_factory=Counter)
    cancel_requested: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _cancels: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for thread in self._cancels:
            thread.join()

    def _run(self) -> None:
        number = 0
        while not self._stop.wait(self.rng.uniform(1.0, 3.0)):
            number += 1
            tenant = self.rng.choice(sorted(self.keys))
            endpoint = self.rng.choice(("/v1/chat/completions", "/v1/completions"))
            window = "4s" if self.rng.random() < 0.1 else "24h"
            # A 4 s batch is made too big to finish in time, so it expires.
            num_lines = self.rng.randint(150, 300) if window == "4s" else self.rng.randint(10, 120)
            cancel_after = self.rng.uniform(0.5, 6.0) if self.rng.random() < 0.15 else None
            try:
                self._submit(tenant, f"b{number}", endpoint, num_lines, window, cancel_after)
            except httpx.HTTPError as exc:  # the API or a server behind it is away
                self.counts[f"submit failed ({type(exc).__name__})"] += 1

    def _client(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=10,
                            headers={"Authorization": f"Bearer {self.keys[tenant]}"})

    def _submit(self, tenant: str, tag: str, endpoint: str, num_lines: int, window: str,
                cancel_after: float | None) -> None:
        from tests.conftest_services import chat_line, completion_line, jsonl

        make = chat_line if endpoint == "/v1/chat/completions" else completion_line
        lines = [make(f"{tag}-{i:04d}", f"line {i} of {tag} for {tenant}", max_tokens=16)
                 for i in range(num_lines)]
        with self._client(tenant) as client:
            response = client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": (f"{tag}.jsonl", jsonl(lines))})
            if response.status_code != 200:
                self.counts[f"upload refused ({response.status_code})"] += 1
                return
            response = client.post("/v1/batches", json={
                "input_file_id": response.json()["id"], "endpoint": endpoint,
                "completion_window": window})
        if response.status_code == 429:
            self.counts["batch refused by quota (429)"] += 1
            return
        if response.status_code != 200:
            self.counts[f"batch refused ({response.status_code})"] += 1
            return
        self.counts["batches created"] += 1
        if cancel_after is not None:
            thread = threading.Thread(target=self._cancel, daemon=True,
                                      args=(tenant, response.json()["id"], cancel_after))
            self._cancels.append(thread)
            thread.start()

    def _cancel(self, tenant: str, batch_id: str, after_s: float) -> None:
        time.sleep(after_s)
        # Recorded first: a cancel whose answer is lost to a fault may still have been made.
        self.cancel_requested.add(batch_id)
        with self._client(tenant) as client:
            for _ in range(10):
                try:
                    response = client.post(f"/v1/batches/{batch_id}/cancel")
                    if response.status_code in (200, 409):  # 409: it had finished
                        self.counts[f"cancel answered {response.status_code}"] += 1
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        self.counts["cancel never answered"] += 1


def drain(database_url: str, timeout_s: float) -> float:
    """Seconds until every batch is in a final status (or ``timeout_s``)."""
    from service.models import BATCH_TERMINAL

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(status in BATCH_TERMINAL for _, status, _ in batch_rows(database_url)):
            break
        time.sleep(1.0)
    return time.monotonic() - started


def render(seed: int, minutes: float, faults: list[Fault], injector: Injector,
           workload: Workload, result: Audit, drain_s: float) -> str:
    rows = [("fault", "scheduled", "injected")]
    kinds = Counter(f.kind for f in faults)
    rows += [(kind, str(kinds[kind]), str(injector.injected[kind])) for kind in sorted(kinds)]
    rows += [("", "", ""), ("invariant", "checked", "violations")]
    broken = Counter(name for name, _, _ in result.violations)
    rows += [(name, str(n), str(broken[name])) for name, n in sorted(result.checked.items())]
    rows += [("", "", ""), ("workload", "count", "")]
    rows += [(name, str(n), "") for name, n in sorted(workload.counts.items())]
    rows += [(f"batches {status}", str(n), "") for status, n in sorted(result.outcomes.items())]
    rows += [("drain (s)", f"{drain_s:.1f}", "")]
    width = max(len(r[0]) for r in rows)
    lines = [f"chaos run: seed {seed}, {minutes:g} min, {sum(injector.injected.values())} "
             f"faults, {len(result.violations)} violations"]
    lines += [f"  {a:<{width}}  {b:>9}  {c:>10}" for a, b, c in rows]
    for name, subject, what in result.violations[:50]:
        lines.append(f"VIOLATION {name}: {subject}: {what}")
    for error in injector.errors:
        lines.append(f"FAULT ERROR {error}")
    return "\n".join(lines)


@dataclass
class ChaosRun:
    audit: Audit
    injected: Counter[str]  # faults by kind
    table: str


def run(seed: int, minutes: float, *, mean_gap_s: float, max_outage_s: float,
        drain_timeout_s: float = DRAIN_S) -> ChaosRun:
    """One chaos run: the audit, the faults injected and the table."""
    from service.keys import create_key
    from tests.conftest import make_checkpoint
    from tests.system.stack import PrivateStack

    run_s = minutes * 60
    faults = schedule(seed, run_s=run_s, mean_gap_s=mean_gap_s, workers=WORKERS,
                      max_outage_s=max_outage_s)
    model_root = tempfile.mkdtemp(prefix="boxcar-chaos-model-")
    stack = PrivateStack(str(make_checkpoint(Path(model_root), "llama")),
                         worker_module="bench.scale_worker",
                         extra_env={"BOXCAR_BENCH_ENGINE": "paced",
                                    "BOXCAR_BENCH_LINES_PER_S": str(LINES_PER_S)})
    try:
        stack.start()
        from service.db import Database

        db = Database(stack.pg.url)
        with db.session() as session:
            keys = {name: create_key(session, tenant_name=name, max_enqueued_tokens=limit).key
                    for name, limit in TENANTS.items()}
        db.dispose()
        keys["acme"] = stack.api_key  # the stack's own tenant (no batches of its own)
        for name in WORKERS:
            stack.start_worker(name)
        watch = StatusWatch(stack.pg.url)
        workload = Workload(stack.base_url, {t: keys[t] for t in TENANTS},
                            random.Random(f"{seed}-workload"))
        started = time.monotonic()
        injector = Injector(stack, faults, started).start()
        workload.start()
        time.sleep(max(0.0, started + run_s - time.monotonic()))
        workload.stop()
        injector.stop()
        stack.heal(WORKERS)
        drain_s = drain(stack.pg.url, drain_timeout_s)
        time.sleep(1.0)  # the watch's last look at the final statuses
        watch.stop()
        result = audit(base_url=stack.base_url, database_url=stack.pg.url, keys=keys,
                       cancel_requested=workload.cancel_requested, watch=watch)
        return ChaosRun(result, injector.injected,
                        render(seed, minutes, faults, injector, workload, result, drain_s))
    finally:
        stack.close()
        shutil.rmtree(model_root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="the schedule's seed (default: drawn, and printed)")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--mean-gap", type=float, default=12.0,
                        help="mean seconds between one fault's end and the next")
    parser.add_argument("--max-outage", type=float, default=None,
                        help="cap on a fault's outage in s (default: 8 for runs under 10 "
                             "minutes, else 30)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    max_outage = args.max_outage or (8.0 if args.minutes < 10 else 30.0)
    chaos = run(seed, args.minutes, mean_gap_s=args.mean_gap, max_outage_s=max_outage)
    print(chaos.table)
    if chaos.audit.violations:
        print(f"FAILED: {len(chaos.audit.violations)} violations; replay with "
              f"python -m bench.chaos --seed {seed} --minutes {args.minutes:g}")
        return 1
    print(f"OK: 0 violations (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
