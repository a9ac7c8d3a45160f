"""cli.main: argparse wiring, fast --help, the run and model pull handlers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cli import main as cli
from cli.engine_options import parse_size
from tests.openai_shapes import error_of

REPO = Path(__file__).resolve().parents[2]


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from cli.main import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'engine.llm_engine') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        check=True,
    ).stdout
    assert "run" in out and "model" in out
    assert "HEAVY []" in out


def test_no_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: boxcar" in capsys.readouterr().err


def test_run_options_map_to_engine_config() -> None:
    args = cli.build_parser().parse_args([
        "run", "in.jsonl", "-o", "out.jsonl", "--errors", "err.jsonl", "--model", "/m",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--kv-cache-memory", "64MiB",
        "--block-size", "32", "--no-prefix-caching", "--no-chunked-prefill", "--dtype", "float32",
        "--threads", "2", "--metrics-json", "m.json",
    ])
    assert args.handler is cli._cmd_run
    assert (args.input, args.output, args.errors, args.metrics_json) == (
        "in.jsonl", "out.jsonl", "err.jsonl", "m.json"
    )
    assert cli.engine_config_kwargs(args) == {
        "model": "/m", "max_num_seqs": 8, "max_num_batched_tokens": 256,
        "kv_cache_memory": 64 << 20, "block_size": 32, "dtype": "float32", "num_threads": 2,
        "enable_prefix_caching": False, "enable_chunked_prefill": False,
    }
    from engine import EngineConfig

    EngineConfig(**cli.engine_config_kwargs(args))


def test_run_defaults_leave_engine_defaults() -> None:
    args = cli.build_parser().parse_args(["run", "in.jsonl", "-o", "out.jsonl"])
    assert cli.engine_config_kwargs(args) == {"model": cli.DEFAULT_MODEL}
    assert args.errors is None and args.max_in_flight is None


def test_run_requires_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "in.jsonl"])
    assert "--output" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [("1024", 1024), ("512MiB", 512 << 20), ("2G", 2 << 30), ("1.5GB", 3 << 29), ("64k", 65536)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_model_pull(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Pull, convert and build the kernel, with a line per phase; a kernel that cannot be
    built (no compiler) is a warning, not a failure."""
    from engine import startup
    from engine.checkpoint import loader, model_cache
    from engine.kernels import cpu_decode_attention

    pulled, prepared, built = [], [], []

    def fake_pull(name: str) -> Path:
        if name == "nope":
            raise ValueError("unknown model 'nope'")
        pulled.append(name)
        return Path("/cache") / name

    def fake_build(*, quiet: bool = False) -> Path:
        built.append(quiet)
        if len(built) > 1:
            raise RuntimeError("cannot build the CPU decode-attention kernel: no c++")
        return Path("/kernels/k.so")

    monkeypatch.setattr(model_cache, "pull", fake_pull)
    monkeypatch.setattr(loader, "prepare_model",
                        lambda name: prepared.append(name) or Path("/converted") / name)
    monkeypatch.setattr(cpu_decode_attention, "build", fake_build)
    # the weights' memory as a start here would hold them (engine.startup.weight_summary)
    monkeypatch.setattr(loader, "load_checkpoint", lambda name: name)
    monkeypatch.setattr(startup, "weight_summary",
                        lambda config, checkpoint: f"weights-of {checkpoint}")
    assert cli.main(["model", "pull"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == [
        "[1/3]", f"/cache/{model_cache.DEFAULT_MODEL}", "[2/3]",
        f"/converted/{model_cache.DEFAULT_MODEL}", "weights-of", "[3/3]", "/kernels/k.so"]
    assert cli.main(["model", "pull", "other"]) == 0
    assert "warning: cannot build the CPU decode-attention kernel: no c++" in (
        capsys.readouterr().err)
    assert cli.main(["model", "pull", "other", "--no-kernel"]) == 0
    assert "skipped (--no-kernel)" in capsys.readouterr().out
    assert pulled == prepared == [model_cache.DEFAULT_MODEL, "other", "other"]
    assert len(built) == 2
    assert cli.main(["model", "pull", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_service_commands_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("cli.service_commands")

    def register(subparsers: argparse._SubParsersAction) -> None:
        command = subparsers.add_parser("fake-serve")
        command.set_defaults(handler=lambda args: 7)

    module.register = register  # type: ignore[attr-defined]
    # Both places an import looks: the real module may already be imported.
    import cli as cli_package

    monkeypatch.setitem(sys.modules, "cli.service_commands", module)
    monkeypatch.setattr(cli_package, "service_commands", module, raising=False)
    assert cli.main(["fake-serve"]) == 7


def test_run_end_to_end(tmp_path: Path, request: pytest.FixtureRequest,
                        capsys: pytest.CaptureFixture[str]) -> None:
    try:
        model_dir = request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        pytest.skip("tests/conftest.py has no tiny_model_dir fixture yet")
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "The quick"}], "max_tokens": 2,
                  "temperature": 0}},
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {}},
    ]
    source = tmp_path / "in.jsonl"
    # Saved with a byte order mark: line 1 still counts.
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(line) + "\n"
                                                 for line in lines).encode())
    out, errors, metrics = tmp_path / "out.jsonl", tmp_path / "err.jsonl", tmp_path / "m.json"
    code = cli.main([
        "run", str(source), "-o", str(out), "--errors", str(errors), "--metrics-json",
        str(metrics), "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
        "--max-num-seqs", "2", "--kv-cache-memory", "8MiB", "--threads", "1", "--no-progress",
    ])
    assert code == cli.EXIT_LINES_FAILED == 3  # a line failed
    assert "2 ok, 1 failed" in capsys.readouterr().out
    assert sorted(json.loads(line)["custom_id"] for line in out.read_text().splitlines()) == [
        "a", "b"
    ]
    assert error_of(json.loads(errors.read_text()))["code"] == "invalid_url"
    data = json.loads(metrics.read_text())
    assert data["num_ok"] == 2 and data["engine_config"]["max_num_seqs"] == 2
    assert "engine_stats" in data and data["model"]
    # Every line good: exit status 0.
    source.write_text(json.dumps(lines[0]) + "\n")
    assert cli.main(["run", str(source), "-o", str(out), "--model", str(model_dir), "--dtype",
                     "float32", "--device", "cpu", "--kv-cache-memory", "8MiB", "--threads",
                     "1", "--no-progress"]) == 0


