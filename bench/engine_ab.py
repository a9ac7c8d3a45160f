"""The engine on bench.offline's workload, two checkouts interleaved: CPU time, faults, wall.

``python -m bench.engine_ab --old PATH [--new PATH] [--rounds 3] [--num-requests 32] [--profile]
[--prefault-kv] [--model NAME] [--quick]``

Each round runs ``LLM.generate`` on the same seeded workload (bench.offline's: chat prompts of
30-400 tokens, 16-256 greedy output tokens, EOS ignored) once with each checkout, in a fresh
process whose ``PYTHONPATH`` is that checkout, alternating which goes first. Wall time drifts with
whatever else runs on the machine; the process's CPU time split into user and system time (page
faults and madvise/mmap work show as system time), its minor page faults and the Python time
spent outside the model forward (``--profile``: cProfile's top functions by own time) move far
less, so they are what to compare on a shared machine, with ``--threads 1``: with two threads
OpenMP's spin-waiting turns contention into user time. ``--prefault-kv`` writes zeros over each
engine's whole KV cache before the timed run, so every page of it is committed up front as the old
engine's ``torch.zeros`` did; today's engine otherwise commits the pages (a fault each) as the run
first writes them. Prints per-round figures, medians, and new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

# Runs inside the checkout under test: its engine, its bench.offline workload.
_CHILD = r"""
import cProfile, io, json, pstats, resource, sys, time
import torch
from bench.offline import make_workload
from engine import LLM, SamplingParams

num_requests, threads, profile = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
prefault_kv, model, quick = sys.argv[4] == "1", sys.argv[5], sys.argv[6] == "1"
torch.set_num_threads(threads)
torch.manual_seed(0)

def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": time.perf_counter(), "user": r.ru_utime, "sys": r.ru_stime,
            "minflt": r.ru_minflt}

def kv_resident(tensor):
    # The share of the tensor's pages that are committed: Rss of the mappings it lies in.
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if not head.endswith(":"):  # a mapping's header: "lo-hi perms offset dev inode path"
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < start + size and hi > start
            elif inside and head == "Rss:":
                resident += int(line.split()[1]) * 1024
    return min(resident / size, 1.0)

t0 = usage()
llm = LLM(model, dtype="float32", device="cpu", num_threads=threads,
          max_num_seqs=128, max_num_batched_tokens=2048)
if prefault_kv:  # commit every page of the cache now, as torch.zeros did (both checkouts have it)
    runner = llm.engine.model_runner
    # every KV group (windowed too); an older checkout has the one tensor
    for tensor in (runner.kv.tensors if hasattr(runner, "kv") else [runner.kv_cache]):
        tensor.zero_()
workload = make_workload(llm.tokenizer, num_requests=num_requests,
                         prompt_range=(30, 100) if quick else (30, 400),
                         output_range=(8, 32) if quick else (16, 256), seed=0)
params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
          for m in workload.max_tokens]
llm.generate([workload.prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))
t1 = usage()
profiler = cProfile.Profile() if profile else None
if profiler:
    profiler.enable()
outputs = llm.generate(workload.prompts, params)
if profiler:
    profiler.disable()
t2 = usage()
tokens = sum(len(o.token_ids) for o in outputs)
figures = {k: t2[k] - t1[k] for k in t2}
figures["build"] = {k: t1[k] - t0[k] for k in t1}
figures["kv_resident"] = kv_resident(llm.engine.model_runner.kv_cache)  # after the run
figures["tokens"] = tokens
figures["tok_s"] = tokens / figures["wall"]
figures["digest"] = hash(tuple(tuple(o.token_ids) for o in outputs))
if profiler:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    figures["profile"] = out.getvalue()
print("AB " + json.dumps(figures))
"""


def run_child(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": str(args.threads)}
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(args.num_requests), str(args.threads),
         "1" if args.profile else "0", "1" if args.prefault_kv else "0",
         args.model, "1" if args.quick else "0"],
        env=env, cwd=checkout, capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{checkout} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("AB "))
    return json.loads(line.removeprefix("AB "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the checkout to compare against")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]),
                        help="the checkout under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    parser.add_argument("--prefault-kv", action="store_true",
                        help="commit every KV cache page before the timed run (both checkouts)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true",
                        help="bench.offline --quick's short prompts and outputs (a smoke test)")
    args = parser.parse_args(argv)

    checkouts = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    rows: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for i in range(args.rounds):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for name in order:
            figures = run_child(checkouts[name], args)
            rows[name].append(figures)
            print(f"round {i + 1} {name}: wall {figures['wall']:.2f} s, "
                  f"{figures['tok_s']:.1f} tok/s, user {figures['user']:.2f} s, "
                  f"sys {figures['sys']:.2f} s, minor faults {figures['minflt']}, KV cache "
                  f"{figures['kv_resident']:.0%} resident; build: "
                  f"wall {figures['build']['wall']:.2f} s, sys {figures['build']['sys']:.2f} s",
                  flush=True)
            if args.profile:
                print(figures["profile"])
    if {r["digest"] for r in rows["old"]} != {r["digest"] for r in rows["new"]}:
        print("WARNING: the two checkouts generated different tokens")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    print(f"\nmedians over {args.rounds} rounds (generate only; shared machines: read CPU time):")
    print(f"  {'':<14}{'old':>10}{'new':>10}{'new/old':>9}")
    for key in ("wall", "tok_s", "user", "sys", "minflt"):
        old, new = median("old", key), median("new", key)
        cpu = f"{old:10.2f}{new:10.2f}" if key != "minflt" else f"{old:10.0f}{new:10.0f}"
        print(f"  {key:<14}{cpu}{new / old if old else float('nan'):9.3f}")
    old_cpu = statistics.median(r["user"] + r["sys"] for r in rows["old"])
    new_cpu = statistics.median(r["user"] + r["sys"] for r in rows["new"])
    print(f"  {'user+sys':<14}{old_cpu:10.2f}{new_cpu:10.2f}{new_cpu / old_cpu:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
