"""Queue discipline through the embedded service on the default model: a single job under a
bulk batch, and the batch's estimated completion.

    python -m bench.queue_discipline [--bulk 150] [--rounds 1] [--urgent-bulk-tokens 64]
    python -m bench.queue_discipline --eta-only   # step 3 alone: the estimate's errors
    python -m bench.queue_discipline --eta-only --bulk 30 --skip-queued --trace   # a short batch
    python -m bench.queue_discipline --eta-only --rounds 0 --skip-queued --bulk 40 --behind 3

One embedded service (REST, worker, SQLite, the real engine). Seeded chat workloads: ``--bulk``
lines of 20-80 words, 16-64 greedy output tokens with EOS ignored (each batch its own seed, so
no batch reuses another's prefixes); the job is a 60-word chat prompt with 32 output tokens.

1. The job alone (median of three, each submitted to an idle service, timed from the POST to
   the poll that sees it completed; polls every 50 ms).
2. ``bulk alone`` and ``bulk + job`` interleaved round by round: the batch's throughput (output
   tokens over the time from its POST to the poll that sees it completed) and, in ``bulk +
   job``, the latency of a job posted once a third of the batch's lines are done. Targets: the
   job within ``max(3 x solo, solo + 4 s)``; the batch's throughput down <= 5%.
3. The estimate (``estimated_completion_at``) of a batch read when 25%, 50% and 75% of its
   lines are done, against when it actually completed: for ``bulk alone`` and for a batch
   queued behind another of the same size (submitted a moment after it). The error is given
   against the time that was left at the reading (the strict measure) and against the time
   from the batch's POST. Targets: within 30% at 25% (issue 28, a short batch), within 25% at
   every mark.
4. The estimate a batch's create answers (``estimated_completion_at``, from the queue ahead of it,
   the workers' step cost and its token estimate) when it is posted behind ``--behind`` others of
   the same size, against when it completed. Target: within 30% of the time from its POST.

Before the measured runs the worker has run a job (the warm-up) and, with ``--history
restored`` (the default), one unmeasured batch of ``--bulk`` lines, after which the embedded
service is stopped and started again on the same folder: the measured batches run on a
restarted worker that loaded its engine's step history (``metrics.step_history``), as a
deployed worker does. ``--history fresh`` leaves the batch and the restart out (the fit starts
from the job's steps and its prior). ``--trace`` prints, for every forecast the worker published
during a measured batch, the estimate's terms against the truth: the API's estimate and the
worker's forecast of the time left, the lines it held, its fitted step cost, and that cost
applied to the steps that actually followed against their measured seconds (``cost x``: above
1 the steps ran slower than the fit said, i.e. the machine's load rose). Each run line ends with
the 1-minute load average at its start and end.

The service's engine runs with ``urgent_bulk_tokens`` (EngineConfig; on a CPU a step's time
grows with its tokens, so without a cap a job moves at the pace of full bulk steps).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

import httpx
from sqlalchemy import select

from bench.service import _SYSTEM, _WORDS
from cli.demo import _free_port
from cli.embedded import EmbeddedServer
from cli.engine_options import DEFAULT_MODEL
from service.models import WorkerStatus
from service.settings import Settings

POLL_S = 0.05
MARKS = (0.25, 0.5, 0.75)


def chat_lines(num: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    lines = []
    for i in range(num):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 80)))
        messages = [{"role": "system", "content": f"{_SYSTEM} Ticket {seed}."},
                    {"role": "user", "content": words}]
        lines.append({"custom_id": f"s{seed}-{i}", "body": {
            "messages": messages, "max_tokens": rng.randint(16, 64),
            "temperature": 0, "ignore_eos": True}})
    return lines


def job_body(seed: int) -> dict[str, Any]:
    rng = random.Random(10_000 + seed)
    words = " ".join(rng.choice(_WORDS) for _ in range(60))
    return {"body": {"messages": [{"role": "user", "content": f"{seed}: {words}"}],
                     "max_tokens": 32, "temperature": 0, "ignore_eos": True}}


class Bench:
    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.seed = 0

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def submit_batch(self, num: int) -> tuple[str, float]:
        batch_id, started, _ = self.create_batch(num)
        return batch_id, started

    def create_batch(self, num: int) -> tuple[str, float, float | None]:
        """(id, when it was posted, the ``estimated_completion_at`` its create answered)."""
        started = time.time()
        response = self.client.post("/v1/batches", json={
            "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "requests": chat_lines(num, self.next_seed())})
        response.raise_for_status()
        body = response.json()
        return body["id"], started, body.get("estimated_completion_at")

    def submit_job(self) -> tuple[str, float]:
        started = time.time()
        response = self.client.post("/v1/jobs", json=job_body(self.next_seed()))
        response.raise_for_status()
        return response.json()["id"], started

    def job_done(self, job_id: str) -> bool:
        status = self.client.get(f"/v1/jobs/{job_id}").json()["status"]
        if status == "failed":
            raise RuntimeError(f"job {job_id} failed")
        return status == "completed"

    def solo_job(self) -> float:
        job_id, started = self.submit_job()
        while not self.job_done(job_id):
            time.sleep(POLL_S)
        return time.time() - started

    def watch(self, batch_id: str, started: float, *, job_at: float | None = None,
              tracer: Tracer | None = None) -> dict[str, Any]:
        """Poll the batch to completion: its estimates at MARKS, its throughput, and the
        latency of a job posted once ``job_at`` of its lines are done."""
        readings: dict[float, tuple[float, float | None]] = {}
        job: tuple[str, float] | None = None
        job_latency: float | None = None
        load_at_start = os.getloadavg()[0]
        while True:
            batch = self.client.get(f"/v1/batches/{batch_id}").json()
            now = time.time()
            counts = batch["request_counts"]
            share = (counts["completed"] + counts["failed"]) / max(counts["total"], 1)
            if tracer is not None:
                tracer.poll(now, share, batch.get("estimated_completion_at"))
            for mark in MARKS:
                if share >= mark and mark not in readings and batch["status"] == "in_progress":
                    readings[mark] = (now, batch["estimated_completion_at"])
            if job_at is not None and job is None and share >= job_at:
                job = self.submit_job()
            if job is not None and job_latency is None and self.job_done(job[0]):
                job_latency = time.time() - job[1]
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            time.sleep(POLL_S)
        if job is not None and job_latency is None:
            while not self.job_done(job[0]):
                time.sleep(POLL_S)
            job_latency = time.time() - job[1]
        finished = time.time()
        elapsed = finished - started
        if tracer is not None:
            tracer.report(batch_id, started, finished)
        return {"elapsed": elapsed, "tokens_per_s": batch["usage"]["output_tokens"] / elapsed,
                "failed": batch["request_counts"]["failed"], "job_latency": job_latency,
                "load": (load_at_start, os.getloadavg()[0]),
                "errors": {mark: _errors(started, at, eta, finished)
                           for mark, (at, eta) in readings.items()}}


class Tracer:
    """The estimate's terms over a run (``--trace``): every forecast the worker publishes, read
    from its heartbeat row, with the API's estimate polled beside it; after the run, each
    against the truth."""

    def __init__(self, server: EmbeddedServer) -> None:
        worker = server.worker
        assert worker is not None and worker.recorder is not None
        self.worker = worker
        self.step_cost = worker.recorder.step_cost
        self.rows: list[tuple[float, float, float | None, dict[str, Any], int]] = []
        self._last_at: float | None = None

    def _forecast(self) -> dict[str, Any] | None:
        with self.worker.db.read_session() as session:
            metrics = session.scalars(select(WorkerStatus.metrics).where(
                WorkerStatus.id == self.worker.worker_id)).first()
        return (metrics or {}).get("forecast")

    def poll(self, now: float, share: float, eta: float | None) -> None:
        forecast = self._forecast()
        if forecast is not None and forecast["at"] != self._last_at:
            self._last_at = forecast["at"]
            self.rows.append((now, share, eta, forecast, self.step_cost.num_observed))

    def report(self, batch_id: str, started: float, finished: float) -> None:
        total = self.step_cost.num_observed
        print("    t(s)  done  left   api   worker lines  fixed    /decode   /prompt  "
              "cost x")
        for now, share, eta, forecast, observed in self.rows:
            held = forecast["batches"].get(batch_id)
            cost = forecast["cost"]
            later = self.step_cost.history(total - observed)
            actual = sum(seconds for _, _, seconds in later)
            fitted = sum(cost["fixed"] + cost["per_decode"] * decodes
                         + cost["per_prefill"] * prefill for decodes, prefill, _ in later)
            api = "  null" if eta is None else f"{eta - now:6.2f}"
            worker = ("   -  " if held is None
                      else f"{forecast['at'] + held['seconds_left'] - now:6.2f}")
            drift = f"{actual / fitted:6.2f}" if fitted > 0 else "     -"
            print(f"  {now - started:6.2f} {share:5.0%} {finished - now:5.2f} {api} {worker} "
                  f"{held['lines'] if held else 0:5d}  {cost['fixed']:.4f}  "
                  f"{cost['per_decode']:.6f}  {cost['per_prefill']:.6f} {drift}")


def _errors(started: float, at: float, eta: float | None, finished: float
            ) -> tuple[float, float] | None:
    """(error against the time left at the reading, against the time since the POST); signed:
    above zero the estimate was later than the batch's completion."""
    if eta is None:
        return None
    return ((eta - finished) / max(finished - at, 1e-9),
            (eta - finished) / max(finished - started, 1e-9))


