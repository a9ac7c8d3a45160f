"""Start-up cost of ``boxcar run`` on a one-line file, cold and warm, and of ``boxcar serve``.

``python -m bench.startup [--rounds 3] [--boxcar CMD] [--model default] [--no-serve] [--no-cold]``

Each measured command runs in a fresh process under a small wrapper that reports its peak RSS
(``getrusage(RUSAGE_CHILDREN)`` of a process with that one child). The caches live in a private
folder: the model file is copied into its own ``BOXCAR_MODEL_CACHE`` (so its converted folder is
built there), with empty ``BOXCAR_KERNEL_CACHE`` and ``BOXCAR_CONVERTED_CACHE``; the first run is
therefore cold (kernel build, GGUF conversion) and the following ones warm. The breakdown comes
from a probe process that imports what ``boxcar run`` imports, builds the ``LLMEngine`` (its
``startup_seconds``: checkpoint, tokenizer, model, KV cache, kernel) and generates the same line;
cold runs also report the kernel build and conversion times that ``boxcar run`` prints on stderr.
Warm rounds alternate probe and ``boxcar run``, and medians are reported; the machine may be
shared, so compare ratios rather than absolute seconds. CPU seconds (user + system, every thread)
are reported beside the walls: they move less than walls when other work shares the machine
(except that torch's OpenMP threads spin while they wait for a descheduled sibling).

Targets (issue 12): warm ``boxcar run`` wall <= imports + 3 s; ``boxcar serve`` ready <= 10 s warm;
peak RSS of ``boxcar run`` on the default model <= 1.5 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

RUN_TARGET_OVER_IMPORTS_S = 3.0
SERVE_TARGET_S = 10.0
RSS_TARGET_MB = 1.5 * 1024
LINE = {
    "custom_id": "startup-1", "method": "POST", "url": "/v1/chat/completions",
    "body": {"max_tokens": 16, "temperature": 0,
             "messages": [{"role": "user", "content": "Say hello in one short sentence."}]},
}
# What ``boxcar run`` imports before it builds the engine (missing ones are skipped).
DEFAULT_IMPORTS = "cli.main,cli.offline,metrics.recorder,engine.llm_engine"

# Runs argv[1:], then prints the child's peak RSS (MiB) and CPU seconds (user + system, all its
# threads) as the last stderr line.
_RSS_WRAPPER = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"peak_rss_mb={usage.ru_maxrss / 1024:.1f} cpu_s={usage.ru_utime + usage.ru_stime:.3f}",
      file=sys.stderr)
sys.exit(code)
"""

_PROBE = """
import importlib, json, sys, time
start, start_cpu = time.perf_counter(), time.process_time()
for name in sys.argv[2].split(","):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
imported, imported_cpu = time.perf_counter(), time.process_time()
from engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1]))
built, built_cpu = time.perf_counter(), time.process_time()
line = json.loads(sys.argv[3])
prompt = engine.apply_chat_template(line["body"]["messages"])
params = SamplingParams(temperature=0.0, max_tokens=line["body"]["max_tokens"])
engine.add_request("r", prompt, params)
while engine.has_unfinished_requests():
    engine.step()
done, done_cpu = time.perf_counter(), time.process_time()
print("PROBE " + json.dumps({
    "imports": imported - start, **engine.startup_seconds, "engine": built - imported,
    "first_generation": done - built, "probe_total": done - start,
    "imports_cpu": imported_cpu - start_cpu, "engine_cpu": built_cpu - imported_cpu,
    "first_generation_cpu": done_cpu - built_cpu,
}))
"""


def boxcar_command(explicit: str | None) -> list[str]:
    """``--boxcar``, else ``python -m cli.main`` of this interpreter (this checkout's code; an
    installed ``boxcar`` script may point at another one)."""
    if explicit:
        return explicit.split()
    return [sys.executable, "-m", "cli.main"]


