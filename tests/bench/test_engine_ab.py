"""bench.engine_ab end to end at tiny size: both checkouts run, and --prefault-kv commits the KV
cache that today's engine otherwise commits page by page as the run writes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import engine_ab

_REPO = Path(__file__).resolve().parents[2]


def _resident_shares(output: str) -> list[float]:
    return [int(share) / 100 for share in re.findall(r"KV cache (\d+)% resident", output)]


def test_engine_ab_runs_both_checkouts_and_prefaults_the_kv_cache_on_request(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["--old", str(_REPO), "--new", str(_REPO), "--rounds", "1", "--num-requests", "2",
              "--threads", "1", "--model", str(tiny_model_dir), "--quick"]
    assert engine_ab.main(common) == 0
    lazy = capsys.readouterr().out
    assert engine_ab.main([*common, "--prefault-kv"]) == 0
    prefaulted = capsys.readouterr().out
    for output in (lazy, prefaulted):
        assert "round 1 old" in output and "round 1 new" in output
        assert "WARNING" not in output  # the same tokens from both runs of the engine
        assert re.search(r"tok_s\s+[\d.]+\s+[\d.]+", output)
    # Two requests of a few dozen tokens touch a sliver of a cache sized for 128 sequences.
    assert all(share < 0.5 for share in _resident_shares(lazy))
    assert _resident_shares(prefaulted) == [1.0, 1.0]
