"""llama.cpp beside boxcar: its own venv, built from PyPI's llama-cpp-python, run as a subprocess.

The venv (default ``~/.cache/boxcar/bench/llamacpp-venv``) is created with ``python -m venv`` and
``pip install llama-cpp-python==VERSION``, which compiles llama.cpp from source with cmake (many
minutes on two cores); it is used only once ``import llama_cpp`` has worked in it, which is
marked by a ``boxcar-ready`` file. ``bench/llamacpp_run.py`` runs in it and prints JSON.
Whatever stops llama.cpp from running (no venv and building not allowed, no cmake or compiler,
a failed build, a failed run) becomes a ``Skipped`` with the reason, never a failed benchmark.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.3.36"
DEFAULT_VENV = Path.home() / ".cache/boxcar/bench/llamacpp-venv"
READY = "boxcar-ready"
RUNNER = Path(__file__).with_name("llamacpp_run.py")


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class Run:
    seconds: float
    outputs: list[list[int]]
    version: str
    # False when ggml's extra CPU weight layouts were turned off after a crash with them.
    extra_buffer_types: bool = True


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_ready(venv: Path) -> bool:
    return (venv / READY).is_file() and venv_python(venv).exists()


def build(venv: Path, *, log: Path, version: str = VERSION) -> Skipped | None:
    """Create ``venv`` with llama-cpp-python built from source; a ``Skipped`` if that fails."""
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
    if missing:
        return Skipped(f"building llama-cpp-python needs {', '.join(missing)} on PATH")
    venv.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: building llama-cpp-python=={version} into {venv} (minutes; log: {log})",
          flush=True)
    commands = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv_python(venv)), "-m", "pip", "install", "--no-cache-dir",
         f"llama-cpp-python=={version}"],
        [str(venv_python(venv)), "-c", "import llama_cpp"],
    ]
    with log.open("w") as out:
        for command in commands:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
            if status != 0:
                return Skipped(f"building the llama.cpp venv failed at `{' '.join(command[1:4])}`"
                               f" (exit {status}); see {log}")
    (venv / READY).write_text(f"llama-cpp-python=={version}\n")
    return None


def ensure_venv(venv: Path, *, allow_build: bool) -> Skipped | None:
    if is_ready(venv):
        return None
    if not allow_build:
        return Skipped(f"no llama.cpp venv at {venv} (run without --llamacpp-no-build to build "
                       "it from PyPI's llama-cpp-python)")
    return build(venv, log=venv.parent / "llamacpp-build.log")


def run(venv: Path, *, model: Path, prompts: list[list[int]], max_tokens: list[int],
        parallel: int, threads: int, timeout: float | None = None) -> Run | Skipped:
    """Generate greedily with llama.cpp in ``venv``; the reason instead if it cannot.

    If llama.cpp dies of a signal, it runs once more without ggml's extra CPU weight layouts
    (``use_extra_bufts``): llama-cpp-python 0.3.36 built on an AMX Xeon segfaulted in its first
    ``llama_decode`` of the Q4_1 model with them and ran without them. ``Run`` says which."""
    first = _run_once(venv, model=model, prompts=prompts, max_tokens=max_tokens,
                      parallel=parallel, threads=threads, timeout=timeout,
                      extra_buffer_types=True)
    if not isinstance(first, _Crashed):
        return first
    again = _run_once(venv, model=model, prompts=prompts, max_tokens=max_tokens,
                      parallel=parallel, threads=threads, timeout=timeout,
                      extra_buffer_types=False)
    if isinstance(again, _Crashed):
        return Skipped(f"{again.reason} (and with ggml's extra buffer types: {first.reason})")
    return again


@dataclass(frozen=True)
class _Crashed(Skipped):
    """llama.cpp was killed by a signal."""


def _run_once(venv: Path, *, model: Path, prompts: list[list[int]], max_tokens: list[int],
              parallel: int, threads: int, timeout: float | None,
              extra_buffer_types: bool) -> Run | Skipped:
    spec = {"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
            "parallel": parallel, "threads": threads, "extra_buffer_types": extra_buffer_types}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="llamacpp-") as f:
        json.dump(spec, f)
        f.flush()
        started = time.perf_counter()
        try:
            done = subprocess.run([str(venv_python(venv)), str(RUNNER), f.name],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Skipped(f"llama.cpp ran past {timeout:.0f}s")
        except OSError as exc:
            return Skipped(f"llama.cpp could not start: {exc}")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        failed = _Crashed if done.returncode < 0 else Skipped
        return failed(f"llama.cpp failed (exit {done.returncode}) after "
                      f"{time.perf_counter() - started:.0f}s: {' | '.join(tail)}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Run(result["seconds"], result["outputs"], result["version"], extra_buffer_types)


def gguf_file(checkpoint_path: Path) -> Path | None:
    """The GGUF file of a checkpoint path (a .gguf file or a folder holding one), if any."""
    if checkpoint_path.is_file() and checkpoint_path.suffix == ".gguf":
        return checkpoint_path
    found = sorted(checkpoint_path.glob("*.gguf")) if checkpoint_path.is_dir() else []
    return found[0] if found else None