def _fmt_errors(errors: dict[float, tuple[float, float] | None]) -> str:
    parts = []
    for mark in MARKS:
        e = errors.get(mark)
        parts.append(f"{int(mark * 100)}%: " + ("null" if e is None else
                                                f"{e[0]:+.0%} of left / {e[1]:+.0%} of total"))
    return ", ".join(parts)


def _fmt_load(result: dict[str, Any]) -> str:
    start, end = result["load"]
    return f"{start:.1f} -> {end:.1f}"


def _print_job_figures(runs: dict[str, list[dict[str, Any]]], solo: float) -> None:
    alone = statistics.median(x["tokens_per_s"] for x in runs["bulk alone"])
    with_job = statistics.median(x["tokens_per_s"] for x in runs["bulk + job"])
    latency = statistics.median(x["job_latency"] for x in runs["bulk + job"])
    bound = max(3 * solo, solo + 4.0)
    print(f"\njob under load {latency:.2f}s = {latency / solo:.1f}x solo {solo:.2f}s; "
          f"bound max(3 x solo, solo + 4 s) = {bound:.2f}s: "
          f"{'met' if latency <= bound else 'NOT met'}")
    drop = 1 - with_job / alone
    print(f"bulk throughput alone {alone:.1f} tok/s, with the job {with_job:.1f} tok/s: "
          f"drop {drop:.1%} (target <= 5%): {'met' if drop <= 0.05 else 'NOT met'}")


