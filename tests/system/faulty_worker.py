"""``boxcar`` with an engine that breaks: ``step()`` raises a CUDA-like error after
``BOXCAR_TEST_STEPS_BEFORE_FAILURE`` steps. Test-only; run as ``python -m tests.system.faulty_worker
worker ...`` in place of ``python -m cli.main worker ...``."""

from __future__ import annotations

import os
import sys

from cli.main import main
from engine import LLMEngine

_steps_left = int(os.environ["BOXCAR_TEST_STEPS_BEFORE_FAILURE"])
_step = LLMEngine.step


def _failing_step(self: LLMEngine):
    global _steps_left
    if _steps_left <= 0:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    _steps_left -= 1
    return _step(self)


LLMEngine.step = _failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