def measured(command: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", _RSS_WRAPPER, *command], env=env, cwd=cwd,
        capture_output=True, text=True,
    )
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    rss = float(re.findall(r"peak_rss_mb=([\d.]+)", result.stderr)[-1])
    cpu = float(re.findall(r"cpu_s=([\d.]+)", result.stderr)[-1])
    return {"wall": wall, "rss_mb": rss, "cpu": cpu, "stdout": result.stdout,
            "stderr": result.stderr}


def run_once(boxcar: list[str], env: dict[str, str], work: Path, model: str) -> dict[str, Any]:
    output = work / "output.jsonl"
    output.unlink(missing_ok=True)
    result = measured([*boxcar, "run", str(work / "input.jsonl"), "-o", str(output),
                       "--no-progress", "--model", model], env, work)
    lines = output.read_text().splitlines()
    if len(lines) != 1 or json.loads(lines[0]).get("error"):
        raise RuntimeError(f"boxcar run wrote {lines!r}")
    built = re.findall(r"kernel built in ([\d.]+) s", result["stderr"])
    converted = re.findall(r"converted .* in ([\d.]+) s", result["stderr"])
    result["kernel_build"] = float(built[0]) if built else 0.0
    result["conversion"] = float(converted[0]) if converted else 0.0
    return result


def probe_once(env: dict[str, str], work: Path, model: str, imports: str) -> dict[str, Any]:
    result = measured([sys.executable, "-c", _PROBE, model, imports, json.dumps(LINE)], env, work)
    line = next(x for x in result["stdout"].splitlines() if x.startswith("PROBE "))
    return {**json.loads(line.removeprefix("PROBE ")), "probe_rss_mb": result["rss_mb"],
            "probe_cpu": result["cpu"], "probe_wall": result["wall"]}