def _start(settings: Settings) -> tuple[EmbeddedServer, httpx.Client]:
    server = EmbeddedServer(settings, port=_free_port()).start()
    client = httpx.Client(base_url=server.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {server.api_key}"})
    return server, client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.queue_discipline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--bulk", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--urgent-bulk-tokens", type=int, default=64)
    parser.add_argument("--skip-queued", action="store_true")
    parser.add_argument("--behind", type=int, default=3,
                        help="step 4: the create-time estimate of a batch posted behind this "
                             "many others of --bulk lines (0: skip)")
    parser.add_argument("--eta-only", action="store_true",
                        help="measure only the estimate (step 3): no job, no bulk + job runs")
    parser.add_argument("--history", choices=("restored", "fresh"), default="restored",
                        help="restored: one unmeasured batch, then the service restarted on "
                             "the same folder (the worker loads its step history); fresh: not")
    parser.add_argument("--trace", action="store_true",
                        help="print the estimate's terms against the truth for each forecast")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="boxcar-bench-queue-")
    options: dict[str, Any] = {"urgent_bulk_tokens": args.urgent_bulk_tokens}
    if args.threads:
        options["num_threads"] = args.threads
    settings = Settings(database_url=f"sqlite:///{workdir}/boxcar.db",
                        storage_url=f"{workdir}/storage", model=args.model,
                        engine_options=options, poll_interval=0.1, worker_metrics_interval=1.0)
    server, client = _start(settings)
    bench = Bench(client)
    try:
        print(f"model {args.model}; bulk {args.bulk} chat lines (20-80 words, 16-64 output "
              f"tokens); urgent_bulk_tokens {args.urgent_bulk_tokens}; history {args.history}; "
              "machine shared: compare ratios", flush=True)
        bench.solo_job()  # warm up
        if args.history == "restored":
            bench.watch(*bench.submit_batch(args.bulk))
            client.close()
            server.stop()  # the worker saves its step history
            server, client = _start(settings)  # ... and the next one loads it
            bench.client = client
            restored = len(server.worker.recorder.step_cost) if server.worker.recorder else 0
            print(f"restarted: {restored} steps of the earlier run restored", flush=True)
            bench.solo_job()  # the restarted engine's warm-up
        traced = server if args.trace else None

        def tracer() -> Tracer | None:
            return Tracer(traced) if traced is not None else None

        solo = 0.0
        if not args.eta_only:
            solo = statistics.median(bench.solo_job() for _ in range(3))
            print(f"job solo: {solo:.2f}s", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"bulk alone": []}
        if not args.eta_only:
            runs["bulk + job"] = []
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                batch_id, started = bench.submit_batch(args.bulk)
                result = bench.watch(batch_id, started,
                                     job_at=1 / 3 if name == "bulk + job" else None,
                                     tracer=tracer() if name == "bulk alone" else None)
                runs[name].append(result)
                job = (f", job {result['job_latency']:.2f}s" if result["job_latency"] else "")
                print(f"round {r} {name:<11} {result['elapsed']:.1f}s "
                      f"{result['tokens_per_s']:.1f} tok/s{job}; eta errors: "
                      f"{_fmt_errors(result['errors'])}; load {_fmt_load(result)}", flush=True)
        queued = None
        if not args.skip_queued:
            bench.submit_batch(args.bulk)
            batch_id, started = bench.submit_batch(args.bulk)
            queued = bench.watch(batch_id, started, tracer=tracer())
            print(f"queued behind another: {queued['elapsed']:.1f}s; eta errors: "
                  f"{_fmt_errors(queued['errors'])}; load {_fmt_load(queued)}", flush=True)

        if args.behind:
            for _ in range(args.behind):
                bench.submit_batch(args.bulk)
            batch_id, started, estimate = bench.create_batch(args.bulk)
            behind = bench.watch(batch_id, started)
            finished = started + behind["elapsed"]
            error = (None if estimate is None
                     else (estimate - finished) / max(finished - started, 1e-9))
            print(f"created behind {args.behind} others: completed after "
                  f"{behind['elapsed']:.1f}s; estimate at create "
                  + ("none" if estimate is None else
                     f"{estimate - started:.1f}s, error {error:+.0%} of the time from create")
                  + " (target within 30%): "
                  + ("met" if error is not None and abs(error) <= 0.30 else "NOT met")
                  + f"; load {_fmt_load(behind)}", flush=True)

        if not args.eta_only:
            _print_job_figures(runs, solo)
        worst: list[float] = []
        quarter: list[float] = []
        for result in [*runs["bulk alone"], *([queued] if queued else [])]:
            worst.extend(float("inf") if e is None else abs(e[0])
                         for e in result["errors"].values())
            e = result["errors"].get(MARKS[0])
            quarter.append(float("inf") if e is None else abs(e[0]))
        if quarter:
            print(f"eta at 25%: worst error against the time left {max(quarter):.0%} over "
                  f"{len(quarter)} readings (target <= 30%): "
                  f"{'met' if max(quarter) <= 0.30 else 'NOT met'}")
        if worst:
            print(f"eta: worst error against the time left {max(worst):.0%} over "
                  f"{len(worst)} readings (target <= 25%): "
                  f"{'met' if max(worst) <= 0.25 else 'NOT met'}")
    finally:
        client.close()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
