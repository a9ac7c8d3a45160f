"""The engine's metrics, recorded on the worker: ``EngineRecorder`` and ``MeteredEngine``.

``MeteredEngine`` wraps an engine for whoever drives it (the drain loop, ``boxcar run``): it
times each ``step()``, reads ``get_stats()`` after it, and hands finished requests on. The
recorder turns the deltas of ``EngineStats`` (tokens, batch size and scheduled tokens per step,
prefill and decode model time, preemptions, prefix cache lookups) and each finished request's
``RequestMetrics`` (TTFT, TPOT, queue time, end-to-end, lengths) into one snapshot
(``metrics.catalog``), and is itself a prometheus_client collector of that snapshot.
It fits what a step costs (``step_cost``, for the worker's forecast: ``metrics.forecast``).
It also notices repeated prompt prefixes on its own (a chained hash per full block, as the prefix
cache keys them), so ``boxcar doctor`` can tell recomputed prefixes even with the cache off.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from metrics.catalog import ForwardCollector, empty_snapshot, families_from_snapshots
from metrics.forecast import StepCost

if TYPE_CHECKING:  # the engine's contracts, for the types only: importing engine costs nothing
    from engine.config import EngineConfig
    from engine.outputs import EngineStats, RequestOutput, RequestProgress
    from engine.pooling_params import EmbeddingInputs, EmbeddingSpec, PoolingParams
    from engine.protocol import ChatTemplate, Engine, Prompt
    from engine.sampling_params import SamplingParams

# Timeline points: one a second, five minutes of them (the dashboard's charts, doctor rule 7).
TIMELINE_INTERVAL_S = 1.0
TIMELINE_LEN = 300
# Prefix block hashes remembered to spot repeated prefixes (~100 bytes each: a few MiB).
MAX_PREFIX_HASHES = 65536

CONFIG_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_chunked_prefill",
                 "enable_prefix_caching", "watermark", "device", "enforce_eager")


def engine_config(engine: Engine) -> dict[str, Any]:
    """The settings of ``engine`` that the doctor's rules look at."""
    config = asdict(engine.config)
    return {**{name: config[name] for name in CONFIG_FIELDS},
            "model_name": engine.model_name, "max_model_len": engine.max_model_len}


def _observe(hist: dict[str, Any], value: float, weight: float = 1.0) -> None:
    hist["counts"][bisect.bisect_left(hist["bounds"], value)] += weight
    hist["sum"] += value * weight
    hist["count"] += weight


