"""The CPU LoRA segment kernel (``csrc/lora_segments.cpp``) against the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_decode_attention
from engine.layers.lora import KERNEL_MAX_ROWS, LoRAPiece, ModuleLoRA

kernel = cpu_decode_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels cannot be built here")
# Each variant's register blocks: on an AVX-512 CPU native runs the zmm path and portable the
# AVX2 one (two ymm a 16-lane row, 4 rows a block); on an AVX2 CPU both run the AVX2 path.
VARIANTS = ["native", "portable"]


def _module(in_features: int, sizes: list[tuple[int, int]], dtype: torch.dtype,
            g: torch.Generator) -> ModuleLoRA:
    """Pieces of (columns, rank) side by side (the last may leave a tail under 16 columns)."""
    pieces, col, rank_at = [], 0, 0
    for cols, rank in sizes:
        b = torch.randn(cols, rank, generator=g).to(dtype)
        pieces.append(LoRAPiece(col, cols, rank_at, rank, 0.5 + rank / 16, b))
        col, rank_at = col + cols + 3, rank_at + rank
    return ModuleLoRA(torch.randn(rank_at, in_features, generator=g).to(dtype), pieces)


def _reference(x, out, segments):
    ref = out.float().clone()
    for start, end, module in segments:
        y = x[start:end].float() @ module.lora_a.float().T
        for p in module.pieces:
            ref[start:end, p.col_offset: p.col_offset + p.col_size] += p.scaling * (
                y[:, p.rank_offset: p.rank_offset + p.rank] @ p.lora_b.float().T)
    return ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
def test_segments_match_torch(dtype, tol, threads, variant):
    module = cpu_decode_attention.load(variant)
    assert module is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 40, generator=g).to(dtype)
    out = torch.randn(70, 120, generator=g).to(dtype)
    a = _module(40, [(30, 4), (50, 24)], dtype, g)  # column tails, ranks under and over 16
    b = _module(40, [(17, 8)], dtype, g)
    segments = [(0, 1, a), (1, 9, b), (9, 9 + KERNEL_MAX_ROWS - 1, a), (45, 70, b)]
    ref = _reference(x, out, segments)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        module.lora_segments(x, out, [(s, e, *m.kernel_args()) for s, e, m in segments])
    finally:
        torch.set_num_threads(before)
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol * scale
    untouched = torch.ones(70, 120, dtype=torch.bool)
    for s, e, m in segments:
        for p in m.pieces:
            untouched[s:e, p.col_offset: p.col_offset + p.col_size] = False
    assert torch.equal(out.float()[untouched], ref[untouched])  # rows and columns of no piece


def test_bad_layout_is_refused():
    g = torch.Generator().manual_seed(1)
    m = _module(40, [(16, 8)], torch.float32, g)
    x, out = torch.randn(4, 40), torch.zeros(4, 16)
    at, bts, meta = m.kernel_args()
    with pytest.raises(RuntimeError, match="At must be contiguous"):
        kernel.lora_segments(x, out, [(0, 4, m.lora_a, bts, meta)])
    with pytest.raises(RuntimeError, match="outside the batch"):
        kernel.lora_segments(x, out, [(0, 5, at, bts, meta)])
