"""llama.cpp beside boxcar (bench/llamacpp.py, bench/llamacpp_run.py): the venv's states and
the batched greedy loop, the latter against a stand-in for llama-cpp-python's low-level API."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llamacpp

FAKE = Path(__file__).with_name("fake_llama_cpp")


def expected(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    # The stand-in's model predicts (previous token + 1) mod its vocabulary of 1000.
    return [[(p[-1] + k) % 1000 for k in range(1, m + 1)]
            for p, m in zip(prompts, max_tokens, strict=True)]


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose python is this test's interpreter, marked ready."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (venv / llamacpp.READY).write_text("fake\n")
    return venv


def test_absent_venv_is_a_skip_when_building_is_not_allowed(tmp_path: Path) -> None:
    venv = tmp_path / "absent"
    skipped = llamacpp.ensure_venv(venv, allow_build=False)
    assert isinstance(skipped, llamacpp.Skipped)
    assert str(venv) in skipped.reason and "--llamacpp-no-build" in skipped.reason
    assert not venv.exists()


def test_a_venv_without_the_ready_mark_is_not_used(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path)
    (venv / llamacpp.READY).unlink()  # e.g. a build that stopped half way
    assert not llamacpp.is_ready(venv)
    assert isinstance(llamacpp.ensure_venv(venv, allow_build=False), llamacpp.Skipped)


def test_build_without_cmake_is_a_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: None if tool == "cmake" else tool)
    skipped = llamacpp.ensure_venv(tmp_path / "venv", allow_build=True)
    assert isinstance(skipped, llamacpp.Skipped) and "cmake" in skipped.reason
    assert not (tmp_path / "venv").exists()


def test_failed_build_is_a_skip_naming_its_log(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    ran: list[list[str]] = []

    def failing_pip(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        ran.append(command)
        return subprocess.CompletedProcess(command, 0 if "venv" in command else 1)

    monkeypatch.setattr(llamacpp.subprocess, "run", failing_pip)
    venv = tmp_path / "venv"
    skipped = llamacpp.ensure_venv(venv, allow_build=True)
    assert isinstance(skipped, llamacpp.Skipped)
    assert "exit 1" in skipped.reason and "llamacpp-build.log" in skipped.reason
    assert ran[1][-1] == f"llama-cpp-python=={llamacpp.VERSION}"
    assert not llamacpp.is_ready(venv)


def test_batched_loop_chunks_prompts_reuses_sequence_ids_and_stops_at_max_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "batches.log"))
    sys.modules.pop("llama_cpp", None)
    runner = importlib.import_module("bench.llamacpp_run")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    prompts = [[5, 6, 7], list(range(20, 32)), [998], [40, 41], list(range(100, 109))]
    max_tokens = [4, 2, 3, 1, 5]
    result = runner.generate({"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                              "parallel": 2, "batch_tokens": 8})
    assert result["outputs"] == expected(prompts, max_tokens)
    sizes = [int(n) for n in (tmp_path / "batches.log").read_text().split()]
    assert max(sizes) == 8  # the 12-token prompt was split to the batch budget
    assert sizes[0] == 3  # the warm-up: the first prompt's first tokens
    sys.modules.pop("llama_cpp", None)


def test_run_in_a_venv_returns_outputs_and_a_failure_is_a_skip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    venv = fake_venv(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    prompts, max_tokens = [[1, 2, 3], [7, 8]], [3, 2]
    run = llamacpp.run(venv, model=model, prompts=prompts, max_tokens=max_tokens, parallel=16,
                       threads=1)
    assert isinstance(run, llamacpp.Run)
    assert run.outputs == expected(prompts, max_tokens) and run.version == "fake"
    assert 0 < run.seconds < 60  # the generate call was timed (a fake: well under a minute)

    assert run.extra_buffer_types

    # Killed by a signal with ggml's extra buffer types: run again without them, and say so.
    monkeypatch.setenv("FAKE_LLAMA_CRASH_WITH_EXTRA_BUFTS", "1")
    again = llamacpp.run(venv, model=model, prompts=prompts, max_tokens=max_tokens,
                         parallel=16, threads=1)
    assert isinstance(again, llamacpp.Run) and not again.extra_buffer_types
    assert again.outputs == run.outputs
    monkeypatch.delenv("FAKE_LLAMA_CRASH_WITH_EXTRA_BUFTS")

    failed = llamacpp.run(venv, model=tmp_path / "missing.gguf", prompts=prompts,
                          max_tokens=max_tokens, parallel=16, threads=1)
    assert isinstance(failed, llamacpp.Skipped)
    assert "could not load" in failed.reason


def test_gguf_file(tmp_path: Path) -> None:
    assert llamacpp.gguf_file(tmp_path) is None
    (tmp_path / "m.gguf").write_bytes(b"")
    assert llamacpp.gguf_file(tmp_path) == tmp_path / "m.gguf"
    assert llamacpp.gguf_file(tmp_path / "m.gguf") == tmp_path / "m.gguf"


@pytest.mark.skipif(not llamacpp.is_ready(llamacpp.DEFAULT_VENV),
                    reason="no llama.cpp venv (python -m bench.offline --llamacpp builds it)")
def test_real_llamacpp_on_the_default_model_is_deterministic() -> None:
    from engine.checkpoint.model_cache import DEFAULT_MODEL, resolve

    model = resolve(DEFAULT_MODEL)
    if model is None:
        pytest.skip("the default model is not cached")
    prompts = [[1, 9690, 198, 22503, 28, 30], [1, 4093, 198, 19556]]
    runs = [llamacpp.run(llamacpp.DEFAULT_VENV, model=model, prompts=prompts, max_tokens=[6, 4],
                         parallel=parallel, threads=1) for parallel in (1, 2)]
    for run in runs:
        assert isinstance(run, llamacpp.Run), run
        assert [len(o) for o in run.outputs] == [6, 4]
    # Greedy and batched: the same tokens with one or two sequences in flight.
    assert runs[0].outputs == runs[1].outputs
