"""boxcar doctor: every rule on synthetic snapshots (fires, and stays quiet just short of its
threshold), four rules on real engine runs configured to provoke them, and the command line."""

from __future__ import annotations

import bisect
import copy
import json
from pathlib import Path

import pytest

from cli import main as cli
from cli.doctor import diagnose, diagnose_report
from cli.doctor_commands import scrape
from metrics.catalog import empty_snapshot


def fill(snap: dict, key: str, *values: tuple[float, float]) -> None:
    """Put ``(value, weight)`` observations into histogram ``key``."""
    hist = snap["histograms"][key]
    for value, weight in values:
        hist["counts"][bisect.bisect_left(hist["bounds"], value)] += weight
        hist["sum"] += value * weight
        hist["count"] += weight


def healthy() -> dict:
    """A busy, well-configured engine: no rule fires."""
    snap = empty_snapshot()
    snap["config"] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16,
                      "enable_chunked_prefill": True, "enable_prefix_caching": True,
                      "watermark": 0.01}
    c, g = snap["counters"], snap["gauges"]
    c.update(requests_finished=2000, generation_tokens=200_000, prompt_tokens=1_000_000,
             busy_s=12.0, prefill_model_s=3.0, decode_model_s=8.0, preemptions=5,
             prompt_tokens_repeated=300_000, prompt_tokens_cached=280_000)
    g.update(running=48, waiting=3, kv_usage=0.6, kv_usage_peak=0.7, kv_blocks=4096)
    fill(snap, "decode_step_s", (0.009, 1000))
    fill(snap, "prefill_step_s", (0.014, 100))
    fill(snap, "step_gap_s", (0.0008, 1099))
    fill(snap, "step_requests", (48, 1100))
    fill(snap, "step_tokens", (300, 1100))
    fill(snap, "itl_s", (0.0095, 190_000), (0.016, 8_000))
    fill(snap, "tpot_s", (0.0098, 2000))
    fill(snap, "ttft_s", (0.3, 1900), (0.7, 100))
    fill(snap, "queue_time_s", (0.1, 2000))
    fill(snap, "prefill_latency_s", (0.2, 1900), (0.5, 100))
    fill(snap, "request_prompt_tokens", (500, 2000))
    snap["timeline"] = [{"t": 1000.0 + i, "running": 30 + i, "waiting": 0, "steps": 90,
                         "generation_tokens_per_s": 4000 + 50 * i, "kv_usage": 0.5,
                         "batch_size": 30 + i} for i in range(20)]
    return snap


def rules(snap: dict) -> list[str]:
    return [f.rule for f in diagnose(snap)]


def test_healthy_snapshot_has_no_findings_and_empty_one_is_not_evaluated() -> None:
    assert rules(healthy()) == []
    findings, skipped = diagnose_report(empty_snapshot())
    assert findings == [] and len(skipped) >= 6
    assert "engine steps" in skipped["kv-exhausted"]


def test_rule_1_unbatched() -> None:
    snap = healthy()
    snap["histograms"]["step_requests"] = empty_snapshot()["histograms"]["step_requests"]
    fill(snap, "step_requests", (1, 600), (2, 500))
    snap["timeline"] = []
    [finding] = diagnose(snap)
    assert finding.rule == "unbatched" and "1.5 requests per step" in finding.evidence
    assert "one at a time" in finding.remedy
    snap["counters"].update(requests_finished=5, preemptions=0)  # too few to have batched
    assert rules(snap) == []
    capped = healthy()
    capped["config"]["max_num_seqs"] = 2
    capped["histograms"]["step_requests"] = empty_snapshot()["histograms"]["step_requests"]
    fill(capped, "step_requests", (2, 1100))
    assert "max_num_seqs=2 caps" in diagnose(capped)[0].remedy


