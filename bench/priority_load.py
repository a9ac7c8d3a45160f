"""A single urgent request under bulk load, in the engine: its latency against its solo latency.

``python -m bench.priority_load [--bulk 150] [--job-delay 3] [--rounds 1]``

One engine on the default model. A seeded bulk workload (``--bulk`` chat prompts of 30-120 tokens,
16-64 greedy output tokens, EOS ignored) is added at once; ``--job-delay`` seconds into its run a
distinct job request is added. Three runs, interleaved round by round on this shared machine:

- ``bulk alone``: the bulk workload only (its throughput is the reference);
- ``job urgent, cap N``: the job added with ``priority=-1`` (bulk at 0; lower is more urgent),
  with ``urgent_bulk_tokens=N`` (one run per ``--caps`` value, the first is the one checked
  against the bound) capping the bulk's tokens per step (decodes and prefill) while the job is
  unfinished;
- ``job urgent, no cap``: the same without the cap (on a CPU a step's time grows with its tokens,
  so the job then moves at the pace of full bulk steps, prefill chunks included);
- ``job fifo``: the job added with ``priority=0``, behind every bulk request (what priority buys).

The job alone is timed first (median of three cold runs). Printed: the job's latency against
``max(3 x solo, solo + 4 s)`` (the issue's target for the service), the bulk throughput of each
run and its drop against ``bulk alone``, and the preemptions the job caused.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

from bench.engine_setup import add_engine_args, build_llm, interleaved
from bench.workload import make_workload


def cold(llm: Any) -> None:
    llm.engine.scheduler.kv.pool.reset_prefix_cache()


def run_solo(llm: Any, prompt: list[int], max_tokens: int) -> float:
    from engine import SamplingParams

    cold(llm)
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start


def run_load(llm: Any, bulk: Any, job: tuple[list[int], int] | None, job_priority: int,
             job_delay: float) -> dict[str, Any]:
    from engine import SamplingParams

    engine = llm.engine
    cold(llm)
    before = engine.get_stats()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(bulk.prompts, bulk.max_tokens, strict=True)):
        engine.add_request(f"bulk-{i}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    job_added = job_done = None
    bulk_done = start
    bulk_tokens = 0
    preemptions_at_job = 0
    job_steps: list[float] = []  # the steps' times from the job's arrival to its end
    while engine.has_unfinished_requests() or (job is not None and job_added is None):
        now = time.perf_counter()
        if job is not None and job_added is None and now - start >= job_delay:
            preemptions_at_job = engine.get_stats().num_preemptions
            engine.add_request("job", job[0], SamplingParams(
                temperature=0.0, max_tokens=job[1], ignore_eos=True), priority=job_priority)
            job_added = now
        outputs = engine.step()
        if job_added is not None and job_done is None:
            job_steps.append(time.perf_counter() - now)
        for out in outputs:
            if out.request_id == "job":
                job_done = time.perf_counter()
            else:
                bulk_done = time.perf_counter()
                bulk_tokens += len(out.token_ids)
    after = engine.get_stats()
    return {
        "bulk_seconds": bulk_done - start,
        "bulk_tokens_per_s": bulk_tokens / (bulk_done - start),
        "job_latency": None if job_added is None or job_done is None else job_done - job_added,
        "job_steps": len(job_steps),
        "job_step_ms": 1000 * statistics.mean(job_steps) if job_steps else None,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "preemptions_after_job": after.num_preemptions - max(preemptions_at_job,
                                                             before.num_preemptions),
    }


def fmt(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.2f}{unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.priority_load",
                                     description=__doc__.split("\n\n")[0])
    add_engine_args(parser, kv_cache_memory=2 << 30)
    parser.add_argument("--bulk", type=int, default=150)
    parser.add_argument("--job-delay", type=float, default=3.0)
    parser.add_argument("--job-max-tokens", type=int, default=32)
    parser.add_argument("--caps", default="64",
                        help="comma-separated EngineConfig.urgent_bulk_tokens values, one "
                             "'job urgent' run each; the first is checked against the bound")
    parser.add_argument("--skip-fifo", action="store_true")
    parser.add_argument("--skip-no-cap", action="store_true")
    args = parser.parse_args(argv)

    llm = build_llm(args)
    bulk = make_workload(llm.tokenizer, num_requests=args.bulk, prompt_range=(30, 120),
                         output_range=(16, 64), seed=args.seed)
    job_prompt = make_workload(llm.tokenizer, num_requests=1, prompt_range=(120, 120),
                               output_range=(1, 1), seed=args.seed + 1).prompts[0]
    job = (job_prompt, args.job_max_tokens)
    print(f"bulk: {args.bulk} requests, {bulk.num_prompt_tokens} prompt tokens, "
          f"{bulk.num_output_tokens} output tokens; job: {len(job_prompt)} prompt tokens, "
          f"{args.job_max_tokens} output tokens, added {args.job_delay:.1f}s in; "
          f"max_num_seqs {llm.engine.config.max_num_seqs}, {args.threads} thread(s), "
          "machine shared: compare ratios", flush=True)
    run_solo(llm, job_prompt, 2)  # warm up
    solo = statistics.median(run_solo(llm, job_prompt, args.job_max_tokens) for _ in range(3))
    print(f"job solo: {solo:.2f}s", flush=True)

    caps = [int(c) for c in args.caps.split(",")]

    def capped(cap: int | None) -> None:
        # urgent_bulk_tokens is read by the scheduler at each step: set it per run.
        llm.engine.scheduler.config = replace(llm.engine.config, urgent_bulk_tokens=cap)

    def job_run(priority: int, cap: int | None) -> dict[str, Any]:
        capped(cap)
        return run_load(llm, bulk, job, priority, args.job_delay)

    variants: dict[str, Any] = {"bulk alone": lambda: run_load(llm, bulk, None, 0, args.job_delay)}
    for cap in caps:
        variants[f"job urgent, cap {cap}"] = lambda cap=cap: job_run(-1, cap)
    variants["job urgent, no cap"] = lambda: job_run(-1, None)
    variants["job fifo"] = lambda: job_run(0, None)
    if args.skip_fifo:
        del variants["job fifo"]
    if args.skip_no_cap:
        del variants["job urgent, no cap"]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r, name in interleaved(list(variants), args.rounds):
        results[name].append(variants[name]())
        x = results[name][-1]
        print(f"round {r} {name:<22} bulk {x['bulk_seconds']:.1f}s "
              f"{x['bulk_tokens_per_s']:.1f} tok/s, job {fmt(x['job_latency'], 's')} in "
              f"{x['job_steps']} steps of {fmt(x['job_step_ms'], ' ms')} (mean)", flush=True)

    reference = statistics.median(x["bulk_tokens_per_s"] for x in results["bulk alone"])
    bound = max(3 * solo, solo + 4.0)
    print(f"\n{'run':<23}{'bulk tok/s':>11}{'drop':>8}{'job s':>8}{'x solo':>8}{'preempt':>9}")
    for name, runs in results.items():
        tput = statistics.median(x["bulk_tokens_per_s"] for x in runs)
        latencies = [x["job_latency"] for x in runs if x["job_latency"] is not None]
        latency = statistics.median(latencies) if latencies else None
        job_text = f"{latency:>8.2f}{latency / solo:>8.1f}" if latency is not None else " " * 16
        print(f"{name:<23}{tput:>11.1f}{1 - tput / reference:>8.1%}{job_text}"
              f"{statistics.median(x['preemptions_after_job'] for x in runs):>9}")
    checked = f"job urgent, cap {caps[0]}"
    urgent = statistics.median(x["job_latency"] for x in results[checked])
    drop = 1 - statistics.median(x["bulk_tokens_per_s"] for x in results[checked]) / reference
    print(f"\n{checked}: bulk drop {drop:.1%} (target <= 5%): "
          f"{'met' if drop <= 0.05 else 'NOT met'}; job {urgent:.2f}s, "
          f"bound max(3 x solo, solo + 4 s) = {bound:.2f}s: "
          f"{'met' if urgent <= bound else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
