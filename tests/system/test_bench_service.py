"""The service benchmark harness: the same JSONL through `boxcar run` and the service gives the
same answers' counts (the 10% throughput target is for a real model: see bench.service)."""

from __future__ import annotations

import pytest

from bench.service import compare
from tests.conftest_services import chat_line, jsonl
from tests.system.conftest import ENGINE_OPTIONS


def test_offline_and_service_answer_the_same_lines(tmp_path, tiny_model_dir):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"q{i}", f"Common preamble. Ask {i}", max_tokens=8,
                                      ignore_eos=True, temperature=0) for i in range(24)]))
    report = compare(str(path), str(tiny_model_dir), ENGINE_OPTIONS)
    for side in ("offline", "service"):
        assert report[side]["num_ok"] == 24
        assert report[side]["num_generated_tokens"] == 24 * 8
    # The figure the benchmark prints is the ratio of the two sides' measured throughputs.
    offline, service = report["offline"], report["service"]
    for name, side in (("offline", offline), ("service", service)):
        assert report["elapsed_s"][name] == [round(side["elapsed_s"], 2)]  # one round: its median
        assert side["tokens_per_s"] == pytest.approx(24 * 8 / side["elapsed_s"])
    ratio = service["tokens_per_s"] / offline["tokens_per_s"]
    assert report["service_vs_offline"] == pytest.approx(ratio)
    assert report["within_10_percent"] is (ratio >= 0.9)