def test_run_as_a_process_exits_without_teardown_and_loses_no_output(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``boxcar run`` as its own process skips the interpreter's teardown (atexit handlers do not
    run), yet its block-buffered stdout (a file) and its output file are complete, and its exit
    status is the run's; called in-process, ``main`` returns instead (the tests above)."""
    model_dir = request.getfixturevalue("tiny_model_dir")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}}
    bad = {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {}}
    source, out, log = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "log"
    source.write_text(json.dumps(line) + "\n" + json.dumps(bad) + "\n")
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('TEARDOWN', flush=True))\n"
            "from cli.main import main\n"
            "sys.exit(main())\n")
    with open(log, "w") as stdout:
        result = subprocess.run(
            [sys.executable, "-c", code, "run", str(source), "-o", str(out), "--model",
             str(model_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8MiB",
             "--threads", "1", "--no-progress"],
            cwd=REPO, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
            check=False,
        )
    assert result.returncode == cli.EXIT_LINES_FAILED, result.stderr
    printed = log.read_text()
    assert "1 ok, 1 failed" in printed and f"results in {out}" in printed
    assert "TEARDOWN" not in printed
    records = {json.loads(x)["custom_id"]: json.loads(x) for x in out.read_text().splitlines()}
    assert records["a"]["response"]["status_code"] == 200
    assert error_of(records["b"])["code"] == "invalid_url"


def test_every_engine_config_field_is_an_option() -> None:
    """The options are generated from EngineConfig: each field is set by its flag, and a field
    given on the command line reaches EngineConfig unchanged."""
    from dataclasses import fields

    from engine import EngineConfig

    argv = ["run", "in.jsonl", "-o", "out.jsonl", "--tokenizer", "/t", "--num-kv-blocks", "64",
            "--watermark", "0.05", "--attention-backend", "torch", "--enforce-eager"]
    kwargs = cli.engine_config_kwargs(cli.build_parser().parse_args(argv))
    assert kwargs == {"model": cli.DEFAULT_MODEL, "tokenizer": "/t", "num_kv_blocks": 64,
                      "watermark": 0.05, "attention_backend": "torch", "enforce_eager": True}
    config = EngineConfig(**kwargs)
    assert (config.num_kv_blocks, config.watermark, config.enforce_eager) == (64, 0.05, True)
    run_parser = cli.build_parser()._subparsers._group_actions[0].choices["run"]
    dests = {action.dest for action in run_parser._actions}
    assert {field.name for field in fields(EngineConfig)} <= dests


def test_the_service_default_model_is_the_engines() -> None:
    from engine.checkpoint import model_cache
    from service.settings import Settings

    assert Settings.model_fields["model"].default == model_cache.DEFAULT_MODEL == cli.DEFAULT_MODEL


def test_serve_to_a_file_shows_the_key_line_at_once(tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    """``boxcar serve > log``: stdout is a file (block-buffered by default); the key line must
    be in the log while the server runs, not when it exits."""
    import os
    import socket
    import subprocess
    import sys
    import time

    model_dir = request.getfixturevalue("tiny_model_dir")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "log"
    env = {**os.environ, "BOXCAR_DATABASE_URL": f"sqlite:///{tmp_path / 'b.db'}",
           "BOXCAR_STORAGE_URL": str(tmp_path / "objects"), "PYTHONPATH": os.getcwd()}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from cli.main import main; sys.exit(main())",
             "serve", "--port", str(port), "--model", str(model_dir), "--dtype", "float32",
             "--device", "cpu", "--kv-cache-memory", "8MiB", "--threads", "1"],
            stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "API key: " not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, "boxcar serve exited"
            time.sleep(0.2)
        assert "API key: " in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