class EngineRecorder:
    """Engine metrics as one snapshot; thread-safe (the engine thread writes, others read)."""

    def __init__(self, config: dict[str, Any] | None = None, *,
                 timeline_interval: float = TIMELINE_INTERVAL_S) -> None:
        self._lock = threading.Lock()
        self._snap = empty_snapshot()
        self._snap["config"] = dict(config or {})
        self._config = self._snap["config"]
        self._prev: EngineStats | None = None
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._timeline: deque[dict[str, Any]] = deque(maxlen=TIMELINE_LEN)
        self._timeline_interval = timeline_interval
        self._started = time.monotonic()
        self._tick_at = self._started
        self._tick_counters = (0.0, 0.0)
        self._tick_steps = 0
        self._tick_requests = 0.0
        self.step_cost = StepCost()  # what a step costs, for the worker's forecast

    # -- the engine thread --------------------------------------------------------------------

    def observe_step(self, *, duration: float, gap: float | None, stats: EngineStats) -> None:
        """One ``step()`` that took ``duration`` s, ``gap`` s after the previous one ended (None
        after idleness), followed by ``stats``."""
        with self._lock:
            snap = self._snap
            counters, gauges, hists = snap["counters"], snap["gauges"], snap["histograms"]
            cycle = duration + (gap or 0.0)
            counters["busy_s"] += cycle
            if gap is not None:
                _observe(hists["step_gap_s"], gap)
            prev = self._prev
            self._prev = stats

            def delta(name: str) -> float:
                return getattr(stats, name) - (getattr(prev, name) if prev is not None else 0)

            num_steps = delta("num_steps")
            num_prompt, num_generated = delta("num_prompt_tokens"), delta("num_generated_tokens")
            counters["prompt_tokens"] += num_prompt
            counters["generation_tokens"] += num_generated
            counters["preemptions"] += delta("num_preemptions")
            counters["prefix_cache_queries"] += delta("prefix_cache_queries")
            counters["prefix_cache_hits"] += delta("prefix_cache_hits")
            counters["prefill_model_s"] += delta("prefill_time")
            counters["decode_model_s"] += delta("decode_time")
            step_tokens = self._hist_delta(hists["step_tokens"], stats.scheduled_tokens_hist,
                                           prev.scheduled_tokens_hist if prev else {})
            step_requests = self._hist_delta(hists["step_requests"], stats.batch_size_hist,
                                             prev.batch_size_hist if prev else {})
            gauges["running"] = stats.num_running
            gauges["waiting"] = stats.num_waiting
            gauges["kv_usage"] = stats.kv_usage
            gauges["kv_usage_peak"] = max(gauges["kv_usage_peak"], stats.kv_usage)
            gauges["kv_blocks"] = stats.num_kv_blocks
            if num_steps == 1:
                self.step_cost.observe(cycle, num_decode=num_generated, num_prefill=num_prompt)
            if num_steps > 0:
                phase = "prefill_step_s" if num_prompt > 0 else "decode_step_s"
                _observe(hists[phase], duration)
                if num_generated > 0:
                    _observe(hists["itl_s"], cycle, num_generated)
                budget = self._config.get("max_num_batched_tokens")
                seats = self._config.get("max_num_seqs")
                if (stats.num_waiting > 0 and seats is not None and stats.num_running < seats
                        and budget is not None and step_tokens < budget):
                    counters["admission_blocked_steps"] += num_steps
                self._tick_steps += int(num_steps)
                self._tick_requests += step_requests
            self._maybe_tick()

    @staticmethod
    def _hist_delta(hist: dict[str, Any], now: dict[int, int], before: dict[int, int]) -> float:
        """Observe the steps ``now`` has beyond ``before``; returns the (last) value seen."""
        total = 0.0
        for value, count in now.items():
            added = count - before.get(value, 0)
            if added > 0:
                _observe(hist, float(value), added)
                total += value * added
        return total

    def observe_request(self, output: RequestOutput) -> None:
        """A finished ``RequestOutput`` (aborted ones are left out)."""
        if not output.finished or output.finish_reason == "abort":
            return
        metrics = output.metrics
        num_prompt = metrics.num_prompt_tokens or len(output.prompt_token_ids)
        with self._lock:
            counters, hists = self._snap["counters"], self._snap["histograms"]
            counters["requests_finished"] += 1
            counters["prompt_tokens_cached"] += metrics.num_cached_tokens
            counters["prompt_tokens_repeated"] += self._repeated(output.prompt_token_ids)
            for key, value in (("ttft_s", metrics.ttft), ("tpot_s", metrics.tpot),
                               ("queue_time_s", metrics.queue_time),
                               ("e2e_latency_s", metrics.e2e_latency)):
                if value is not None:
                    _observe(hists[key], max(value, 0.0))
            if metrics.ttft is not None and metrics.queue_time is not None:
                _observe(hists["prefill_latency_s"], max(metrics.ttft - metrics.queue_time, 0.0))
            _observe(hists["request_prompt_tokens"], float(num_prompt))
            _observe(hists["request_generation_tokens"], float(metrics.num_generated_tokens))

    def observe_rejected(self) -> None:
        with self._lock:
            self._snap["counters"]["requests_rejected"] += 1

    def observe_claims(self, attempts: int, won: int, lost: int = 0) -> None:
        """A claim statement (the lease thread): shards asked for, shards won, and the wanted
        shards another worker had (``worker.claims.num_lost``)."""
        with self._lock:
            counters = self._snap["counters"]
            counters["shard_claim_attempts"] += attempts
            counters["shard_claims"] += won
            counters["shard_claim_statements"] += 1
            counters["shard_claims_lost"] += lost
            counters["shard_claim_statements_contended"] += lost > 0

    def _repeated(self, token_ids: list[int]) -> int:
        """Tokens in full blocks whose whole prefix an earlier prompt had (the part a prefix
        cache could have served: never the last token, which must be computed)."""
        block_size = int(self._config.get("block_size") or 16)
        parent = 0
        repeated = 0
        for i in range((len(token_ids) - 1) // block_size):
            parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
            if parent in self._seen:
                self._seen.move_to_end(parent)
                repeated += block_size
            else:
                self._seen[parent] = None
                if len(self._seen) > MAX_PREFIX_HASHES:
                    self._seen.popitem(last=False)
        return repeated

    # -- any thread ---------------------------------------------------------------------------

    def tick(self) -> None:
        """Add a timeline point if one is due (the publisher calls it: idle time shows too)."""
        with self._lock:
            self._maybe_tick()

    def _maybe_tick(self) -> None:
        now = time.monotonic()
        if now - self._tick_at >= self._timeline_interval:
            self._tick(now)

    def _tick(self, now: float) -> None:
        counters, gauges = self._snap["counters"], self._snap["gauges"]
        elapsed = max(now - self._tick_at, 1e-9)
        generated, prompt = counters["generation_tokens"], counters["prompt_tokens"]
        last_generated, last_prompt = self._tick_counters
        steps = self._tick_steps
        self._timeline.append({
            "t": round(time.time(), 3),
            "running": gauges["running"],
            "waiting": gauges["waiting"],
            "kv_usage": round(gauges["kv_usage"], 4),
            "batch_size": round(self._tick_requests / steps, 2) if steps else 0.0,
            "steps": steps,
            "generation_tokens_per_s": round((generated - last_generated) / elapsed, 2),
            "prompt_tokens_per_s": round((prompt - last_prompt) / elapsed, 2),
        })
        self._tick_at = now
        self._tick_counters = (generated, prompt)
        self._tick_steps = 0
        self._tick_requests = 0.0

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the numbers so far, with the timeline and the seconds they cover."""
        import copy

        with self._lock:
            snap = copy.deepcopy(self._snap)
            snap["timeline"] = list(self._timeline)
            snap["window_s"] = round(time.monotonic() - self._started, 3)
        return snap

    def collect(self) -> Iterator[Any]:
        """prometheus_client's collector protocol: this recorder's families."""
        yield from families_from_snapshots([({}, self.snapshot())])


class MeteredEngine:
    """``engine`` with its steps, finished requests and refusals reported to ``recorder``; an
    ``Engine`` itself, every other member the engine's own."""

    def __init__(self, engine: Engine, recorder: EngineRecorder) -> None:
        self._engine = engine
        self.recorder = recorder
        self._last_end: float | None = None  # when the last step ended with work left

    # -- metered ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0, rank: int = 0,
                    lora_name: str | None = None) -> None:
        try:
            self._engine.add_request(request_id, prompt, params, arrival_time=arrival_time,
                                     priority=priority, rank=rank, lora_name=lora_name)
        except ValueError:
            self.recorder.observe_rejected()
            raise

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        gap = start - self._last_end if self._last_end is not None else None
        outputs = self._engine.step()
        duration = time.perf_counter() - start
        self.recorder.observe_step(duration=duration, gap=gap, stats=self._engine.get_stats())
        for output in outputs:
            self.recorder.observe_request(output)
        self._last_end = time.perf_counter() if self._engine.has_unfinished_requests() else None
        return outputs

    # -- the engine's own ---------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._engine.chat_template

    @property
    def startup_seconds(self) -> dict[str, float]:
        return self._engine.startup_seconds

    @property
    def num_unfinished_requests(self) -> int:
        return self._engine.num_unfinished_requests

    @property
    def lora_names(self) -> list[str]:
        return self._engine.lora_names

    @property
    def is_embedding(self) -> bool:
        return self._engine.is_embedding

    @property
    def embedding(self) -> EmbeddingSpec | None:
        return self._engine.embedding

    def check_embedding(self, inputs: Any, params: PoolingParams) -> EmbeddingInputs:
        return self._engine.check_embedding(inputs, params)

    def add_lora(self, name: str, path: str) -> None:
        self._engine.add_lora(name, path)

    def encode(self, prompt: str) -> list[int]:
        return self._engine.encode(prompt)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._engine.decode(token_ids, skip_special_tokens)

    def special_token_id(self, token: str) -> int | None:
        return self._engine.special_token_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._engine.apply_chat_template(messages, tools=tools)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        return self._engine.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self._engine.has_unfinished_requests()

    def progress(self) -> list[RequestProgress]:
        return self._engine.progress()

    def get_stats(self) -> EngineStats:
        return self._engine.get_stats()


def worker_registry(recorder: EngineRecorder) -> Any:
    """What a worker's own /metrics port serves: the process's counters and its engine's."""
    from prometheus_client import REGISTRY, CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(ForwardCollector(REGISTRY))
    registry.register(recorder)  # type: ignore[arg-type]
    return registry
