"""The CPU LoRA segment kernel (``csrc/lora_segments.cpp``) against the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_decode_attention
from engine.lora.layers import KERNEL_MAX_ROWS, LoRAPiece, ModuleLoRA

kernel = cpu_decode_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels cannot be built here")
# Each variant's register blocks: on an AVX-512 CPU native runs the zmm path and portable the
# AVX2 one (two ymm a 16-lane row, 4 rows a block); on an AVX2 CPU both run the AVX2 path. In
# bf16, native runs the AVX512-BF16 pair path where the CPU has it, and "native-amx" the AMX
# tiles where it has those.
VARIANTS = ["native", "portable", "native-amx"]


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
@pytest.mark.parametrize("width", [40, 71])
def test_segments_match_torch(dtype, tol, threads, variant, width):
    amx = variant == "native-amx"
    module = cpu_decode_attention.load("native" if amx else variant)
    assert module is not None
    if amx and not (dtype == torch.bfloat16 and module.lora_amx):
        pytest.skip("AMX runs bf16 only, on CPUs with AMX (lora_amx false here)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, width, generator=g).to(dtype)
    out = torch.randn(70, 120, generator=g).to(dtype)
    # column tails, ranks under and over 16 (and 32: two full tiles of depth and a rest), odd
    a = _module(width, [(30, 4), (50, 35)], dtype, g)
    b = _module(width, [(17, 7)], dtype, g)
    # short and long segments; the last one's rows end at the batch's (a tile past it is padded)
    segments = [(0, 1, a), (1, 9, b), (9, 9 + KERNEL_MAX_ROWS - 1, a), (45, 70, b)]
    ref = _reference(x, out, segments)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        module.lora_segments(x, out, [(s, e, *m.kernel_args(module)) for s, e, m in segments],
                             amx=amx)
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
    at, bts, meta = m.kernel_args(kernel)
    with pytest.raises(RuntimeError, match="At must be contiguous"):
        kernel.lora_segments(x, out, [(0, 4, m.lora_a, bts, meta)])
    with pytest.raises(RuntimeError, match="outside the batch"):
        kernel.lora_segments(x, out, [(0, 5, at, bts, meta)])


def test_bf16_segments_of_any_length_run_in_the_kernel():
    """In bf16 on a CPU with bf16 dot products (AMX tiles or AVX512-BF16 pairs), LoRALinear
    sends a prompt chunk's long segment to the kernel as well (never to oneDNN's packed
    copies), and the delta is the torch ops' within bf16."""
    from engine.layers.linear import Linear
    from engine.lora.layers import LoRABatch, LoRALinear, LoRASegment, lora_batch

    if kernel is None or not kernel.lora_bf16_pairs:
        pytest.skip("no bf16 dot products on this CPU (lora_bf16_pairs false): long segments "
                    "use the libraries")
    g = torch.Generator().manual_seed(4)
    base = Linear(64, 96, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(96, 64, generator=g))
    module = _module(64, [(40, 12), (50, 33)], torch.bfloat16, g)
    long = 3 * KERNEL_MAX_ROWS + 5
    x = torch.randn(long + 9, 64, generator=g).to(torch.bfloat16)
    segments = [(0, long, module), (long + 1, long + 9, module)]
    want = _reference(x, base(x), segments)
    base.pack()
    linear = LoRALinear(base, 0, ("q_proj", "k_proj", "v_proj"), (32, 32, 32))
    batch = LoRABatch([LoRASegment(s, e, "a", [m]) for s, e, m in segments], kernel=kernel)
    with lora_batch(batch):
        got = linear(x)
    assert module._onednn is None and module._kernel is not None  # the kernel took both
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 2e-2 * scale
