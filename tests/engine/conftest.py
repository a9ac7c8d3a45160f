"""Engine tests run Triton kernels on the CPU through the interpreter (read at first import)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
