"""Paged decode attention on the CPU: a small C++ kernel, built once per machine, and its reference.

The same library carries the bf16 layer's fused elementwise ops (``cpu_fused_ops.py``), the
packed attention, the LoRA segment kernel (``layers/lora.py``) and the quantized GEMM
(``quant_gemm.py``): one build, one cache entry, one import for the CPU kernels.

The kernel reads K/V straight from the paged cache, so a decode step costs one pass over each
sequence's context instead of a gather copy plus an attention pass over a padded batch.

The cache may be float32 or bfloat16 (read as bf16, accumulated in fp32). Variants: ``native``
(-march=native: AVX-512 where the CPU has it, and AVX512-BF16 dot products for a bf16 cache where
it has those) and ``portable`` (the same flags without AVX-512: the plain loops any CPU runs, the
fallback, built to test it on a machine that would otherwise take the AVX-512 path). The
engine uses ``native``; ``$BOXCAR_CPU_KERNEL_VARIANT`` overrides it.

Build cache: the shared library lives in ``kernel_cache_dir()/<key>/`` where ``key`` hashes the
variant, the source, the flags, the compiler's ``--version``, torch, Python and the CPU flags.
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
# One library for the CPU kernels: the decode attention and the bf16 layer's fused elementwise
# ops (``cpu_fused_ops.py``), one build, one cache entry, one import.
_SOURCES = tuple(Path(__file__).parent / "csrc" / name
                 for name in ("paged_decode_attention.cpp", "cpu_fused_ops.cpp",
                              "packed_attention.cpp", "lora_segments.cpp",
                              "lora_segments_amx.cpp", "quant_gemm.cpp"))
_HEADERS = tuple(Path(__file__).parent / "csrc" / name  # in the build key too
                 for name in ("amx.h", "lora_segment.h"))
# -fopenmp makes at::parallel_for (an inline OpenMP loop) parallel; the extension then binds to
# torch's own libgomp (same soname, already loaded): one thread pool.
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
VARIANTS = {"native": (), "portable": ("-mno-avx512f",)}  # extra flags per variant
_modules: dict[str, ModuleType | None] = {}
load_seconds = 0.0  # time spent in load() (building or importing), for start-up breakdowns


def kernel_cache_dir() -> Path:
    """``$BOXCAR_KERNEL_CACHE``, else ``~/.cache/boxcar/kernels``."""
    configured = os.environ.get("BOXCAR_KERNEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache/boxcar/kernels"


def default_variant() -> str:
    """``$BOXCAR_CPU_KERNEL_VARIANT`` if set, else ``native``."""
    variant = os.environ.get("BOXCAR_CPU_KERNEL_VARIANT", "native")
    if variant not in VARIANTS:
        raise ValueError(f"BOXCAR_CPU_KERNEL_VARIANT must be one of {sorted(VARIANTS)}, "
                         f"got {variant!r}")
    return variant


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")


def _cflags(variant: str) -> list[str]:
    return [*_CFLAGS, *VARIANTS[variant]]


def _module_name(variant: str) -> str:
    # One Python module name per variant: both can be imported into one process (the tests).
    return _NAME if variant == "native" else f"{_NAME}_{variant}"


def build_key(variant: str = "native") -> str:
    """What the compiled library depends on, hashed: variant, source, flags, compiler, torch,
    Python, CPU."""
    _check_variant(variant)
    digest = hashlib.sha256()
    for source in (*_SOURCES, *_HEADERS):
        digest.update(source.read_bytes())
    digest.update(repr((variant, _cflags(variant), _LDFLAGS, torch.__version__, sys.version,
                        platform.machine())).encode())
    digest.update(_compiler_version().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def library_path(variant: str = "native") -> Path:
    """Where the library for this machine's ``build_key(variant)`` lives (built or not)."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return kernel_cache_dir() / build_key(variant) / f"{_module_name(variant)}{suffix}"


