"""Arithmetic on metric snapshots (``metrics.catalog``): quantiles from histogram buckets,
several workers merged into one, the difference of two snapshots taken some seconds apart."""

from __future__ import annotations

import copy
import math
from typing import Any

from metrics.catalog import SPECS, empty_snapshot


def quantile(hist: dict[str, Any] | None, q: float) -> float | None:
    """The q-quantile (0..1) estimated from buckets as Prometheus' ``histogram_quantile`` does:
    linear inside the bucket that holds it; the last finite bound when it falls in +Inf."""
    if not hist or hist["count"] <= 0:
        return None
    bounds = hist["bounds"]
    rank = q * hist["count"]
    seen = 0.0
    for i, count in enumerate(hist["counts"]):
        if count <= 0 or seen + count < rank:
            seen += count
            continue
        if i >= len(bounds):
            return float(bounds[-1])
        lower = float(bounds[i - 1]) if i > 0 else 0.0
        return lower + (float(bounds[i]) - lower) * max(rank - seen, 0.0) / count
    return float(bounds[-1])


def mean(hist: dict[str, Any] | None) -> float | None:
    if not hist or hist["count"] <= 0:
        return None
    return hist["sum"] / hist["count"]


def top(hist: dict[str, Any] | None) -> float | None:
    """The upper bound of the highest non-empty bucket (the largest value seen, rounded up)."""
    if not hist or hist["count"] <= 0:
        return None
    for i in range(len(hist["counts"]) - 1, -1, -1):
        if hist["counts"][i] > 0:
            return float(hist["bounds"][min(i, len(hist["bounds"]) - 1)])
    return None


def histogram_percentiles(hist: dict[str, Any] | None) -> dict[str, float | None]:
    """P50/P95/P99 and the mean, estimated from a histogram's buckets (``quantile``)."""
    return {"p50": quantile(hist, 0.50), "p95": quantile(hist, 0.95),
            "p99": quantile(hist, 0.99), "mean": mean(hist)}


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several workers as one engine: counters and histograms add up, gauges by their rule
    (running and waiting add, KV usage takes the fullest worker), timelines add per second."""
    merged = empty_snapshot()
    if not snapshots:
        return merged
    for i, snapshot in enumerate(snapshots):
        for key, value in snapshot.get("counters", {}).items():
            merged["counters"][key] = merged["counters"].get(key, 0.0) + value
        for key, value in snapshot.get("gauges", {}).items():
            spec = SPECS.get(key)
            if i == 0 or key not in merged["gauges"]:
                merged["gauges"][key] = value
            elif spec is not None and spec.aggregate == "max":
                merged["gauges"][key] = max(merged["gauges"][key], value)
            else:
                merged["gauges"][key] += value
        for key, hist in snapshot.get("histograms", {}).items():
            target = merged["histograms"].get(key)
            if target is None or target["bounds"] != hist["bounds"]:
                merged["histograms"][key] = copy.deepcopy(hist)
                continue
            target["counts"] = [a + b for a, b in zip(target["counts"], hist["counts"],
                                                      strict=True)]
            target["sum"] += hist["sum"]
            target["count"] += hist["count"]
    merged["config"] = dict(snapshots[0].get("config") or {})
    merged["timeline"] = merge_timelines([s.get("timeline") or [] for s in snapshots])
    windows = [s.get("window_s") for s in snapshots if s.get("window_s")]
    merged["window_s"] = max(windows) if windows else None
    return merged


def merge_timelines(timelines: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Points of several workers summed per whole second (KV usage: the fullest)."""
    if len(timelines) == 1:
        return list(timelines[0])
    by_second: dict[int, dict[str, Any]] = {}
    for timeline in timelines:
        for point in timeline:
            second = math.floor(point["t"])
            into = by_second.get(second)
            if into is None:
                by_second[second] = dict(point, t=float(second))
                continue
            for key, value in point.items():
                if key == "t" or not isinstance(value, int | float):
                    continue
                if key == "kv_usage":
                    into[key] = max(into.get(key, 0.0), value)
                else:
                    into[key] = into.get(key, 0.0) + value
    return [by_second[s] for s in sorted(by_second)]


def delta_snapshot(before: dict[str, Any], after: dict[str, Any],
                   window_s: float | None = None) -> dict[str, Any]:
    """What happened between two snapshots of the same source: counters and histograms
    subtract, gauges and config are the later ones'."""
    delta = copy.deepcopy(after)
    for key, value in after.get("counters", {}).items():
        delta["counters"][key] = max(value - before.get("counters", {}).get(key, 0.0), 0.0)
    for key, hist in after.get("histograms", {}).items():
        old = before.get("histograms", {}).get(key)
        if old is None or old["bounds"] != hist["bounds"]:
            continue
        target = delta["histograms"][key]
        target["counts"] = [max(a - b, 0.0) for a, b in zip(hist["counts"], old["counts"],
                                                            strict=True)]
        target["sum"] = max(hist["sum"] - old["sum"], 0.0)
        target["count"] = max(hist["count"] - old["count"], 0.0)
    delta["window_s"] = window_s
    return delta
