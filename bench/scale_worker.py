"""``boxcar`` with the scale benchmark's fake engine (``engine.testing.fake_engine``) in place of
the model:
``python -m bench.scale_worker worker ...`` runs the normal worker entry point (Celery, leases,
result writer, finalize) on an engine that costs nothing but the pace it is given.

The engine is chosen by ``BOXCAR_BENCH_ENGINE`` (``instant`` or ``paced``) and, when paced,
``BOXCAR_BENCH_LINES_PER_S``; ``bench/scale.py`` sets both. Benchmark-only: no production
setting selects a fake engine.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from bench.cpu_profile import start_from_env
from engine.testing.fake_engine import FakeEngine

ENGINES = ("instant", "paced")


def engine_from_env(env: dict[str, str]) -> FakeEngine:
    kind = env.get("BOXCAR_BENCH_ENGINE", "")
    if kind not in ENGINES:
        raise ValueError(f"BOXCAR_BENCH_ENGINE must be one of {ENGINES}, got {kind!r}")
    if kind == "instant":
        if "BOXCAR_BENCH_LINES_PER_S" in env:
            raise ValueError("BOXCAR_BENCH_LINES_PER_S is for the paced engine only")
        return FakeEngine.paced(None)
    raw = env.get("BOXCAR_BENCH_LINES_PER_S", "")
    try:
        lines_per_s = float(raw)
    except ValueError:
        raise ValueError(f"BOXCAR_BENCH_LINES_PER_S must be a number > 0, got {raw!r}") from None
    return FakeEngine.paced(lines_per_s)


def main(argv: list[str] | None = None) -> int:
    from cli.main import main as boxcar_main
    from worker import process

    engine = engine_from_env(dict(os.environ))  # a bad setting stops here, before Celery starts
    start_from_env(dict(os.environ), "worker")

    def build_engine(settings: Any, storage: Any = None) -> FakeEngine:
        return engine

    process.build_engine = build_engine
    return boxcar_main(argv)


if __name__ == "__main__":
    sys.exit(main())
