"""Paged decode attention on the CPU: a small C++ kernel, built once per machine, and its reference.

The kernel reads K/V straight from the paged cache, so a decode step costs one pass over each
sequence's context instead of a gather copy plus an attention pass over a padded batch.

Build cache: the shared library lives in ``kernel_cache_dir()/<key>/`` where ``key`` hashes the
source, the flags, the compiler's ``--version``, torch, Python and the CPU flags (-march=native).
A warm start imports that file directly and never runs ninja, so which ninja is on PATH (the venv's
or the system's, which disagree about torch's own build cache) costs nothing. A cold start builds
in a fresh temporary folder with torch's cpp_extension (tens of seconds, announced on stderr) and
renames the result into place, so concurrent starts never see half a library. ``build()`` is the
ahead-of-time entry point (``boxcar model pull``); where no compiler is available ``load()``
returns None and the engine stays on the pure PyTorch path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels.checks import check_query_and_cache

log = logging.getLogger(__name__)

_NAME = "boxcar_paged_decode_attention"
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
# -fopenmp makes at::parallel_for (an inline OpenMP loop) parallel; the extension then binds to
# torch's own libgomp (same soname, already loaded): one thread pool.
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_module: ModuleType | None = None
_tried = False
load_seconds = 0.0  # time spent in load() (building or importing), for start-up breakdowns


def kernel_cache_dir() -> Path:
    """``$BOXCAR_KERNEL_CACHE``, else ``~/.cache/boxcar/kernels``."""
    configured = os.environ.get("BOXCAR_KERNEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache/boxcar/kernels"


def build_key() -> str:
    """What the compiled library depends on, hashed: source, flags, compiler, torch, Python, CPU."""
    digest = hashlib.sha256()
    digest.update(_SOURCE.read_bytes())
    digest.update(repr((_CFLAGS, _LDFLAGS, torch.__version__, sys.version, platform.machine()))
                  .encode())
    digest.update(_compiler_version().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """Where the library for this machine's ``build_key()`` lives (whether built or not)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return kernel_cache_dir() / build_key() / f"{_NAME}{suffix}"


def build(*, quiet: bool = False) -> Path:
    """Compile the kernel into the cache unless it is there; return the library's path.

    Raises RuntimeError when it cannot be built (no compiler, no headers).
    """
    target = library_path()
    if target.is_file():
        return target
    if not quiet:
        print(f"[boxcar] building the CPU decode-attention kernel into {target.parent} "
              "(once per machine and torch/compiler version; about 30 s)...",
              file=sys.stderr, flush=True)
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load as load_extension

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as build_dir:
        try:
            load_extension(
                name=_NAME, sources=[str(_SOURCE)], extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS), build_directory=build_dir, verbose=False,
                is_python_module=True,
            )
        except Exception as exc:
            raise RuntimeError(f"cannot build the CPU decode-attention kernel: {exc}") from exc
        built = Path(build_dir) / f"{_NAME}.so"
        if not built.is_file():
            raise RuntimeError(f"the kernel build left no {built.name} in {build_dir}")
        staged = Path(build_dir) / "staged.so"
        shutil.copyfile(built, staged)
        os.replace(staged, target)  # atomic: another process sees no library or a whole one
    if not quiet:
        print(f"[boxcar] kernel built in {time.monotonic() - start:.1f} s",
              file=sys.stderr, flush=True)
    return target


def load() -> ModuleType | None:
    """The kernel module, built on first use (see ``build``); None if it cannot be built here."""
    global _module, _tried, load_seconds
    if _tried:
        return _module
    _tried = True
    if os.environ.get("BOXCAR_NO_CPU_KERNELS"):
        return None
    start = time.perf_counter()
    try:
        path = build()
        if _NAME in sys.modules:  # built and imported by build()'s cpp_extension call
            module = sys.modules[_NAME]
        else:
            module = _import_library(path)
        _module = module
    except Exception as exc:  # no compiler, no headers: fall back, loudly
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        _module = None
    load_seconds += time.perf_counter() - start
    return _module


def _import_library(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[_NAME] = module
    return module


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: {exc}"
    return f"{compiler}: {result.stdout}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    module = load()
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    check_query_and_cache(q, k_cache, v_cache, "num_seqs")
    if block_tables.shape[0] != q.shape[0] or context_lens.shape[0] != q.shape[0]:
        raise ValueError("block_tables and context_lens need one row per sequence")
    for name, t, dtype in (
        ("q", q, torch.float32), ("k_cache", k_cache, torch.float32),
        ("v_cache", v_cache, torch.float32), ("block_tables", block_tables, torch.int32),
        ("context_lens", context_lens, torch.int32),
    ):
        if t.dtype != dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    out = torch.empty_like(q) if out is None else out
    module.paged_decode_attention(
        q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale, out
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One sequence at a time, gather then softmax(QK^T)V: slow and obviously right."""
    num_heads = q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    block_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    for i, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[i, : -(-length // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [length, num_heads, dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        probs = F.softmax(torch.einsum("hd,lhd->hl", q[i].float(), k.float()) * scale, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, v.float()).to(q.dtype)
    return out
