"""metrics.recorder: the recorder's arithmetic on EngineStats deltas and finished requests, the
Prometheus round trip, the metered engine (fake and real), and the worker publishing its
snapshot for the API (/metrics, /ui/api/summary) and ``boxcar status``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cli.doctor_commands import parse_exposition, window_snapshot
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from engine.testing.fake_engine import FakeEngine
from metrics.catalog import ENGINE_METRICS, empty_snapshot, families_from_snapshots
from metrics.recorder import EngineRecorder, MeteredEngine, engine_config
from metrics.snapshot import delta_snapshot, merge_snapshots, quantile
from tests.conftest_services import chat_line, wait_for

CONFIG = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4,
          "enable_prefix_caching": True}


def stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_kv_blocks=100, num_free_kv_blocks=100,
                kv_usage=0.0, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                num_steps=0, num_prompt_tokens=0, num_generated_tokens=0, batch_size_hist={},
                scheduled_tokens_hist={})
    return EngineStats(**(base | kw))


def output(prompt: list[int], *, arrival: float = 0.0, scheduled: float = 0.5,
           first: float = 1.0, finished: float = 2.0, generated: int = 11, cached: int = 0,
           reason: str = "length") -> RequestOutput:
    metrics = RequestMetrics(arrival, scheduled, first, finished, len(prompt), cached, generated)
    completion = CompletionOutput(0, "x", [1] * generated, finish_reason=reason)
    return RequestOutput("r", None, prompt, [completion], True, metrics)


def test_recorder_turns_stats_deltas_into_step_metrics() -> None:
    recorder = EngineRecorder(CONFIG)
    # Step 1: a prefill of 2 requests (40 prompt tokens, 2 first tokens), nothing waiting.
    s1 = stats(num_steps=1, num_prompt_tokens=40, num_generated_tokens=2, num_running=2,
               batch_size_hist={2: 1}, scheduled_tokens_hist={42: 1}, prefill_time=0.01,
               kv_usage=0.5)
    recorder.observe_step(duration=0.02, gap=None, stats=s1)
    # Step 2: two decodes, one request waits although seats and budget are free (KV full).
    s2 = replace(s1, num_steps=2, num_generated_tokens=4, num_waiting=1, kv_usage=0.95,
                 batch_size_hist={2: 2}, scheduled_tokens_hist={42: 1, 2: 1},
                 decode_time=0.003, num_preemptions=1)
    recorder.observe_step(duration=0.004, gap=0.001, stats=s2)
    snap = recorder.snapshot()
    c, g, h = snap["counters"], snap["gauges"], snap["histograms"]
    assert c["prompt_tokens"] == 40 and c["generation_tokens"] == 4 and c["preemptions"] == 1
    assert c["prefill_model_s"] == pytest.approx(0.01)
    assert c["decode_model_s"] == pytest.approx(0.003)
    assert c["busy_s"] == pytest.approx(0.025)
    assert c["admission_blocked_steps"] == 1
    assert h["prefill_step_s"]["count"] == 1 and h["decode_step_s"]["count"] == 1
    assert h["step_requests"]["count"] == 2 and h["step_requests"]["sum"] == 4
    assert h["step_tokens"]["sum"] == 44
    assert h["step_gap_s"]["count"] == 1
    # Each sampled token waited its step's cycle: 2 tokens x 20 ms, 2 tokens x 5 ms.
    assert h["itl_s"]["count"] == 4 and h["itl_s"]["sum"] == pytest.approx(0.05)
    assert g["waiting"] == 1 and g["kv_usage_peak"] == 0.95 and g["kv_blocks"] == 100
    json.dumps(snap)  # a snapshot is plain JSON
    # Each step's cycle, decodes and prefill tokens feed the forecast's step cost.
    assert len(recorder.step_cost) == 2


def test_recorder_requests_and_repeated_prefixes() -> None:
    recorder = EngineRecorder(CONFIG)  # block_size 4
    system = list(range(100, 112))  # three full blocks shared
    recorder.observe_request(output(system + [1, 2, 3]))
    recorder.observe_request(output(system + [4, 5, 6], cached=8))
    recorder.observe_request(output([7, 8, 9, 10, 11], reason="abort"))  # left out
    snap = recorder.snapshot()
    c, h = snap["counters"], snap["histograms"]
    assert c["requests_finished"] == 2
    assert c["prompt_tokens_repeated"] == 12 and c["prompt_tokens_cached"] == 8
    assert h["ttft_s"]["sum"] == pytest.approx(2.0) and h["queue_time_s"]["count"] == 2
    assert h["prefill_latency_s"]["sum"] == pytest.approx(1.0)
    assert h["tpot_s"]["sum"] == pytest.approx(0.2)  # (2 - 1) / 10 per request
    assert h["request_prompt_tokens"]["sum"] == 30
    recorder.observe_rejected()
    assert recorder.snapshot()["counters"]["requests_rejected"] == 1


def test_prometheus_round_trip_and_snapshot_arithmetic() -> None:
    recorder = EngineRecorder(CONFIG)
    for i in range(1, 6):
        recorder.observe_step(duration=0.001 * i, gap=0.0005, stats=stats(
            num_steps=i, num_generated_tokens=3 * i, num_running=3, kv_usage=0.1 * i,
            batch_size_hist={3: i}, scheduled_tokens_hist={3: i}))
        recorder.observe_request(output([1, 2, 3, 4, 5], first=0.1 * i, finished=1.0))
    snap = recorder.snapshot()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(recorder)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert "boxcar_time_to_first_token_seconds_bucket" in text
    assert 'boxcar_engine_step_duration_seconds_count{phase="decode"} 5.0' in text
    assert "boxcar_engine_config_info{" in text
    for spec in ENGINE_METRICS:
        suffix = "_total" if spec.kind == "counter" else ""
        assert spec.name.startswith("boxcar_") and f"# TYPE {spec.name}{suffix} " in text
    back = parse_exposition(text)
    assert back["counters"] == pytest.approx(snap["counters"])
    assert back["gauges"] == pytest.approx(snap["gauges"])
    for key, hist in snap["histograms"].items():
        assert back["histograms"][key]["counts"] == hist["counts"], key
    assert back["config"]["max_num_seqs"] == 4 and back["config"]["enable_prefix_caching"] is True

    # Two workers: counters add, KV usage takes the fullest; deltas subtract.
    other = json.loads(json.dumps(snap))
    other["gauges"]["kv_usage"] = 0.9
    merged = merge_snapshots([snap, other])
    assert merged["counters"]["generation_tokens"] == 30 and merged["gauges"]["kv_usage"] == 0.9
    assert merged["gauges"]["running"] == 6
    assert delta_snapshot(snap, merged)["counters"]["generation_tokens"] == 15
    # Quantiles from buckets: TTFT 0.1..0.5 s.
    assert 0.2 <= quantile(snap["histograms"]["ttft_s"], 0.5) <= 0.4
    assert quantile(empty_snapshot()["histograms"]["ttft_s"], 0.5) is None


def test_window_snapshot_builds_a_timeline_from_samples() -> None:
    def sample(n: int) -> dict:
        snap = empty_snapshot()
        snap["counters"]["generation_tokens"] = 100.0 * n
        snap["histograms"]["decode_step_s"]["count"] = 10.0 * n
        snap["histograms"]["step_requests"].update(count=10.0 * n, sum=40.0 * n)
        snap["gauges"]["running"] = 4
        return snap

    window = window_snapshot([(float(i), 1000.0 + i, sample(i)) for i in range(4)])
    assert window["window_s"] == 3.0 and window["counters"]["generation_tokens"] == 300
    assert [p["generation_tokens_per_s"] for p in window["timeline"]] == [100.0] * 3
    assert window["timeline"][0]["batch_size"] == 4.0
    idle = window_snapshot([(0.0, 0.0, sample(1)), (1.0, 1.0, sample(1))])
    assert "idle" in idle["note"] and idle["counters"]["generation_tokens"] == 100


def test_metered_fake_engine_passes_through() -> None:
    engine = FakeEngine(max_num_seqs=2)
    metered = MeteredEngine(engine, EngineRecorder(engine_config(engine)))
    assert metered.model_name == "fake-model" and metered.config.max_num_seqs == 2
    from engine.sampling_params import SamplingParams

    for i in range(3):
        metered.add_request(f"r{i}", "abc", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        metered.add_request("bad", "TOO_LONG", SamplingParams(max_tokens=2))
    finished = []
    while metered.has_unfinished_requests():
        finished += metered.step()
    assert len(finished) == 3 and metered.num_unfinished_requests == 0
    snap = metered.recorder.snapshot()
    assert snap["counters"]["requests_finished"] == 3
    assert snap["counters"]["requests_rejected"] == 1
    hists, stats = snap["histograms"], engine.get_stats()
    # The fake's stats are read after every step, as the real engine's are.
    steps = hists["prefill_step_s"]["count"] + hists["decode_step_s"]["count"]
    assert steps == engine.num_steps == stats.num_steps == hists["step_requests"]["count"]
    assert snap["counters"]["generation_tokens"] == stats.num_generated_tokens == 3 * 2


def test_metered_real_engine_matches_its_stats(tiny_model_dir) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                    max_num_seqs=4, num_kv_blocks=64, num_threads=1))
    recorder = EngineRecorder(engine_config(engine))
    metered = MeteredEngine(engine, recorder)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(6):
        metered.add_request(f"r{i}", list(range(3, 40)) + [i], params)
    while metered.has_unfinished_requests():
        metered.step()
    snap, engine_stats = recorder.snapshot(), engine.get_stats()
    counters, hists = snap["counters"], snap["histograms"]
    assert counters["generation_tokens"] == engine_stats.num_generated_tokens == 36
    assert counters["prompt_tokens"] == engine_stats.num_prompt_tokens
    steps = hists["prefill_step_s"]["count"] + hists["decode_step_s"]["count"]
    assert steps == engine_stats.num_steps == hists["step_requests"]["count"]
    assert hists["ttft_s"]["count"] == 6 and hists["itl_s"]["count"] == 36
    # Five of six prompts repeat the first 32 tokens (two blocks of 16; the last token never).
    assert counters["prompt_tokens_repeated"] == 5 * 32
    assert snap["config"]["max_num_seqs"] == 4 and snap["config"]["model_name"]


def test_worker_publishes_for_api_metrics_dashboard_and_status(make_stack, sqlite_url) -> None:
    from api.status import collect
    from cli.status import format_status

    stack = make_stack(sqlite_url, worker_metrics_interval=0.1)
    worker = stack.add_worker(FakeEngine(max_num_seqs=4))
    batch = stack.create_batch([chat_line(f"c{i}", "hello there", max_tokens=3)
                                for i in range(10)])
    stack.wait_status(batch["id"], "completed")

    def published() -> dict | None:
        summary = stack.client.get("/ui/api/summary").json()
        engine = summary["engine"]
        return summary if engine["requests_finished"] == 10 else None

    summary = wait_for(published, 10, 0.05, "the worker's snapshot")
    assert summary["tenant"]["name"] == "acme" and len(summary["workers"]) == 1
    assert summary["batches"][0]["progress"] == 1.0 and summary["batches"][0]["total"] == 10
    assert summary["engine"]["distributions"]["ttft_s"]["counts"]

    text = stack.client.get("/metrics").text
    assert f'boxcar_requests_finished_total{{worker="{worker.worker_id}"}} 10.0' in text
    assert 'boxcar_batches{status="completed"} 1.0' in text
    assert "boxcar_workers 1.0" in text and "boxcar_queue_depth_lines 0.0" in text
    assert "boxcar_files_uploaded_total" in text  # the process's own counters still there
    assert parse_exposition(text)["counters"]["requests_finished"] == 10

    report = collect(stack.ctx.db, interval=0.1)
    assert report["batches"] == {"completed": 1} and len(report["workers"]) == 1
    assert "1 live" in format_status(report) and worker.worker_id in format_status(report)

    assert stack.client.get("/ui/api/summary", headers={"Authorization": "Bearer nope"}
                            ).status_code == 401
    page = stack.client.get("/ui")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert stack.client.get("/ui/dashboard.js").status_code == 200
    assert stack.client.get("/ui/secrets.txt").status_code == 404

    worker.stop()
    stack.workers.remove(worker)
    assert collect(stack.ctx.db, interval=0.1)["workers"] == []  # a clean stop leaves the list


def test_the_heartbeat_carries_the_forecast_and_survives_a_broken_one(make_stack,
                                                                      sqlite_url) -> None:
    from metrics.publisher import MetricsPublisher
    from service.models import WorkerStatus

    db = make_stack(sqlite_url).ctx.db
    forecast = {"at": 1.0, "batches": {}}
    publisher = MetricsPublisher(db, EngineRecorder(CONFIG), worker_id="w", model="m",
                                 interval=1.0, forecast=lambda: forecast)
    publisher.publish()
    with db.read_session() as session:
        assert session.get(WorkerStatus, "w").metrics["forecast"] == forecast

    def broken() -> dict:
        raise RuntimeError("no forecast")

    MetricsPublisher(db, EngineRecorder(CONFIG), worker_id="w2", model="m", interval=1.0,
                     forecast=broken).publish()
    with db.read_session() as session:
        row = session.get(WorkerStatus, "w2")
        assert row is not None and "forecast" not in row.metrics


def test_families_from_snapshots_labels_each_worker() -> None:
    snap = empty_snapshot()
    snap["counters"]["preemptions"] = 2
    families = families_from_snapshots([({"worker": "a"}, snap), ({"worker": "b"}, snap)])
    preemptions = next(f for f in families if f.name == "boxcar_preemptions")
    assert sorted(s.labels["worker"] for s in preemptions.samples if s.name.endswith("_total")
                  ) == ["a", "b"]