def build(*, quiet: bool = False, variant: str = "native") -> Path:
    """Compile the kernel into the cache unless it is there; return the library's path.

    Raises RuntimeError when it cannot be built (no compiler, no headers).
    """
    target = library_path(variant)
    name = _module_name(variant)
    if target.is_file():
        return target
    if not quiet:
        print(f"[boxcar] building the CPU decode-attention kernel into {target.parent} "
              "(once per machine and torch/compiler version; about 2 min on two cores)...",
              file=sys.stderr, flush=True)
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load as load_extension

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as build_dir:
        try:
            load_extension(
                name=name, sources=[str(source) for source in _SOURCES],
                extra_cflags=_cflags(variant), extra_ldflags=list(_LDFLAGS),
                build_directory=build_dir, verbose=False, is_python_module=True,
            )
        except Exception as exc:
            raise RuntimeError(f"cannot build the CPU decode-attention kernel: {exc}") from exc
        built = Path(build_dir) / f"{name}.so"
        if not built.is_file():
            raise RuntimeError(f"the kernel build left no {built.name} in {build_dir}")
        staged = Path(build_dir) / "staged.so"
        shutil.copyfile(built, staged)
        os.replace(staged, target)  # atomic: another process sees no library or a whole one
    if not quiet:
        print(f"[boxcar] kernel built in {time.monotonic() - start:.1f} s",
              file=sys.stderr, flush=True)
    return target


def load(variant: str | None = None) -> ModuleType | None:
    """The kernel module of ``variant`` (default: ``default_variant()``), built on first use
    (see ``build``); None if it cannot be built here."""
    global load_seconds
    variant = default_variant() if variant is None else variant
    _check_variant(variant)
    if variant in _modules:
        return _modules[variant]
    if os.environ.get("BOXCAR_NO_CPU_KERNELS"):
        _modules[variant] = None
        return None
    start = time.perf_counter()
    name = _module_name(variant)
    module: ModuleType | None
    try:
        path = build(variant=variant)
        if name in sys.modules:  # built and imported by build()'s cpp_extension call
            module = sys.modules[name]
        else:
            module = _import_library(name, path)
    except Exception as exc:  # no compiler, no headers: fall back, loudly
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        module = None
    _modules[variant] = module
    load_seconds += time.perf_counter() - start
    return module


def _import_library(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
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
    *,
    variant: str | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:
    """Attention of each sequence's one query over its cached context, in ``q``'s dtype, into
    ``out`` (contiguous, ``q``'s shape and dtype) when given.

    ``window``: the query sees only the last ``window`` positions (blocks before them are not
    read, so they may be freed); ``soft_cap``: scores become ``cap * tanh(score / cap)``;
    ``sinks``: one logit per head added to each softmax's denominator.

    ``q`` and the cache are float32 or bfloat16 (the cache both K and V alike); a bf16 ``q`` is
    widened to fp32 (exact) inside the kernel and the fp32 result rounded back once.
    """
    module = load(variant)
    if module is None:
        raise RuntimeError("the CPU paged-attention kernel is not available")
    check_query_and_cache(q, k_cache, v_cache, "num_seqs")
    if block_tables.shape[0] != q.shape[0] or context_lens.shape[0] != q.shape[0]:
        raise ValueError("block_tables and context_lens need one row per sequence")
    floats = (torch.float32, torch.bfloat16)
    for name, t, dtypes in (
        ("q", q, floats), ("k_cache", k_cache, floats), ("v_cache", v_cache, (k_cache.dtype,)),
        ("block_tables", block_tables, (torch.int32,)),
        ("context_lens", context_lens, (torch.int32,)),
    ):
        if t.dtype not in dtypes or t.device.type != "cpu":
            wanted = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name} must be a CPU {wanted} tensor, got {t.dtype} on {t.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if q.dtype == torch.float32:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(q.shape)} {q.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    check_options(q.shape[1], window, soft_cap, sinks)
    module.paged_decode_attention(
        q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale, out,
        window or 0, soft_cap or 0.0, sinks,
    )
    return out


def check_options(num_heads: int, window: int | None, soft_cap: float | None,
                  sinks: torch.Tensor | None) -> None:
    """The layer options every attention kernel takes, checked the same way."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 (or None), got {window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be > 0 (or None), got {soft_cap}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [{num_heads}] (one per head), got {tuple(sinks.shape)}")


def kernel_isa(variant: str | None = None) -> str | None:
    """The instruction set the loaded kernel runs (``avx512_bf16``, ``avx512``, ``generic``)."""
    module = load(variant)
    return None if module is None else str(module.isa())


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, window: int | None = None,
    soft_cap: float | None = None, sinks: torch.Tensor | None = None,
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
        if window is not None:
            k, v = k[max(0, length - window):], v[max(0, length - window):]
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k.float()) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        probs = F.softmax(scores, dim=-1)[:, : k.shape[0]]
        out[i] = torch.einsum("hl,lhd->hd", probs, v.float()).to(q.dtype)
    return out
