"""The engine's metric families: one table that names them, and the snapshot they fill.

A worker's recorder (``metrics.recorder``) keeps its numbers as a *snapshot*, a plain JSON dict::

    {"version": 1, "counters": {key: n}, "gauges": {key: x},
     "histograms": {key: {"bounds": [..], "counts": [.. one per bound, then +Inf], "sum", "count"}},
     "config": {max_num_seqs, ...}, "timeline": [{t, running, waiting, ...}], "window_s": s}

The same snapshot is what ``boxcar run --metrics-json`` saves, what a worker writes to the database
for the API (its /metrics and the /ui dashboard), and what ``boxcar doctor`` reads back from a
/metrics page. This module turns snapshots into Prometheus families and back; it lives in api/
because both the API and the workers use it (api/ imports neither engine/ nor worker/).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

SNAPSHOT_VERSION = 1

# Latency buckets (seconds): 1 ms to 80 s, about three per decade, so P50/P95/P99 estimated from
# them are within one bucket's width of the truth from a fast decode up to a queued bulk request.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Per-token and per-step times (seconds): 0.25 ms (a CUDA-graph decode) to 10 s (a huge prefill).
STEP_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03,
                0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# Token counts: powers of two up to a 128k context.
TOKEN_BUCKETS = tuple(float(1 << i) for i in range(18))
# Requests per step: powers of two up to 1024 sequences.
BATCH_BUCKETS = tuple(float(1 << i) for i in range(11))

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One snapshot key and the Prometheus family (and fixed labels) it is exposed as."""

    key: str
    name: str  # counters without the ``_total`` suffix, as prometheus_client names families
    kind: Kind
    help: str
    buckets: tuple[float, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    aggregate: Literal["sum", "max"] = "sum"  # how gauges of several workers combine


def _c(key: str, name: str, help: str, **kw: Any) -> MetricSpec:
    return MetricSpec(key, name, "counter", help, **kw)


def _g(key: str, name: str, help: str, **kw: Any) -> MetricSpec:
    return MetricSpec(key, name, "gauge", help, **kw)


def _h(key: str, name: str, help: str, buckets: tuple[float, ...], **kw: Any) -> MetricSpec:
    return MetricSpec(key, name, "histogram", help, buckets, **kw)


ENGINE_METRICS: tuple[MetricSpec, ...] = (
    _c("prompt_tokens", "boxcar_prompt_tokens",
       "Prompt tokens computed (prefill, recomputation after preemption included)"),
    _c("generation_tokens", "boxcar_generation_tokens", "Tokens generated"),
    _c("requests_finished", "boxcar_requests_finished", "Requests that finished (not aborted)"),
    _c("requests_rejected", "boxcar_requests_rejected", "Requests the engine refused at admission"),
    _c("preemptions", "boxcar_preemptions", "Requests preempted to free KV cache blocks"),
    _c("prefix_cache_queries", "boxcar_prefix_cache_queries",
       "Prompt tokens looked up in the prefix cache"),
    _c("prefix_cache_hits", "boxcar_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    _c("prompt_tokens_cached", "boxcar_prompt_tokens_cached",
       "Prompt tokens of finished requests served from the prefix cache"),
    _c("prompt_tokens_repeated", "boxcar_prompt_tokens_repeated",
       "Prompt tokens of finished requests in full blocks whose prefix an earlier request had"),
    _c("admission_blocked_steps", "boxcar_engine_admission_blocked_steps",
       "Steps that left requests waiting although seats and token budget were free"),
    _c("busy_s", "boxcar_engine_busy_seconds",
       "Wall time of the engine loop while it had work (steps and the gaps between them)"),
    _c("prefill_model_s", "boxcar_engine_model_seconds",
       "Time in the model runner, split by phase", labels={"phase": "prefill"}),
    _c("decode_model_s", "boxcar_engine_model_seconds",
       "Time in the model runner, split by phase", labels={"phase": "decode"}),
    # The worker's claims (not the engine's), in the same snapshot so the API's /metrics sums
    # them over workers: their ratio is how often workers collide (bench/scale.py reads both).
    _c("shard_claim_attempts", "boxcar_shard_claim_attempts",
       "Shards a worker asked for in its claim statements"),
    _c("shard_claims", "boxcar_shard_claims", "Shards a worker's claim statements won"),
    # Contention, which the two above hide (a claim makes up for a lost shard with another):
    # the wanted shards another worker's claim held (SKIP LOCKED passed over) or had taken.
    _c("shard_claim_statements", "boxcar_shard_claim_statements",
       "Claim statements a worker ran"),
    _c("shard_claims_lost", "boxcar_shard_claims_lost",
       "Shards a worker's claim statements wanted and another worker had"),
    _c("shard_claim_statements_contended", "boxcar_shard_claim_statements_contended",
       "Claim statements that lost at least one wanted shard to another worker"),
    _g("running", "boxcar_requests_running", "Requests running in the engine"),
    _g("waiting", "boxcar_requests_waiting", "Requests waiting in the engine"),
    _g("kv_usage", "boxcar_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
       aggregate="max"),
    _g("kv_usage_peak", "boxcar_kv_cache_usage_peak_ratio",
       "Highest fraction of KV cache blocks in use since start", aggregate="max"),
    _g("kv_blocks", "boxcar_kv_cache_blocks", "KV cache blocks"),
    _h("ttft_s", "boxcar_time_to_first_token_seconds",
       "Time from arrival in the engine to the first token", LATENCY_BUCKETS),
    _h("tpot_s", "boxcar_time_per_output_token_seconds",
       "Mean time per output token after the first, per request", STEP_BUCKETS),
    _h("itl_s", "boxcar_inter_token_latency_seconds",
       "Time between a request's consecutive tokens: the step cycle each sampled token waited",
       STEP_BUCKETS),
    _h("queue_time_s", "boxcar_request_queue_time_seconds",
       "Time from arrival in the engine to the first scheduled step", LATENCY_BUCKETS),
    _h("prefill_latency_s", "boxcar_request_prefill_time_seconds",
       "Time from the first scheduled step to the first token", LATENCY_BUCKETS),
    _h("e2e_latency_s", "boxcar_e2e_request_latency_seconds",
       "Time from arrival in the engine to the last token", LATENCY_BUCKETS),
    _h("request_prompt_tokens", "boxcar_request_prompt_tokens",
       "Prompt length of finished requests", TOKEN_BUCKETS),
    _h("request_generation_tokens", "boxcar_request_generation_tokens",
       "Output length of finished requests", TOKEN_BUCKETS),
    _h("step_requests", "boxcar_engine_step_requests", "Requests in one engine step (batch size)",
       BATCH_BUCKETS),
    _h("step_tokens", "boxcar_engine_step_tokens", "Tokens scheduled in one engine step",
       TOKEN_BUCKETS),
    _h("prefill_step_s", "boxcar_engine_step_duration_seconds",
       "Wall time of one engine step; prefill: the step computed prompt tokens",
       STEP_BUCKETS, labels={"phase": "prefill"}),
    _h("decode_step_s", "boxcar_engine_step_duration_seconds",
       "Wall time of one engine step; prefill: the step computed prompt tokens",
       STEP_BUCKETS, labels={"phase": "decode"}),
    _h("step_gap_s", "boxcar_engine_step_gap_seconds",
       "Host time between the end of a step and the start of the next while work was pending",
       STEP_BUCKETS),
)
SPECS = {spec.key: spec for spec in ENGINE_METRICS}
CONFIG_FAMILY = "boxcar_engine_config"  # an info metric: the engine's settings as labels


def empty_histogram(bounds: tuple[float, ...]) -> dict[str, Any]:
    return {"bounds": list(bounds), "counts": [0.0] * (len(bounds) + 1), "sum": 0.0, "count": 0.0}


def empty_snapshot() -> dict[str, Any]:
    return {
        "version": SNAPSHOT_VERSION,
        "counters": {s.key: 0.0 for s in ENGINE_METRICS if s.kind == "counter"},
        "gauges": {s.key: 0.0 for s in ENGINE_METRICS if s.kind == "gauge"},
        "histograms": {s.key: empty_histogram(s.buckets) for s in ENGINE_METRICS
                       if s.kind == "histogram"},
        "config": {},
        "timeline": [],
        "window_s": None,
    }


# ---- snapshot -> Prometheus ---------------------------------------------------------------------


def families_from_snapshots(snapshots: list[tuple[dict[str, str], dict[str, Any]]]) -> list:
    """Prometheus families for ``(labels, snapshot)`` pairs, e.g. one per worker."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )

    families: dict[str, Any] = {}
    kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
             "histogram": HistogramMetricFamily}
    for labels, snapshot in snapshots:
        for spec in ENGINE_METRICS:
            names = [*labels, *spec.labels]
            family = families.get(spec.name)
            if family is None:
                family = families[spec.name] = kinds[spec.kind](spec.name, spec.help,
                                                                labels=names)
            values = [*labels.values(), *spec.labels.values()]
            if spec.kind == "histogram":
                hist = snapshot.get("histograms", {}).get(spec.key)
                if hist is not None:
                    family.add_metric(values, _cumulative_buckets(hist), hist["sum"])
            else:
                section = "counters" if spec.kind == "counter" else "gauges"
                value = snapshot.get(section, {}).get(spec.key)
                if value is not None:
                    family.add_metric(values, float(value))
        config = snapshot.get("config") or {}
        if config:
            info = families.get(CONFIG_FAMILY)
            if info is None:
                info = families[CONFIG_FAMILY] = InfoMetricFamily(
                    CONFIG_FAMILY, "The engine's settings", labels=list(labels))
            info.add_metric(list(labels.values()), {k: str(v) for k, v in config.items()})
    return list(families.values())


def _cumulative_buckets(hist: dict[str, Any]) -> list[tuple[str, float]]:
    total = 0.0
    buckets = []
    for bound, count in zip([*hist["bounds"], float("inf")], hist["counts"], strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return buckets


# ---- Prometheus -> snapshot ---------------------------------------------------------------------


def snapshot_from_families(families: Any) -> dict[str, Any]:
    """A snapshot from Prometheus families (``registry.collect()`` or the text parser's),
    summing counters and histograms over every other label (workers), gauges by their rule."""
    snapshot = empty_snapshot()
    by_name: dict[str, list[MetricSpec]] = {}
    for spec in ENGINE_METRICS:
        by_name.setdefault(spec.name, []).append(spec)
    seen_gauges: set[str] = set()
    cumulative: dict[str, dict[float, float]] = {}
    for family in families:
        name = family.name
        for sample in family.samples:
            if sample.name in (f"{CONFIG_FAMILY}_info", CONFIG_FAMILY):
                if not snapshot["config"]:
                    snapshot["config"] = {k: _parse_value(v) for k, v in sample.labels.items()
                                          if k != "worker"}
                continue
            for spec in by_name.get(_family_name(name, sample.name), ()):
                if any(sample.labels.get(k) != v for k, v in spec.labels.items()):
                    continue
                _add_sample(snapshot, spec, sample, seen_gauges, cumulative)
    for key, buckets in cumulative.items():
        hist = snapshot["histograms"][key]
        previous = 0.0
        counts = []
        for bound in [*hist["bounds"], float("inf")]:
            value = buckets.get(bound, previous)
            counts.append(max(value - previous, 0.0))
            previous = value
        hist["counts"] = counts
    return snapshot


def _family_name(family: str, sample: str) -> str:
    for suffix in ("_total", "_created", "_bucket", "_sum", "_count"):
        if sample.endswith(suffix) and sample[: -len(suffix)] == family:
            return family
    # The text parser names a counter family ``x`` for ``x_total``; a gauge keeps its name.
    return family.removesuffix("_total")


def _add_sample(snapshot: dict, spec: MetricSpec, sample: Any, seen_gauges: set[str],
                cumulative: dict[str, dict[float, float]]) -> None:
    value = float(sample.value)
    if spec.kind == "counter":
        if sample.name.endswith("_total"):
            snapshot["counters"][spec.key] += value
    elif spec.kind == "gauge":
        gauges = snapshot["gauges"]
        if spec.key not in seen_gauges:
            gauges[spec.key] = value
            seen_gauges.add(spec.key)
        elif spec.aggregate == "max":
            gauges[spec.key] = max(gauges[spec.key], value)
        else:
            gauges[spec.key] += value
    else:
        hist = snapshot["histograms"][spec.key]
        if sample.name.endswith("_sum"):
            hist["sum"] += value
        elif sample.name.endswith("_count"):
            hist["count"] += value
        elif sample.name.endswith("_bucket"):
            # Cumulative on the wire, per bucket in a snapshot: differenced at the end.
            buckets = cumulative.setdefault(spec.key, {})
            le = float(sample.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value


def _parse_value(text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


class ForwardCollector:
    """Another registry's families, so one endpoint serves both (prometheus_client protocol)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        yield from self._registry.collect()
