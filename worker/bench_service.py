"""The same JSONL through ``boxcar run`` (offline) and through the full service (embedded:
REST upload, batch, worker, SQLite, files), each on a fresh engine; prints both throughputs and
the service's share of the offline one (target: within 10%).

    python -m worker.bench_service examples/requests.jsonl --model SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from api.settings import Settings
from worker.demo import _free_port, submit_and_wait
from worker.embedded import EmbeddedServer


@dataclass(frozen=True)
class Result:
    name: str
    elapsed_s: float
    num_ok: int
    num_generated_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s else 0.0


def _engine(model: str, options: dict[str, Any]) -> Any:
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, **options))


def run_offline(input_path: str, model: str, options: dict[str, Any], workdir: str) -> Result:
    from worker.offline import run_batch_file

    engine = _engine(model, options)
    summary = run_batch_file(engine, input_path, os.path.join(workdir, "offline.jsonl"),
                             progress=False)
    return Result("boxcar run", summary.elapsed_s, summary.num_ok, summary.num_generated_tokens)


def run_service(input_path: str, model: str, options: dict[str, Any], workdir: str) -> Result:
    settings = Settings(database_url=f"sqlite:///{workdir}/bench.db",
                        storage_url=os.path.join(workdir, "storage"), model=model,
                        engine_options=options, poll_interval=0.5,
                        finalize_scan_interval=0.5)
    server = EmbeddedServer(settings, port=_free_port(), engine=_engine(model, options)).start()
    try:
        started = time.monotonic()
        batch = submit_and_wait(server.base_url, server.api_key, input_path, poll=0.1,
                                progress=False)
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    return Result("service (embedded)", elapsed, batch["request_counts"]["completed"],
                  batch["usage"]["output_tokens"])


def compare(input_path: str, model: str, options: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="boxcar-bench-") as workdir:
        offline = run_offline(input_path, model, options, workdir)
        service = run_service(input_path, model, options, workdir)
    ratio = service.tokens_per_s / offline.tokens_per_s if offline.tokens_per_s else 0.0
    return {
        "input": input_path, "model": model,
        "offline": offline.__dict__ | {"tokens_per_s": offline.tokens_per_s},
        "service": service.__dict__ | {"tokens_per_s": service.tokens_per_s},
        "service_vs_offline": ratio,
        "within_10_percent": ratio >= 0.9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.bench_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input")
    parser.add_argument("--model", default=os.environ.get("BOXCAR_MODEL",
                                                          "SmolLM2-135M-Instruct"))
    parser.add_argument("--engine-options", default="{}",
                        help='EngineConfig fields as JSON, e.g. \'{"max_num_seqs": 64}\'')
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    report = compare(args.input, args.model, json.loads(args.engine_options))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key in ("offline", "service"):
            r = report[key]
            print(f"{r['name']:<20} {r['elapsed_s']:8.2f}s  {r['num_ok']:6d} ok  "
                  f"{r['num_generated_tokens']:8d} tokens  {r['tokens_per_s']:10.1f} tok/s")
        print(f"service / offline: {report['service_vs_offline']:.1%} "
              f"({'within' if report['within_10_percent'] else 'NOT within'} 10%)")
    return 0 if report["within_10_percent"] else 1


if __name__ == "__main__":
    sys.exit(main())