def test_rule_2_prefill_stalls() -> None:
    snap = healthy()
    snap["config"]["enable_chunked_prefill"] = False
    fill(snap, "itl_s", (0.3, 6000))  # 3% of tokens waited out a 300 ms step
    fill(snap, "prefill_step_s", (0.4, 20))
    [finding] = diagnose(snap)
    assert finding.rule == "prefill-stalls" and "chunked prefill off" in finding.evidence
    assert "turn chunked prefill on" in finding.remedy
    snap["config"]["enable_chunked_prefill"] = True
    assert "lower max_num_batched_tokens" in diagnose(snap)[0].remedy
    short = healthy()
    fill(short, "itl_s", (0.3, 6000))
    fill(short, "prefill_step_s", (0.03, 20))  # slow steps that are not prefills
    assert "prefill-stalls" not in rules(short)


def test_rule_3_kv_exhausted() -> None:
    snap = healthy()
    snap["counters"]["preemptions"] = 100
    assert "kv-exhausted" in rules(snap)
    starved = healthy()
    starved["counters"]["admission_blocked_steps"] = 100
    starved["gauges"]["kv_usage_peak"] = 0.97
    starved["config"]["watermark"] = 0.2
    finding = next(f for f in diagnose(starved) if f.rule == "kv-exhausted")
    assert finding.severity == "critical" and "97% of 4096 blocks" in finding.evidence
    assert "lower it" in finding.remedy
    roomy = healthy()
    roomy["counters"]["admission_blocked_steps"] = 100  # waiting, but the cache is not full
    assert rules(roomy) == []


def test_rule_4_host_bound() -> None:
    snap = healthy()
    snap["counters"]["decode_model_s"] = 3.0  # the model ran 6 of 12 busy seconds
    [finding] = diagnose(snap)
    assert finding.rule == "host-bound" and "50% went to the host" in finding.evidence
    snap["counters"]["decode_model_s"] = 6.0  # 75% in the model
    assert rules(snap) == []


def test_rule_5_prefix_recompute() -> None:
    snap = healthy()
    snap["config"]["enable_prefix_caching"] = False
    snap["counters"].update(prompt_tokens_repeated=600_000, prompt_tokens_cached=0)
    [finding] = diagnose(snap)
    assert finding.rule == "prefix-recompute" and "60% of prompt tokens" in finding.evidence
    assert "turn prefix caching on" in finding.remedy
    snap["counters"]["prompt_tokens_cached"] = 400_000  # two thirds reused: fine
    assert rules(snap) == []


def test_rule_6_slow_first_token() -> None:
    long_prefill = healthy()
    fill(long_prefill, "ttft_s", (3.0, 400))
    fill(long_prefill, "prefill_latency_s", (2.8, 400))
    [finding] = diagnose(long_prefill)
    assert finding.rule == "slow-first-token" and "long prefill" in finding.title
    window = healthy()
    fill(window, "ttft_s", (3.0, 400))
    fill(window, "queue_time_s", (2.9, 400))
    for point in window["timeline"]:
        point["running"] = 4
    [finding] = diagnose(window)
    assert "batching window" in finding.title and "4.0 of 64 seats" in finding.evidence
    full = copy.deepcopy(window)
    for point in full["timeline"]:
        point["running"] = 60  # queued behind a full engine: not this rule
    assert rules(full) == []


def test_rule_7_overload() -> None:
    snap = healthy()
    snap["timeline"] = (
        [{"t": i, "running": 20, "waiting": 0, "steps": 90, "generation_tokens_per_s": 5000}
         for i in range(5)]
        + [{"t": 5 + i, "running": 64, "waiting": 40, "steps": 90,
            "generation_tokens_per_s": 2000} for i in range(5)])
    [finding] = diagnose(snap)
    assert finding.rule == "overload" and "5000.0 tok/s" in finding.evidence
    for point in snap["timeline"][5:]:
        point["generation_tokens_per_s"] = 4500  # 90%: still scaling
    assert rules(snap) == []
    _, skipped = diagnose_report(dict(snap, timeline=snap["timeline"][:3]))
    assert "timeline points" in skipped["overload"]


def test_rule_8_uneven_decode() -> None:
    snap = healthy()
    fill(snap, "step_gap_s", (0.1, 50))  # 100 ms pauses against 9 ms decode steps
    [finding] = diagnose(snap)
    assert finding.rule == "uneven-decode" and "keep the engine thread stepping" in finding.remedy
    small = healthy()
    fill(small, "step_gap_s", (0.008, 50))  # under GAP_MIN_S
    assert rules(small) == []


