"""The ``boxcar`` command line: ``run`` (offline batch), ``model pull``, and the service's commands.

Heavy modules (torch, the model runner) are imported inside the handlers so ``boxcar --help`` is
fast; the engine options come from ``EngineConfig`` (``cli.engine_options``), which is light.
A subcommand sets ``handler=fn(args) -> int`` with ``set_defaults``; ``cli.service_commands``
(when present) adds the service's subcommands the same way through ``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from cli.engine_options import DEFAULT_MODEL, add_engine_arguments, engine_config_kwargs

# `boxcar run`'s exit status when it ran to the end but some lines failed (1: a crash or bad
# usage, 2: bad engine options).
EXIT_LINES_FAILED = 3


def _cmd_run(args: argparse.Namespace) -> int:
    from cli.kv_sizing import kv_blocks_needed
    from cli.offline import IN_FLIGHT_PER_SEQ, run_batch_file, write_metrics_json
    from engine import EngineConfig, LLMEngine
    from engine.errors import LoRAError
    from metrics.recorder import EngineRecorder, MeteredEngine, engine_config

    kwargs = engine_config_kwargs(args)
    try:
        config = EngineConfig(**kwargs)
        if config.num_kv_blocks is None and config.max_kv_blocks is None:
            # What the file's requests can use at most: a short file gets a small cache.
            needed = kv_blocks_needed(args.input, block_size=config.block_size,
                                      max_num_seqs=config.max_num_seqs)
            if needed is not None:
                config = EngineConfig(**{**kwargs, "max_kv_blocks": needed})
    except ValueError as exc:
        print(f"boxcar run: {exc}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(config)
    except LoRAError as exc:  # a --lora-modules adapter that cannot be served
        print(f"boxcar run: {exc}", file=sys.stderr)
        return 2
    recorder = EngineRecorder(engine_config(engine))
    max_in_flight = args.max_in_flight or IN_FLIGHT_PER_SEQ * config.max_num_seqs
    summary = run_batch_file(
        MeteredEngine(engine, recorder),
        args.input,
        args.output,
        errors_path=args.errors,
        max_in_flight=max_in_flight,
        progress=not args.no_progress,
    )
    print(summary.format())
    for error in summary.line_errors:
        print(f"  {error['message']} ({error['code']})", file=sys.stderr)
    where = f"{args.output}" + (f", errors in {args.errors}" if args.errors else "")
    print(f"results in {where}")
    if args.metrics_json:
        write_metrics_json(
            args.metrics_json,
            summary,
            model=engine.model_name,
            input=str(args.input),
            engine_config=engine_config_kwargs(args),
            metrics=recorder.snapshot(),
        )
        print(f"metrics in {args.metrics_json} (diagnose: boxcar doctor {args.metrics_json})")
    return EXIT_LINES_FAILED if summary.num_failed else 0


def _cmd_model_pull(args: argparse.Namespace) -> int:
    """Everything a first start would do, done now: fetch the model into the cache, convert a
    GGUF file to its cached HF folder, build the CPU decode-attention kernel (optional: without
    a compiler the engine uses its PyTorch path, so that is a warning)."""
    from engine.checkpoint import model_cache

    name = args.name or model_cache.DEFAULT_MODEL
    print(f"[1/3] fetching {name} into {model_cache.cache_dir()}", flush=True)
    try:
        path = model_cache.pull(name)
    except ValueError as exc:
        print(f"boxcar model pull: {exc}", file=sys.stderr)
        return 2
    print(f"      {path}", flush=True)
    print("[2/3] converting to the cached folder the engine reads (once per model file)",
          flush=True)
    import time

    from engine.checkpoint.loader import prepare_model
    from engine.kernels import cpu_decode_attention

    start = time.monotonic()
    try:
        folder = prepare_model(name)
    except ValueError as exc:
        print(f"boxcar model pull: {exc}", file=sys.stderr)
        return 2
    print(f"      {folder} ({time.monotonic() - start:.1f} s)", flush=True)
    from engine.checkpoint.loader import load_checkpoint
    from engine.config import EngineConfig
    from engine.startup import weight_summary

    print(f"      {weight_summary(EngineConfig(model=name), load_checkpoint(name))}", flush=True)
    if args.no_kernel:
        print("[3/3] CPU decode-attention kernel: skipped (--no-kernel)", flush=True)
        return 0
    print(f"[3/3] building the CPU decode-attention kernel into "
          f"{cpu_decode_attention.kernel_cache_dir()}", flush=True)
    start = time.monotonic()
    try:
        library = cpu_decode_attention.build(quiet=True)
    except RuntimeError as exc:
        print(f"warning: {exc}; CPU decode attention will use the slower PyTorch path",
              file=sys.stderr)
        return 0
    print(f"      {library} ({time.monotonic() - start:.1f} s)", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boxcar", description="Self-hosted batch LLM inference (OpenAI Batch format)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = subparsers.add_parser(
        "run", help="run an OpenAI batch .jsonl file offline",
        description="Run every line of an OpenAI batch input file on this machine and write "
        "the output (and error) lines as they finish. Exit status: 0 when every line "
        f"succeeded, {EXIT_LINES_FAILED} when some lines failed, 1 on a crash or bad usage.",
    )
    run.add_argument("input", help="OpenAI batch input (.jsonl)")
    run.add_argument("-o", "--output", required=True, help="where the output lines go")
    run.add_argument("--errors", default=None,
                     help="write error lines here instead of into the output file")
    run.add_argument("--metrics-json", default=None,
                     help="write the run's summary and engine stats here as JSON")
    run.add_argument("--max-in-flight", type=int, default=None,
                     help="most requests in the engine at once (default: 4x max-num-seqs)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(run)
    run.set_defaults(handler=_cmd_run, exit_without_teardown=True)

    model = subparsers.add_parser("model", help="manage the local model cache")
    model_commands = model.add_subparsers(dest="model_command", metavar="COMMAND")
    pull = model_commands.add_parser(
        "pull", help="fetch a model into the local cache, convert it and build the CPU kernel")
    pull.add_argument("name", nargs="?", default=None,
                      help=f"model name (default: {DEFAULT_MODEL})")
    pull.add_argument("--no-kernel", action="store_true",
                      help="do not build the CPU decode-attention kernel")
    pull.set_defaults(handler=_cmd_model_pull)
    model.set_defaults(handler=lambda _args: _usage(model))

    try:
        from cli import service_commands
    except ImportError:
        pass
    else:
        service_commands.register(subparsers)
    from cli import doctor_commands

    doctor_commands.register(subparsers)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        return _usage(parser)
    code = handler(args) or 0
    if argv is None and getattr(args, "exit_without_teardown", False):
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """End the process now, skipping the interpreter's teardown.

    Tearing down a process that loaded torch and a model (module globals, tensors, the tokenizer's
    tables, thread pools) took ~0.5-0.8 s of a one-line ``boxcar run`` and produces nothing: the
    output files are closed by then. Only for a command run as the process's own command line
    (``argv`` None: the console script, ``python -m cli.main``), never when ``main`` is called
    in-process (tests, embedding).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing left to save
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
