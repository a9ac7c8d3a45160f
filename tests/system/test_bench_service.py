"""The service benchmark harness: the same JSONL through `boxcar run` and the service gives the
same answers' counts (the 10% throughput target is for a real model: see bench.service)."""

from __future__ import annotations

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
    assert report["service_vs_offline"] > 0
