"""FP8 e4m3 weights: the scale layouts read against the tests' writer, the Triton kernel (its own
decoding of the codes included) against the torch reference, and the ``torch._scaled_mm`` path
(which runs on the CPU too) against the reference within FP8 activation rounding. Without a GPU
the kernel runs on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.fp8_weights import (  # noqa: E402
    Fp8Weight,
    dequantize_fp8,
    linear_reference,
    scaled_mm_linear,
)
from engine.kernels.triton_fp8_gemm import fp8_gemm  # noqa: E402
from tests.engine.quant_checkpoints import quantize_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.1


@pytest.mark.parametrize(("strategy", "block", "scale_shape", "layout"), [
    ("tensor", None, (1,), (40, 96)),
    ("channel", None, (40, 1), (1, 96)),
    ("block", (16, 32), (3, 3), (16, 32)),  # the last row block is partial (40 = 16 + 16 + 8)
    ("block", (128, 128), (1, 1), (128, 128)),  # DeepSeek's blocks, larger than the weight
])
def test_every_scale_layout_dequantizes_as_the_writer(strategy, block, scale_shape, layout):
    w = random_weight(40, 96, seed=1)
    weight, scale, dense = quantize_fp8(w, strategy, block)
    assert scale.shape == scale_shape
    kept = Fp8Weight.from_checkpoint(weight, scale, block)
    assert kept.block == layout and (kept.out_features, kept.in_features) == (40, 96)
    assert torch.equal(kept.dequantize(), dense)
    assert kept.nbytes == 40 * 96 + scale.numel() * 4
    assert kept.per_channel == (strategy in ("tensor", "channel"))
    assert (dense - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits


def test_bf16_scales_are_read_exactly():
    weight, scale, dense = quantize_fp8(random_weight(16, 32, seed=2), "channel",
                                        scale_dtype=torch.bfloat16)
    assert scale.dtype == torch.bfloat16
    assert torch.equal(Fp8Weight.from_checkpoint(weight, scale).dequantize(), dense)


def test_scales_that_do_not_fit_are_refused():
    weight, scale, _ = quantize_fp8(random_weight(40, 96, seed=3), "block", (16, 32))
    with pytest.raises(ValueError, match=r"blocks of 16 x 32 over a weight \(40, 96\) need"):
        Fp8Weight.from_checkpoint(weight, scale[:2], (16, 32))
    with pytest.raises(ValueError, match=r"per tensor\) or \[40, 1\]"):
        Fp8Weight.from_checkpoint(weight, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight.from_checkpoint(weight.to(torch.float8_e5m2), scale, (16, 32))


def test_kernel_decodes_every_code():
    """Row n of the weight holds code n only; a row of ones sums it 16 times: the kernel's bit
    decoding (normals, subnormals, both zeros, signs) against torch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # not the NaNs
    weight = codes[:, None].expand(-1, 16).contiguous().view(torch.float8_e4m3fn)
    x = torch.ones(1, 16, device=DEVICE)
    out = fp8_gemm(x, weight.to(DEVICE), torch.ones(1, 1, device=DEVICE), (254, 16))
    assert torch.equal(out[0].cpu(), weight[:, 0].float() * 16)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the reference up to the output's rounding (and fp32 summation order); bf16 gets
    two units in the last place: Triton's interpreter may round bf16 differently from torch."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("strategy", "block"), [
    ("tensor", None), ("channel", None), ("block", (16, 32)), ("block", (24, 48)),
])
def test_kernel_matches_reference(strategy, block, dtype):
    """Odd M, N = 40 (partial column tile and scale block), K = 96 (partial 48-wide blocks
    take 16-wide K tiles)."""
    weight, scale, _ = quantize_fp8(random_weight(40, 96, seed=4), strategy, block)
    kept = Fp8Weight.from_checkpoint(weight, scale, block).to(DEVICE)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(40, generator=g).to(DEVICE, dtype)
    for m in (1, 7, 33):
        x = torch.randn(m, 96, generator=g).to(DEVICE, dtype)
        _close(kept.kernel_linear(x, bias), linear_reference(x, kept, bias), dtype)
    x = torch.randn(2, 3, 96, generator=g).to(DEVICE, dtype)
    _close(kept.kernel_linear(x), linear_reference(x, kept), dtype)


@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_is_the_reference_within_fp8_activations(rowwise):
    """``torch._scaled_mm`` with the activations quantized on the fly (on the CPU here, the FP8
    tensor cores on a GPU): within e4m3's rounding of the activations (3 mantissa bits: ~2-3%
    of the output's norm) of the reference."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < ((9, 0) if rowwise else (8, 9)):
        pytest.skip("no FP8 tensor cores (or no row-wise scaling) on this GPU")
    weight, scale, _ = quantize_fp8(random_weight(48, 128, seed=5), "channel")
    kept = Fp8Weight.from_checkpoint(weight, scale).to(DEVICE)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(9, 128, generator=g).to(DEVICE)
    x[0] *= 50  # one loud row (a float format: the others keep their relative precision)
    bias = torch.randn(48, generator=g).to(DEVICE)
    out = scaled_mm_linear(x, kept.weight, kept.channel_scales(), rowwise=rowwise, bias=bias)
    ref = linear_reference(x, kept, bias)
    assert out.dtype == x.dtype and out.shape == (9, 48)
    error = (out - ref).norm(dim=1) / ref.norm(dim=1)  # [9]
    assert error.max() < 0.05


def test_dequantize_fp8_takes_the_partial_blocks_scale():
    weight = torch.ones(3, 5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert dequantize_fp8(weight, scale, (2, 4)).tolist() == [
        [1, 1, 1, 1, 2], [1, 1, 1, 1, 2], [3, 3, 3, 3, 4]]


def test_launcher_checks_shapes():
    weight = torch.zeros(16, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight float8_e4m3fn"):
        fp8_gemm(torch.zeros(2, 64), weight.float(), torch.ones(1, 1), (16, 64))
    with pytest.raises(ValueError, match=r"scale must be float32 \(1, 2\)"):
        fp8_gemm(torch.zeros(2, 64), weight, torch.ones(1, 1), (16, 32))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        fp8_gemm(torch.zeros(2, 64), weight, torch.ones(2, 3), (8, 24))
    with pytest.raises(ValueError, match="has 64 inputs, x has 32"):
        fp8_gemm(torch.zeros(2, 32), weight, torch.ones(1, 1), (16, 64))


@pytest.mark.parametrize("split_k", [2, 5])
def test_split_k_matches_reference(split_k):
    weight, scale, _ = quantize_fp8(random_weight(40, 96, seed=6), "block", (16, 32))
    kept = Fp8Weight.from_checkpoint(weight, scale, (16, 32)).to(DEVICE)
    g = torch.Generator().manual_seed(15)
    x = torch.randn(2, 96, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    out = fp8_gemm(x, kept.weight, kept.scale, kept.block, bias, split_k=split_k)
    _close(out, linear_reference(x, kept, bias), torch.float32)
