"""bench.offline end to end at tiny size: boxcar in both dtypes, the sorted static baseline, the
ratios with their targets, the roofline floor, and llama.cpp skipped when it cannot run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import offline


def test_offline_bench_reports_dtypes_baseline_ratios_floor_and_skips(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    figures_path = tmp_path / "figures.json"
    status = offline.main([
        "--model", str(tiny_model_dir), "--quick", "--num-requests", "3", "--threads", "1",
        "--dtypes", "float32,bfloat16", "--skip-hf-single", "--skip-hf-continuous",
        "--static-batch-size", "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--llamacpp", "--llamacpp-venv", str(tmp_path / "absent"), "--llamacpp-no-build",
        "--json", str(figures_path),
    ])
    assert status == 0
    figures = json.loads(figures_path.read_text())
    static = "HF static batches of 2, sorted"
    assert list(figures["systems"]) == ["boxcar float32", "boxcar bfloat16", static]
    assert all(s["output_tokens_per_s"] > 0 for s in figures["systems"].values())
    # The fp32 engine is exact against transformers' sorted static batches.
    assert figures["correctness"][static]["mismatching"] == 0
    assert figures["correctness"][static]["compared"] == 3
    assert figures["targets"] == {"boxcar bfloat16 / boxcar float32": 1.8,
                                  f"boxcar float32 / {static}": 3.0}
    fp32, bf16 = (figures["systems"][f"boxcar {d}"]["output_tokens_per_s"]
                  for d in ("float32", "bfloat16"))
    assert figures["ratios"]["boxcar bfloat16 / boxcar float32"] == pytest.approx(bf16 / fp32)
    assert "llama.cpp" in figures["skipped"]  # the tiny model has no GGUF file
    runs = figures["roofline"]["runs"]
    for dtype in ("float32", "bfloat16"):
        run = runs[f"boxcar {dtype}"]
        assert run["floor_seconds"] == pytest.approx(run["linears"] + run["lm_head"]
                                                     + run["attention"])
        assert 0 < run["floor_seconds"] < run["run_seconds"]
        assert run["fraction_of_floor"] == pytest.approx(run["floor_seconds"]
                                                         / run["run_seconds"])
        assert run["num_steps"] > 0 and run["processed_tokens"] > 0
    assert figures["roofline"]["copy_bandwidth"] > 0
    # CPU time of each boxcar run (the figure a shared machine moves least), and its ratio
    cpu = figures["cpu_seconds"]
    assert list(cpu) == ["boxcar float32", "boxcar bfloat16"] and all(c > 0 for c in cpu.values())
    text = capsys.readouterr().out
    assert "boxcar bfloat16 / boxcar float32 in out tok per CPU s:" in text
    assert "(target >= 3x:" in text and "(goal >= 70%:" in text
    assert "llama.cpp" in text and "skipped" in text


def test_unknown_dtype_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        offline.main(["--dtypes", "float32,int4"])
    assert "--dtypes" in capsys.readouterr().err


def test_llamacpp_is_skipped_with_the_reason_when_its_venv_is_absent(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    args = argparse.Namespace(model="m", llamacpp_venv=str(tmp_path / "absent"),
                              llamacpp_no_build=True, llamacpp_parallel=16, threads=1)
    workload = offline.Workload([[1, 2, 3]], [4])
    skipped = offline.run_llamacpp(args, gguf, workload)
    assert isinstance(skipped, offline.llamacpp.Skipped)
    assert f"no llama.cpp venv at {tmp_path / 'absent'}" in skipped.reason
