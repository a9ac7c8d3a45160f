"""Paged decode attention on the CPU: a small C++ kernel, built on first use, and its reference.

The kernel reads K/V straight from the paged cache, so a decode step costs one pass over each
sequence's context instead of a gather copy plus an attention pass over a padded batch. It is
compiled with torch's cpp_extension into ``~/.cache/torch_extensions`` (a few seconds, once per
machine); where no compiler is available ``load()`` returns None and the engine stays on the pure
PyTorch path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.kernels.checks import check_query_and_cache

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_module: ModuleType | None = None
_tried = False


def load() -> ModuleType | None:
    """Build (or reuse) the extension; None if it cannot be built here."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("BOXCAR_NO_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        _module = load_extension(
            name="boxcar_paged_decode_attention",
            sources=[str(_SOURCE)],
            # -fopenmp makes at::parallel_for (an inline OpenMP loop) parallel; the extension
            # then binds to torch's own libgomp (same soname, already loaded): one thread pool.
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: fall back, loudly
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch path", exc)
        _module = None
    return _module


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