def test_rule_9_deadline_at_risk() -> None:
    snap = healthy()
    _, skipped = diagnose_report(snap)
    assert "API's /metrics" in skipped["deadline-at-risk"]  # a boxcar run file has no batches
    snap["service"] = {"batches_deadline_at_risk": 0.0}
    assert rules(snap) == []
    snap["service"]["batches_deadline_at_risk"] = 2.0
    [finding] = diagnose(snap)
    assert finding.rule == "deadline-at-risk" and finding.severity == "critical"
    assert "2 live batch(es)" in finding.evidence
    assert "add workers" in finding.remedy and "fewer lines" in finding.remedy


def test_deadline_gauge_is_read_from_an_api_metrics_page() -> None:
    from cli.doctor_commands import parse_exposition

    page = ("# HELP boxcar_batches_deadline_at_risk Live batches late\n"
            "# TYPE boxcar_batches_deadline_at_risk gauge\n"
            "boxcar_batches_deadline_at_risk 3.0\n")
    snap = parse_exposition(page)
    assert snap["service"] == {"batches_deadline_at_risk": 3.0}
    assert "deadline-at-risk" in rules(snap)


# ---- real engine runs ---------------------------------------------------------------------------


def _line(i: int, prompt: list[int], max_tokens: int) -> str:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}})


def _ids(n: int, base: int) -> list[int]:
    return [base + j % 50 for j in range(n)]


def _run(model_dir: Path, tmp_path: Path, lines: list[str], **config) -> dict:
    from cli.offline import run_batch_file
    from engine import EngineConfig, LLMEngine
    from metrics.recorder import EngineRecorder, MeteredEngine, engine_config

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                    num_threads=1, **config))
    recorder = EngineRecorder(engine_config(engine))
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    summary = run_batch_file(MeteredEngine(engine, recorder), source, tmp_path / "out.jsonl",
                             progress=False, max_in_flight=8)
    assert summary.num_failed == 0
    return recorder.snapshot()


SHORT = [_line(i, _ids(20, i), 24) for i in range(24)]


def test_real_tiny_kv_cache_preempts(tiny_model_dir, tmp_path) -> None:
    found = rules(_run(tiny_model_dir, tmp_path, SHORT, max_num_seqs=8, num_kv_blocks=10))
    assert "kv-exhausted" in found and "uneven-decode" in found
    roomy = rules(_run(tiny_model_dir, tmp_path, SHORT, max_num_seqs=8, num_kv_blocks=256))
    assert "kv-exhausted" not in roomy


def test_real_prefix_caching_off_recomputes(tiny_model_dir, tmp_path) -> None:
    system = list(range(10, 74))  # a 64-token shared system prompt
    lines = [_line(i, system + [100 + i, 101 + i], 8) for i in range(24)]
    snap = _run(tiny_model_dir, tmp_path, lines, max_num_seqs=8, num_kv_blocks=256,
                enable_prefix_caching=False)
    finding = next(f for f in diagnose(snap) if f.rule == "prefix-recompute")
    assert "prefix caching off" in finding.evidence
    cached = _run(tiny_model_dir, tmp_path, lines, max_num_seqs=8, num_kv_blocks=256)
    assert "prefix-recompute" not in rules(cached)


def test_real_prefix_sharing_in_flight_is_not_reported_but_eviction_is(tiny_model_dir,
                                                                      tmp_path) -> None:
    """Lines sharing a prompt admitted together: the engine computes the prefix once (the
    rest wait for it in flight), and the rule stays quiet; the same prefix coming back after
    unrelated prompts pushed it out of a small cache is what it reports."""
    system = list(range(10, 74))  # four full blocks
    together = [_line(i, system + [100 + i, 101 + i], 4) for i in range(8)]
    snap = _run(tiny_model_dir, tmp_path, together, max_num_seqs=8, num_kv_blocks=256)
    repeated = snap["counters"]["prompt_tokens_repeated"]
    assert repeated == 7 * 64 and snap["counters"]["prompt_tokens_cached"] == repeated
    assert "prefix-recompute" not in rules(snap)
    # One at a time through a 12-block cache: each 180-token prompt between two uses of a
    # 96-token system prompt takes every block, so the prefix is gone when it comes back.
    system = list(range(10, 106))
    evicted = []
    for i in range(6):
        evicted += [_line(i, system + [200 + i, 201 + i], 4), _line(50 + i, _ids(180, i), 2)]
    snap = _run(tiny_model_dir, tmp_path, evicted, max_num_seqs=1, num_kv_blocks=12)
    finding = next(f for f in diagnose(snap) if f.rule == "prefix-recompute")
    assert "evicted from the cache" in finding.evidence and "more room" in finding.remedy