def serve_once(boxcar: list[str], env: dict[str, str], work: Path, model: str) -> dict[str, Any]:
    """Seconds from launch to the readiness line and to /readyz answering 200."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve_dir = work / "serve"
    shutil.rmtree(serve_dir, ignore_errors=True)
    serve_dir.mkdir()
    start = time.perf_counter()
    process = subprocess.Popen(
        [*boxcar, "serve", "--port", str(port), "--model", model], env=env, cwd=serve_dir,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    figures: dict[str, Any] = {}
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "is serving" in line:
                figures["ready_line"] = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"boxcar serve exited ({process.wait()}) before it was ready")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        figures["readyz"] = time.perf_counter() - start
                        break
            except OSError:
                time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds (default 3)")
    parser.add_argument("--boxcar", default=None, help="the boxcar command (default: the venv's)")
    parser.add_argument("--model", default="default", help="model name or .gguf path")
    parser.add_argument("--imports", default=DEFAULT_IMPORTS,
                        help="modules boxcar run imports, for the import time")
    parser.add_argument("--no-serve", action="store_true", help="skip boxcar serve")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold run")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args(argv)

    from engine.checkpoint import model_cache  # light: no torch

    source = Path(args.model).expanduser()
    if not source.is_file():
        resolved = model_cache.resolve(args.model) or model_cache.pull(args.model)
        source = resolved if resolved.is_file() else next(resolved.glob("*.gguf"))
    name = model_cache.canonical_name(args.model) if not Path(args.model).exists() else "m"
    boxcar = boxcar_command(args.boxcar)
    report: dict[str, Any] = {"boxcar": boxcar, "model": str(source)}
    with tempfile.TemporaryDirectory(prefix="boxcar-startup-") as tmp:
        work = Path(tmp)
        (work / "models" / name).mkdir(parents=True)
        shutil.copy2(source, work / "models" / name / source.name)
        (work / "input.jsonl").write_text(json.dumps(LINE) + "\n")
        env = {
            **os.environ,
            "BOXCAR_MODEL_CACHE": str(work / "models"),
            "BOXCAR_KERNEL_CACHE": str(work / "kernels"),
            "BOXCAR_CONVERTED_CACHE": str(work / "converted"),
        }
        print(f"boxcar: {' '.join(boxcar)}\nmodel: {source} (copied to {work / 'models'})")
        if not args.no_cold:
            print("cold boxcar run (empty kernel and conversion caches)...", flush=True)
            cold = run_once(boxcar, env, work, name)
            report["cold"] = {k: v for k, v in cold.items() if k not in ("stdout", "stderr")}
        else:
            probe_once(env, work, name, args.imports)  # fills the caches
        warm_runs, probes = [], []
        for i in range(args.rounds):
            print(f"warm round {i + 1}/{args.rounds}...", flush=True)
            probes.append(probe_once(env, work, name, args.imports))
            run = run_once(boxcar, env, work, name)
            warm_runs.append({k: v for k, v in run.items() if k not in ("stdout", "stderr")})
        report["warm_runs"], report["probes"] = warm_runs, probes
        if not args.no_serve:
            print("warm boxcar serve...", flush=True)
            try:
                report["serve"] = serve_once(boxcar, env, work, name)
            except (RuntimeError, OSError) as exc:
                report["serve"] = {"error": str(exc)}

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print("\nbreakdown, warm (median of the probes, s; the tokenizer loads beside the model, "
          "inside 'engine'):")
    for key in ("imports", "checkpoint", "tokenizer", "model", "kv_cache", "kernel", "engine",
                "first_generation", "probe_total"):
        cpu = f"   cpu {median(probes, key + '_cpu'):6.3f}" if key + "_cpu" in probes[0] else ""
        print(f"  {key:<17}{median(probes, key):8.3f}{cpu}")
    probe_wall, probe_cpu = median(probes, "probe_wall"), median(probes, "probe_cpu")
    print(f"  probe process    {probe_wall:8.3f}   cpu {probe_cpu:6.3f} (from outside: interpreter "
          "start and exit too; cpu: user + system, all threads)")
    if "cold" in report:
        cold = report["cold"]
        print(f"cold boxcar run: wall {cold['wall']:.2f} s (kernel build {cold['kernel_build']:.1f}"
              f" s, GGUF conversion {cold['conversion']:.1f} s), peak RSS {cold['rss_mb']:.0f} MiB")
    wall, rss = median(warm_runs, "wall"), max(run["rss_mb"] for run in warm_runs)
    imports = median(probes, "imports")
    budget = imports + RUN_TARGET_OVER_IMPORTS_S
    walls = ", ".join(f"{run['wall']:.2f}" for run in warm_runs)
    print(f"warm boxcar run: wall {wall:.2f} s (median of {len(warm_runs)}: {walls}), "
          f"cpu {median(warm_runs, 'cpu'):.2f} s, peak RSS {rss:.0f} MiB; "
          f"past the imports {wall - imports:.2f} s, past the probe process "
          f"{wall - median(probes, 'probe_wall'):.2f} s")
    print("targets:")
    print(f"  warm run wall / (imports + 3 s) = {wall:.2f} / {budget:.2f} = {wall / budget:.2f}"
          f" ({'met' if wall <= budget else 'NOT met'})")
    print(f"  peak RSS / 1.5 GiB = {rss:.0f} / {RSS_TARGET_MB:.0f} = {rss / RSS_TARGET_MB:.2f}"
          f" ({'met' if rss <= RSS_TARGET_MB else 'NOT met'})")
    serve = report.get("serve", {})
    if "ready_line" in serve:
        ready = serve["ready_line"]
        readyz = f", /readyz 200 at {serve['readyz']:.2f} s" if "readyz" in serve else ""
        print(f"  serve ready line / 10 s = {ready:.2f} / {SERVE_TARGET_S:.0f} = "
              f"{ready / SERVE_TARGET_S:.2f} ({'met' if ready <= SERVE_TARGET_S else 'NOT met'})"
              f"{readyz}")
    elif serve:
        print(f"  serve: {serve.get('error')}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
