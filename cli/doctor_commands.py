"""``boxcar doctor``: read a metrics snapshot and say which serving failures it shows.

The source is a JSON file (``boxcar run --metrics-json``, or a snapshot saved with ``--save``)
or a Prometheus /metrics URL (the API's, which carries every live worker's engine, or one
worker's own port). A URL is sampled over ``--duration`` seconds: the diagnosis covers what
happened in that window (counters and histograms differenced, a timeline from the samples); an
idle window falls back to the totals since the workers started.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000/metrics"


def load_file(path: str | Path) -> dict[str, Any]:
    """The snapshot in a saved file: a bare snapshot, or ``boxcar run``'s document."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and "counters" in data and "histograms" in data:
        return data
    if isinstance(data, dict) and isinstance(data.get("metrics"), dict):
        return data["metrics"]
    raise ValueError(f"{path} holds no metrics snapshot: write one with "
                     "`boxcar run --metrics-json` or `boxcar doctor URL --save`")


def parse_exposition(text: str) -> dict[str, Any]:
    """A snapshot from Prometheus text (workers summed)."""
    from prometheus_client.parser import text_string_to_metric_families

    from api.metrics import BATCHES_AT_RISK
    from metrics.catalog import snapshot_from_families

    families = list(text_string_to_metric_families(text))
    snapshot = snapshot_from_families(families)
    for family in families:  # the service's own gauges (an API's /metrics has them)
        if family.name == BATCHES_AT_RISK and family.samples:
            snapshot["service"] = {"batches_deadline_at_risk": family.samples[0].value}
    return snapshot


def scrape(url: str, *, duration: float, interval: float, progress: bool = True,
           fetch: Any = None) -> dict[str, Any]:
    """Sample ``url`` over ``duration`` seconds and build one snapshot of the window."""
    import httpx
    from tqdm import tqdm

    def get(u: str) -> str:
        response = httpx.get(u, timeout=10.0, follow_redirects=True)
        response.raise_for_status()
        return response.text

    fetch = fetch or get
    samples: list[tuple[float, float, dict[str, Any]]] = []
    started = time.monotonic()
    with tqdm(total=round(duration), unit="s", desc="sampling", file=sys.stderr,
              disable=not progress or duration <= 0, leave=False) as bar:
        while True:
            samples.append((time.monotonic(), time.time(), parse_exposition(fetch(url))))
            elapsed = time.monotonic() - started
            bar.n = min(round(elapsed), bar.total)
            bar.refresh()
            # A window is the change between two samples: take a second one however slow the
            # first was (a loaded machine), unless no window was asked for.
            if elapsed >= duration and (len(samples) >= 2 or duration <= 0):
                break
            time.sleep(min(interval, max(duration - elapsed, 0.0)))
    return window_snapshot(samples)


def window_snapshot(samples: list[tuple[float, float, dict[str, Any]]]) -> dict[str, Any]:
    """One snapshot of what happened between the first and last of timed samples
    ``(monotonic, wall clock, snapshot)``."""
    from metrics.snapshot import delta_snapshot

    last = samples[-1][2]
    if len(samples) < 2:
        return last
    first = samples[0][2]
    delta = delta_snapshot(first, last, window_s=samples[-1][0] - samples[0][0])
    if "service" in last:  # gauges of the present: the last sample's
        delta["service"] = last["service"]
    steps = sum(delta["histograms"][k]["count"] for k in ("prefill_step_s", "decode_step_s"))
    if steps == 0:
        last["note"] = "idle while sampled: the totals since the workers started"
        return last
    timeline = []
    for (t0, _, a), (t1, wall, b) in zip(samples, samples[1:], strict=False):
        step = delta_snapshot(a, b)
        hist = step["histograms"]["step_requests"]
        dt = max(t1 - t0, 1e-9)
        timeline.append({
            "t": wall, "running": b["gauges"]["running"], "waiting": b["gauges"]["waiting"],
            "kv_usage": b["gauges"]["kv_usage"],
            "batch_size": hist["sum"] / hist["count"] if hist["count"] else 0.0,
            "steps": sum(step["histograms"][k]["count"]
                         for k in ("prefill_step_s", "decode_step_s")),
            "generation_tokens_per_s": step["counters"]["generation_tokens"] / dt,
            "prompt_tokens_per_s": step["counters"]["prompt_tokens"] / dt,
        })
    delta["timeline"] = timeline
    return delta


def format_report(findings: list[Any], skipped: dict[str, str], snapshot: dict[str, Any],
                  source: str) -> str:
    counters, hists = snapshot.get("counters", {}), snapshot.get("histograms", {})
    steps = sum(hists.get(k, {}).get("count", 0) for k in ("prefill_step_s", "decode_step_s"))
    window = snapshot.get("window_s")
    lines = [f"source: {source}: {steps:.0f} engine steps, "
             f"{counters.get('requests_finished', 0):.0f} finished requests"
             + (f" over {window:.1f} s" if window else "")]
    if snapshot.get("note"):
        lines.append(f"note: {snapshot['note']}")
    if not findings:
        lines.append("no problems found")
    for f in findings:
        lines += ["", f"[{f.severity}] {f.rule}: {f.title}", f"  evidence: {f.evidence}",
                  f"  remedy:   {f.remedy}"]
    if skipped:
        lines += ["", "not evaluated: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())]
    return "\n".join(lines)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from cli.doctor import diagnose_report

    source = args.source or DEFAULT_URL
    try:
        if source.startswith(("http://", "https://")):
            snapshot = scrape(source, duration=args.duration, interval=args.interval,
                              progress=not args.json)
        else:
            snapshot = load_file(source)
    except Exception as exc:  # unreadable file, unreachable URL: say so, plainly
        print(f"boxcar doctor: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    if args.save:
        Path(args.save).write_text(json.dumps(snapshot, indent=1) + "\n", encoding="utf-8")
    findings, skipped = diagnose_report(snapshot)
    if args.json:
        print(json.dumps({"source": source, "findings": [f.as_dict() for f in findings],
                          "not_evaluated": skipped}, indent=2))
    else:
        print(format_report(findings, skipped, snapshot, source))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    doctor = subparsers.add_parser(
        "doctor", help="diagnose serving problems from live or saved metrics",
        description="Check a metrics snapshot for the eight classic serving failures (small "
        "batches, prefill stalls, KV exhaustion, host-bound steps, recomputed prefixes, slow "
        "first tokens, overload, uneven decodes) and for batches about to miss their deadline, "
        "and print evidence and remedies.")
    doctor.add_argument("source", nargs="?", default=None,
                        help="a boxcar run --metrics-json file, a saved snapshot, or a /metrics "
                        f"URL (default: {DEFAULT_URL})")
    doctor.add_argument("--duration", type=float, default=10.0,
                        help="seconds to sample a URL for (default 10; 0: one scrape)")
    doctor.add_argument("--interval", type=float, default=1.0,
                        help="seconds between samples of a URL")
    doctor.add_argument("--save", default=None, help="also write the snapshot used here")
    doctor.add_argument("--json", action="store_true", help="findings as JSON")
    doctor.set_defaults(handler=_cmd_doctor)
