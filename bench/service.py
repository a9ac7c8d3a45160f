"""The same JSONL through ``boxcar run`` (offline) and through the full service (embedded:
REST upload, batch, worker, SQLite, files), each on a fresh engine; prints both throughputs and
the service's share of the offline one (target: within 10%).

    python -m bench.service --model SmolLM2-135M-Instruct          # a seeded workload
    python -m bench.service FILE.jsonl --model SmolLM2-135M-Instruct

Without FILE it writes a seeded workload first: 64 chat lines, prompts of 20-300 words (half
share a system prompt), 16-128 output tokens each, greedy with ignore_eos so both runs generate
exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from cli.demo import _free_port, submit_and_wait
from cli.embedded import EmbeddedServer
from cli.engine_options import DEFAULT_MODEL
from engine.protocol import Engine
from service.settings import Settings


@dataclass(frozen=True)
class Result:
    name: str
    elapsed_s: float
    num_ok: int
    num_generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


_WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars shine above "
          "quiet hills and busy towns where people trade bread tools books and stories").split()
_SYSTEM = ("You are a careful assistant for a hardware store. Answer plainly, mention one safety "
           "tip for tools, and say so when you do not know.")


def write_workload(path: str, *, num_lines: int = 64, seed: int = 0) -> str:
    """A seeded chat workload in the OpenAI batch format (see the module docstring)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_lines):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 300)))
            messages = [{"role": "user", "content": words}]
            if i % 2 == 0:
                messages.insert(0, {"role": "system", "content": _SYSTEM})
            # No model named: the lines run on the deployment's default, the one model served.
            body = {"messages": messages, "max_tokens": rng.randint(16, 128),
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"bench-{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")
    return path


def _engine(model: str, options: dict[str, Any]) -> Engine:
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, **options))


def run_offline(input_path: str, model: str, options: dict[str, Any], workdir: str) -> Result:
    """``boxcar run``'s code path: the engine on this thread, the file streamed through it."""
    from cli.offline import run_batch_file

    engine = _engine(model, options)
    summary = run_batch_file(engine, input_path, os.path.join(workdir, "offline.jsonl"),
                             progress=False)
    return Result("boxcar run", summary.elapsed_s, summary.num_ok, summary.num_generated_tokens)


def run_service(input_path: str, model: str, options: dict[str, Any], workdir: str) -> Result:
    """``boxcar serve``'s code path: the worker builds its engine (on its engine thread), the
    JSONL goes in through the REST API, the clock stops when a poll sees the batch done."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    settings = Settings(database_url=f"sqlite:///{workdir}/bench-{tag}.db",
                        storage_url=os.path.join(workdir, f"storage-{tag}"), model=model,
                        engine_options=options, poll_interval=0.5,
                        finalize_scan_interval=0.5)
    server = EmbeddedServer(settings, port=_free_port()).start()
    try:
        started = time.monotonic()
        # A client polls now and then (the openai cookbook: every few seconds); polling every
        # 0.1 s would make the API in this process take CPU from the engine for nothing.
        batch = submit_and_wait(server.base_url, server.api_key, input_path, poll=0.5,
                                progress=False)
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    return Result("service (embedded)", elapsed, batch["request_counts"]["completed"],
                  batch["usage"]["output_tokens"])


def _in_fresh_process(fn: Callable[..., Result], *args: Any) -> Result:
    """Each run in a new process, as a user runs each command: no torch or OpenMP state left
    over from the other run."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def compare(input_path: str | None, model: str, options: dict[str, Any], *,
            rounds: int = 1) -> dict[str, Any]:
    """``rounds`` alternating pairs of runs; each side's median elapsed time is compared."""
    runs: dict[str, list[Result]] = {"offline": [], "service": []}
    with tempfile.TemporaryDirectory(prefix="boxcar-bench-") as workdir:
        if input_path is None:
            input_path = write_workload(os.path.join(workdir, "workload.jsonl"))
        for _ in range(rounds):
            runs["offline"].append(
                _in_fresh_process(run_offline, input_path, model, options, workdir))
            runs["service"].append(
                _in_fresh_process(run_service, input_path, model, options, workdir))
    medians = {side: sorted(results, key=lambda r: r.elapsed_s)[(len(results) - 1) // 2]
               for side, results in runs.items()}
    offline, service = medians["offline"], medians["service"]
    ratio = service.tokens_per_s / offline.tokens_per_s if offline.tokens_per_s else 0.0
    return {
        "input": input_path, "model": model, "rounds": rounds,
        "offline": offline.__dict__ | {"tokens_per_s": offline.tokens_per_s},
        "service": service.__dict__ | {"tokens_per_s": service.tokens_per_s},
        "elapsed_s": {side: [round(r.elapsed_s, 2) for r in results]
                      for side, results in runs.items()},
        "service_vs_offline": ratio,
        "within_10_percent": ratio >= 0.9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", default=None,
                        help="an OpenAI batch JSONL (default: the seeded workload)")
    parser.add_argument("--model", default=os.environ.get("BOXCAR_MODEL", DEFAULT_MODEL))
    parser.add_argument("--engine-options", default="{}",
                        help='EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64}\'')
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternating offline/service pairs; medians are compared")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    report = compare(args.input, args.model, json.loads(args.engine_options),
                     rounds=args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key in ("offline", "service"):
            r = report[key]
            print(f"{r['name']:<20} {r['elapsed_s']:8.2f}s  {r['num_ok']:6d} ok  "
                  f"{r['num_generated_tokens']:8d} tokens  {r['tokens_per_s']:10.1f} tok/s")
        if args.rounds > 1:
            print(f"elapsed per round (s): {report['elapsed_s']}; medians above")
        print(f"service / offline: {report['service_vs_offline']:.1%} "
              f"({'within' if report['within_10_percent'] else 'NOT within'} 10%)")
    return 0 if report["within_10_percent"] else 1


if __name__ == "__main__":
    sys.exit(main())