def test_real_one_seat_is_unbatched(tiny_model_dir, tmp_path) -> None:
    snap = _run(tiny_model_dir, tmp_path, SHORT[:12], max_num_seqs=1, num_kv_blocks=64)
    finding = next(f for f in diagnose(snap) if f.rule == "unbatched")
    assert "max_num_seqs=1 caps" in finding.remedy


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    from tests.conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-2k"), "llama",
                           max_position_embeddings=2048)


def test_real_unchunked_long_prompts_stall_decodes(long_context_model, tmp_path) -> None:
    """Three 1900-token prompts among short ones, chunking off: each prefill holds up the
    running decodes for one long step (through `boxcar run` and `boxcar doctor`)."""
    lines = list(SHORT)
    for n, at in enumerate((6, 13, 20)):
        lines.insert(at, _line(90 + n, _ids(1900, 3 + n), 2))
    source, metrics = tmp_path / "in.jsonl", tmp_path / "metrics.json"
    source.write_text("\n".join(lines) + "\n")
    assert cli.main([
        "run", str(source), "-o", str(tmp_path / "out.jsonl"), "--metrics-json", str(metrics),
        "--model", str(long_context_model), "--device", "cpu", "--dtype", "float32",
        "--threads", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "2048",
        "--no-chunked-prefill", "--max-in-flight", "8", "--no-progress",
    ]) == 0
    assert json.loads(metrics.read_text())["metrics"]["counters"]["requests_finished"] == 27
    out = tmp_path / "doctor.json"
    assert cli.main(["doctor", str(metrics), "--json", "--save", str(out)]) == 0
    assert "prefill-stalls" in rules(json.loads(out.read_text()))


# ---- the command line ---------------------------------------------------------------------------


def test_doctor_command_reads_files_and_urls(tmp_path, capsys) -> None:
    saved = tmp_path / "snap.json"
    snap = healthy()
    snap["counters"]["preemptions"] = 100
    saved.write_text(json.dumps({"num_ok": 1, "metrics": snap}))
    assert cli.main(["doctor", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "[critical] kv-exhausted" in out and "remedy:" in out
    assert cli.main(["doctor", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["rule"] == "kv-exhausted"

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli.main(["doctor", str(bad)]) == 2
    assert "holds no metrics snapshot" in capsys.readouterr().err
    assert cli.main(["doctor", "http://127.0.0.1:9/metrics", "--duration", "0"]) == 2

    # A URL: samples of a /metrics page become one window with a timeline.
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.outputs import EngineStats
    from metrics.recorder import EngineRecorder

    recorder = EngineRecorder({"max_num_seqs": 8})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(recorder)  # type: ignore[arg-type]
    calls = []

    def fetch(url: str) -> str:
        calls.append(url)
        n = len(calls)  # one more decode step of one sequence per scrape
        recorder.observe_step(duration=0.001, gap=None, stats=EngineStats(
            num_running=1, num_waiting=0, num_kv_blocks=8, num_free_kv_blocks=7, kv_usage=0.125,
            num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0, num_steps=n,
            num_prompt_tokens=0, num_generated_tokens=n, batch_size_hist={1: n},
            scheduled_tokens_hist={1: n}))
        return generate_latest(registry).decode()

    window = scrape("http://x/metrics", duration=0.05, interval=0.01, progress=False,
                    fetch=fetch)
    assert len(calls) >= 2 and window["window_s"] > 0 and window["timeline"]
    assert window["histograms"]["decode_step_s"]["count"] == len(calls) - 1
