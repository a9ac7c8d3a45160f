"""A seeded chaos run with an auditor (issue 50, part 1):

    python -m bench.chaos --seed 7 --minutes 2

starts the production stack on private servers (tests/system/stack.py: PostgreSQL, Redis,
SeaweedFS S3, two ``boxcar api`` processes, three ``boxcar worker`` processes of a generating
model with a LoRA adapter and one of an embedding model, all on the paced fake engine of
``bench.scale_worker``; the services reach PostgreSQL through the bench's proxy,
bench/chaos_proxy.py), has three tenants (two with enqueued-token quotas) submit batches and
single jobs of every generating and embedding endpoint (bench/chaos_workload.py; jobs' webhooks
go to the bench's receiver, bench/chaos_webhooks.py) while a schedule drawn from
``random.Random(seed)`` (bench/chaos_faults.py) SIGKILLs and SIGSTOPs workers, SIGKILLs one API
at a time, restarts PostgreSQL and Redis, takes S3 away and slows or stalls the database link.
Then every part is healed, the work drains, and the auditors check every batch and tenant
(bench/chaos_audit.py), every job and webhook (bench/chaos_deliveries.py) and every expired
file's bytes in the bucket (bench/chaos_expiry.py). Prints one table and exits 1 on any
violation, with the seed to replay.

No fault fills a local disk: the production stack keeps every file in S3, and the only local
folder a process writes is a worker's LoRA cache, filled once at its start (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from bench import chaos_expiry
from bench.chaos_audit import Audit, StatusWatch, audit, batch_rows
from bench.chaos_deliveries import JOB_TERMINAL, audit_jobs, audit_webhooks, job_rows
from bench.chaos_faults import KINDS, Fault, Injector, schedule
from bench.chaos_proxy import DelayProxy
from bench.chaos_webhooks import WebhookReceiver
from bench.chaos_workload import ADAPTER, EMBEDDER, Workload

WORKERS = ("w1", "w2", "w3")  # the generating model's
EMBED_WORKER = "e1"
APIS = ("api", "api2")
# name -> its key's max_enqueued_tokens (None: no quota). A batch of 120 lines holds about
# 120 * (prompt + max_tokens) ~ 4,000 tokens; the quotas let a tenant hold a few at once.
TENANTS = {"tenant-a": 12_000, "tenant-b": 5_000, "tenant-c": None}
# Its batches' final events also go to a webhook endpoint (the jobs of all three carry a url).
ENDPOINT_TENANT = "tenant-c"
BATCH_FINAL_EVENTS = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
LINES_PER_S = 20  # per worker, paced like a GPU: about twice what the workload submits
# How long a run with ``every_kind`` may go past its window for the last kinds of fault.
EVERY_KIND_OVERTIME_S = 180.0
DRAIN_S = 180.0
AGE_EVERY_S = 10.0  # how often unused uploads are aged during the run
# Webhook retries a few seconds apart (the default waits minutes), so a delivery a fault
# broke is retried within the drain.
RETRY_DELAYS = [1, 2, 4, 8, 8, 8, 8, 8]


def drain(database_url: str, timeout_s: float) -> float:
    """Seconds until every batch and job is in a final status and no webhook delivery is
    pending (or ``timeout_s``)."""
    from service.models import BATCH_TERMINAL, DELIVERY_PENDING

    started = time.monotonic()
    engine = create_engine(database_url)
    try:
        while time.monotonic() - started < timeout_s:
            with engine.connect() as conn:
                pending = conn.scalar(text(
                    "SELECT count(*) FROM webhook_deliveries WHERE status = :pending"),
                    {"pending": DELIVERY_PENDING})
            if (not pending
                    and all(status in BATCH_TERMINAL for _, status, _ in batch_rows(database_url))
                    and all(status in JOB_TERMINAL for _, status, _, _ in job_rows(database_url))):
                break
            time.sleep(1.0)
    finally:
        engine.dispose()
    return time.monotonic() - started


class Ager:
    """Ages the workload's unused uploads every ``AGE_EVERY_S`` during the run, so their
    deletes meet the faults (bench/chaos_expiry.py)."""

    def __init__(self, database_url: str, workload: Workload) -> None:
        self.database_url, self.workload = database_url, workload
        self.aged: list[tuple[str, str, str]] = []
        self._done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Ager:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(AGE_EVERY_S):
            file_ids = self.workload.unused_files[self._done:]
            try:
                self.aged += chaos_expiry.age(self.database_url, file_ids)
                self._done += len(file_ids)
            except Exception:  # the database is away: a fault of the run; next time
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.aged += chaos_expiry.age(self.database_url, self.workload.unused_files[self._done:])


def render(seed: int, minutes: float, faults: list[Fault], injector: Injector,
           workload: Workload, result: Audit, figures: dict[str, float]) -> str:
    rows = [("fault", "scheduled", "injected")]
    kinds = Counter(f.kind for f in faults)
    rows += [(kind, str(kinds[kind]), str(injector.injected[kind])) for kind in sorted(kinds)]
    rows += [("", "", ""), ("invariant", "checked", "violations")]
    broken = Counter(name for name, _, _ in result.violations)
    rows += [(name, str(n), str(broken[name])) for name, n in sorted(result.checked.items())]
    rows += [("", "", ""), ("workload", "count", "")]
    rows += [(name, str(n), "") for name, n in sorted(workload.counts.items())]
    rows += [(f"final: {status}", str(n), "") for status, n in sorted(result.outcomes.items())]
    rows += [(name, f"{value:.1f}" if isinstance(value, float) else str(value), "")
             for name, value in figures.items()]
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
        drain_timeout_s: float = DRAIN_S, every_kind: bool = False) -> ChaosRun:
    """One chaos run: the audit, the faults injected and the table. ``every_kind``: the
    window stretches (up to ``EVERY_KIND_OVERTIME_S``) until every kind of fault has been
    injected once (the schedule puts one of each first), so a short run on a slow machine still
    covers them all."""
    from service.keys import create_key
    from service.storage import S3Storage, put_bytes
    from tests.conftest import make_checkpoint
    from tests.system.conftest import ENGINE_OPTIONS
    from tests.system.stack import PrivateStack

    run_s = minutes * 60
    faults = schedule(seed, run_s=run_s, mean_gap_s=mean_gap_s,
                      workers=(*WORKERS, EMBED_WORKER), apis=APIS, max_outage_s=max_outage_s)
    model_root = tempfile.mkdtemp(prefix="boxcar-chaos-model-")
    model = str(make_checkpoint(Path(model_root), "llama"))
    embedder = Path(model_root) / EMBEDDER
    embedder.mkdir()
    receiver = WebhookReceiver().start()
    proxy = DelayProxy(seed=seed)
    stack = PrivateStack(model, worker_module="bench.scale_worker", num_apis=len(APIS),
                         database_proxy=proxy, extra_env={
                             "BOXCAR_BENCH_ENGINE": "paced",
                             "BOXCAR_BENCH_LINES_PER_S": str(LINES_PER_S),
                             "BOXCAR_MODELS": json.dumps([model, str(embedder)]),
                             # The adapter as a user registers it: a key in the deployment's
                             # storage, named in the API's and the workers' engine options.
                             "BOXCAR_ENGINE_OPTIONS": json.dumps({
                                 **ENGINE_OPTIONS,
                                 "lora_modules": [f"{ADAPTER}=adapters/{ADAPTER}"]}),
                             "BOXCAR_LORA_CACHE": str(Path(model_root) / "lora-cache"),
                             "BOXCAR_WEBHOOK_ALLOW_PRIVATE": "true",
                             "BOXCAR_WEBHOOK_RETRY_DELAYS": json.dumps(RETRY_DELAYS)})
    try:
        stack.start()
        storage = S3Storage(stack.bucket, "boxcar", client=stack.weed.server.client())
        for name, data in adapter_files().items():
            put_bytes(storage, f"adapters/{ADAPTER}/{name}", data)
        from service.db import Database

        db = Database(stack.pg.url)
        with db.session() as session:
            keys = {name: create_key(session, tenant_name=name, max_enqueued_tokens=limit).key
                    for name, limit in TENANTS.items()}
        db.dispose()
        subscribe(stack.base_url, keys, receiver)
        keys["acme"] = stack.api_key  # the stack's own tenant (no batches of its own)
        stack.start_workers({**dict.fromkeys(WORKERS), EMBED_WORKER: {
            "BOXCAR_MODEL": str(embedder), "BOXCAR_BENCH_EMBEDDING": "1",
            "BOXCAR_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS)}})
        watch = StatusWatch(stack.pg.url)
        workload = Workload(stack.base_urls, {t: keys[t] for t in TENANTS},
                            random.Random(f"{seed}-workload"),
                            {t: receiver.url_for(t) for t in TENANTS})
        started = time.monotonic()
        injector = Injector(stack, faults, started, proxy=proxy).start()
        workload.start()
        ager = Ager(stack.pg.url, workload).start()
        time.sleep(max(0.0, started + run_s - time.monotonic()))
        if every_kind:  # a loaded machine restarts slowly and pushes the last kinds past the end
            overtime = time.monotonic() + EVERY_KIND_OVERTIME_S
            while set(injector.injected) < set(KINDS) and time.monotonic() < overtime:
                time.sleep(0.5)
        workload.stop()
        injector.stop()
        stack.heal((*WORKERS, EMBED_WORKER))
        ager.stop()
        drain_s = drain(stack.pg.url, drain_timeout_s)
        time.sleep(1.0)  # the watch's last look at the final statuses
        watch.stop()
        result = audit(base_url=stack.base_url, database_url=stack.pg.url, keys=keys,
                       cancel_requested=workload.cancel_requested, watch=watch)
        clients = {name: httpx.Client(base_url=stack.base_url, timeout=60,
                                      headers={"Authorization": f"Bearer {key}"})
                   for name, key in keys.items()}
        try:
            audit_jobs(result, clients, stack.pg.url)
            audit_webhooks(result, receiver, stack.pg.url, endpoint_tenants={ENDPOINT_TENANT})
            # The batches are audited (their files read): now their short-lived files expire.
            aged = ager.aged + chaos_expiry.age(
                stack.pg.url, chaos_expiry.finished_batch_files(stack.pg.url))
            cleanup_s = chaos_expiry.wait_deleted(stack.pg.url, [a[0] for a in aged], 60.0)
            chaos_expiry.audit_expired(result, aged, s3_client=stack.weed.server.client(),
                                       bucket=stack.bucket, prefix="boxcar", clients=clients)
        finally:
            for client in clients.values():
                client.close()
        return ChaosRun(result, injector.injected,
                        render(seed, minutes, faults, injector, workload, result,
                               {"drain (s)": drain_s, "expired files": len(aged),
                                "cleanup (s)": cleanup_s}))
    finally:
        stack.close()
        receiver.close()
        shutil.rmtree(model_root, ignore_errors=True)


def subscribe(base_url: str, keys: dict[str, str], receiver: WebhookReceiver) -> None:
    """Each tenant's webhook secret to the receiver, as a customer's receiver is given it; the
    endpoint tenant's batch events also to its endpoint."""
    for tenant, key in keys.items():
        with httpx.Client(base_url=base_url, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            response = client.get("/v1/tenant")
            response.raise_for_status()
            receiver.add_secret(tenant, response.json()["webhook_secret"])
            if tenant == ENDPOINT_TENANT:
                response = client.post("/v1/webhook_endpoints", json={
                    "url": receiver.url_for(tenant), "events": BATCH_FINAL_EVENTS})
                response.raise_for_status()
                receiver.add_secret(tenant, response.json()["secret"])


def adapter_files() -> dict[str, bytes]:
    """A PEFT LoRA adapter's two files (rank 2 on the first q_proj), in the layout
    ``save_pretrained`` writes; the fake engine checks only that the config is there."""
    import torch
    from safetensors.torch import save

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
              "base_model_name_or_path": "llama", "bias": "none", "task_type": "CAUSAL_LM"}
    weights = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.zeros(2, 64),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.zeros(64, 2)}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": save(weights)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="the schedule's seed (default: drawn, and printed)")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--mean-gap", type=float, default=8.0,
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
