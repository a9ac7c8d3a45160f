"""``boxcar`` with the scale benchmark's fake engine (``engine.testing.fake_engine``) in place of
the model:
``python -m bench.scale_worker worker ...`` runs the normal worker entry point (Celery, leases,
result writer, finalize) on an engine that costs nothing but the pace it is given.

The engine is chosen by ``BOXCAR_BENCH_ENGINE`` (``instant`` or ``paced``) and, when paced,
``BOXCAR_BENCH_LINES_PER_S``; ``bench/scale.py`` sets both. ``BOXCAR_BENCH_EMBEDDING=1`` makes
it an embedding model (the chaos run's embeddings lines). LoRA adapters in the worker's
``lora_modules`` are handled as the real engine's start handles them: an object-storage PATH
is downloaded (``worker.lora_files``), each folder must hold ``adapter_config.json``, and the
name is registered, so lines naming it run and lines naming another fail as on a real model.
Benchmark-only: no production setting selects a fake engine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from bench.cpu_profile import start_from_env
from engine.testing.fake_engine import FakeEngine

ENGINES = ("instant", "paced")


def engine_from_env(env: dict[str, str]) -> FakeEngine:
    kind = env.get("BOXCAR_BENCH_ENGINE", "")
    if kind not in ENGINES:
        raise ValueError(f"BOXCAR_BENCH_ENGINE must be one of {ENGINES}, got {kind!r}")
    embedding = env.get("BOXCAR_BENCH_EMBEDDING", "0")
    if embedding not in ("0", "1"):
        raise ValueError(f"BOXCAR_BENCH_EMBEDDING must be 0 or 1, got {embedding!r}")
    if kind == "instant":
        if "BOXCAR_BENCH_LINES_PER_S" in env:
            raise ValueError("BOXCAR_BENCH_LINES_PER_S is for the paced engine only")
        return FakeEngine.paced(None, is_embedding=embedding == "1")
    raw = env.get("BOXCAR_BENCH_LINES_PER_S", "")
    try:
        lines_per_s = float(raw)
    except ValueError:
        raise ValueError(f"BOXCAR_BENCH_LINES_PER_S must be a number > 0, got {raw!r}") from None
    return FakeEngine.paced(lines_per_s, is_embedding=embedding == "1")


def register_adapters(engine: FakeEngine, entries: list[str]) -> None:
    """Register ``NAME=FOLDER`` adapters (object-storage paths already downloaded), refusing a
    folder without its ``adapter_config.json`` as the engine's start does."""
    for entry in entries:
        name, _, path = entry.partition("=")
        if not (Path(path.strip()) / "adapter_config.json").is_file():
            raise ValueError(f"LoRA adapter {name.strip()!r}: {path.strip()}/adapter_config.json "
                             "is missing")
        engine.add_lora(name.strip(), path.strip())


def main(argv: list[str] | None = None) -> int:
    from cli.main import main as boxcar_main
    from worker import process
    from worker.lora_files import local_lora_modules

    engine = engine_from_env(dict(os.environ))  # a bad setting stops here, before Celery starts
    start_from_env(dict(os.environ), "worker")

    def build_engine(settings: Any, storage: Any = None) -> FakeEngine:
        entries = list(settings.engine_options.get("lora_modules") or [])
        if entries and storage is not None:
            entries = local_lora_modules(entries, storage)
        register_adapters(engine, entries)
        return engine

    process.build_engine = build_engine
    return boxcar_main(argv)


if __name__ == "__main__":
    sys.exit(main())
