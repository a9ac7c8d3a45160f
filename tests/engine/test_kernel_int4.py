"""AWQ / GPTQ int4: the packings read against hand-made words and the tests' writer, the weight the
engine keeps against the references, and the Triton kernel against the torch reference. Without
a GPU the kernel runs on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.int4_weights import (  # noqa: E402
    Int4Weight,
    dequantize_awq,
    dequantize_gptq,
    linear_reference,
    pack_int32,
    unpack_awq,
    unpack_int32,
)
from engine.kernels.triton_int4_gemm import int4_gemm  # noqa: E402
from tests.engine.quant_checkpoints import (  # noqa: E402
    pack_sequential,
    quantize_awq,
    quantize_gptq,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * 0.1


def test_words_unpack_in_each_formats_order():
    # AWQ: nibble i (from the low end) holds output AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7
    awq = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_awq(awq).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    # GPTQ: nibble j of a qweight word is input 8r + j; a top nibble of 15 makes it negative
    gptq = torch.tensor([[0x76543210], [-0x0EDCBA99]], dtype=torch.int32)  # 0xF1234567
    assert unpack_int32(gptq).tolist() == [list(range(8)), [7, 6, 5, 4, 3, 2, 1, 15]]
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int32(pack_int32(codes)).long(), codes)
    assert torch.equal(pack_int32(codes), pack_sequential(codes, 1))


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_reference_and_kept_weight_equal_the_writer(group_size):
    w = random_weight(48, 256, seed=group_size)
    tensors, dense = quantize_awq(w, group_size)
    assert tensors["qweight"].shape == (256, 6) and tensors["scales"].dtype == torch.float16
    assert torch.equal(dequantize_awq(**tensors, group_size=group_size), dense)
    kept = Int4Weight.from_awq(**tensors, group_size=group_size)
    assert (kept.out_features, kept.in_features) == (48, 256)
    assert torch.equal(kept.dequantize(), dense)
    assert kept.nbytes == 256 * 48 // 2 + (256 // group_size) * 48 * 3  # codes, zeros, scales
    assert (dense - w).abs().max() <= tensors["scales"].float().max()  # a step at most


@pytest.mark.parametrize(("group_size", "act_order", "sym", "v2"), [
    (32, False, True, False),  # the common v1 checkpoint: zeros stored as 7
    (64, True, True, False),
    (128, True, False, True),
    (None, False, False, True),  # group_size -1: one group a row
])
def test_gptq_reference_and_kept_weight_equal_the_writer(group_size, act_order, sym, v2):
    w = random_weight(40, 256, seed=7)
    tensors, dense = quantize_gptq(w, group_size, act_order=act_order, sym=sym, v2=v2)
    zero_offset = 0 if v2 else 1
    if sym and not v2:
        assert (tensors["qzeros"] == 0x77777777).all()
    assert torch.equal(dequantize_gptq(**tensors, zero_offset=zero_offset), dense)
    kept = Int4Weight.from_gptq(**tensors, group_size=group_size, zero_offset=zero_offset)
    assert (kept.perm is not None) == act_order
    assert torch.equal(kept.dequantize(), dense)


def test_a_v1_zero_of_fifteen_reads_as_sixteen():
    """v1 stores zero - 1, so a stored 15 is a zero point of 16 (vLLM's kernels read it so); the
    kept weight's uint8 zeros hold it."""
    qweight = torch.zeros(1, 8, dtype=torch.int32)  # 8 inputs, 8 outputs, all codes 0
    qzeros = torch.tensor([[-1]], dtype=torch.int32)  # every nibble 15
    scales = torch.ones(1, 8, dtype=torch.float16)
    g_idx = torch.zeros(8, dtype=torch.int32)
    assert (dequantize_gptq(qweight, qzeros, scales, g_idx, 1) == -16).all()
    kept = Int4Weight.from_gptq(qweight, qzeros, scales, g_idx, None, 1)
    assert (kept.zeros == 16).all() and (kept.dequantize() == -16).all()


def test_tensors_that_do_not_fit_are_named():
    tensors, _ = quantize_awq(random_weight(16, 64, seed=1), 32)
    with pytest.raises(ValueError, match="qzeros has shape"):
        Int4Weight.from_awq(tensors["qweight"], tensors["qzeros"][:1], tensors["scales"], 32)
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        Int4Weight.from_awq(**tensors, group_size=128)
    with pytest.raises(ValueError, match="scales must be floating point"):
        Int4Weight.from_awq(tensors["qweight"], tensors["qzeros"], tensors["qzeros"], 32)
    gptq, _ = quantize_gptq(random_weight(16, 64, seed=1), 32, act_order=False, sym=True,
                            v2=False)
    with pytest.raises(ValueError, match="qweight must be a 2-D int32"):
        Int4Weight.from_gptq(gptq["qweight"].float(), gptq["qzeros"], gptq["scales"],
                             gptq["g_idx"], 32, 1)
    with pytest.raises(ValueError, match="g_idx must hold group numbers 0..1"):
        Int4Weight.from_gptq(gptq["qweight"], gptq["qzeros"], gptq["scales"],
                             gptq["g_idx"] + 1, 32, 1)
    uneven = torch.zeros_like(gptq["g_idx"])
    uneven[-1] = 1  # 63 inputs in group 0, one in group 1
    with pytest.raises(ValueError, match="every group 32 inputs"):
        Int4Weight.from_gptq(gptq["qweight"], gptq["qzeros"], gptq["scales"], uneven, 32, 1)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal to the reference up to the output's rounding (and fp32 summation order); bf16 gets
    two units in the last place: Triton's interpreter may round bf16 differently from torch."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    scale = ref.float().abs().max().item()
    assert out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
def test_kernel_matches_reference(group_size, dtype):
    """Odd M, N not a multiple of the column tile, K three groups (or 96 in one group)."""
    in_features = 3 * (group_size or 32)
    w = random_weight(40, in_features, seed=3)
    tensors, _ = quantize_gptq(w, group_size, act_order=False, sym=False, v2=True)
    kept = Int4Weight.from_gptq(**tensors, group_size=group_size, zero_offset=0).to(DEVICE)
    g = torch.Generator().manual_seed(11)
    bias = torch.randn(40, generator=g).to(DEVICE, dtype)
    for m in (1, 7, 33):
        x = torch.randn(m, in_features, generator=g).to(DEVICE, dtype)
        out = int4_gemm(x, kept.qweight, kept.zeros, kept.scales, kept.group_size, bias)
        _close(out, linear_reference(x, kept, bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_linear_of_awq_and_act_order_weights(dtype):
    """Through ``kernel_linear``: AWQ repacked, GPTQ act-order's gathered activation columns,
    a leading batch shape, no bias."""
    g = torch.Generator().manual_seed(5)
    awq, _ = quantize_awq(random_weight(24, 128, seed=8), 64)
    gptq, _ = quantize_gptq(random_weight(24, 128, seed=9), 32, act_order=True, sym=True,
                            v2=False)
    for kept in (Int4Weight.from_awq(**awq, group_size=64),
                 Int4Weight.from_gptq(**gptq, group_size=32, zero_offset=1)):
        kept = kept.to(DEVICE)
        x = torch.randn(2, 5, 128, generator=g).to(DEVICE, dtype)
        out = kept.kernel_linear(x)
        assert out.shape == (2, 5, 24)
        _close(out, linear_reference(x, kept), dtype)


def test_cpu_linear_is_the_reference():
    tensors, dense = quantize_awq(random_weight(16, 64, seed=2), 32)
    kept = Int4Weight.from_awq(**tensors, group_size=32)
    x = torch.randn(3, 64)
    assert torch.equal(kept.linear(x), torch.nn.functional.linear(x, dense))


def test_launcher_checks_shapes():
    qweight = torch.zeros(8, 16, dtype=torch.int32)  # K = 64, N = 16
    zeros = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.ones(2, 16)
    x = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="packs 64 inputs, x has 32"):
        int4_gemm(torch.zeros(3, 32), qweight, zeros, scales, 32)
    with pytest.raises(ValueError, match="group size 16 is not supported"):
        int4_gemm(x, qweight, torch.zeros(4, 16, dtype=torch.uint8), torch.ones(4, 16), 16)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_gemm(x, qweight, zeros.int(), scales, 32)
    with pytest.raises(ValueError, match="bias must be"):
        int4_gemm(x, qweight, zeros, scales, 32, torch.zeros(15))
    assert int4_gemm(torch.zeros(0, 64), qweight, zeros, scales, 32).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_split_k_matches_reference(split_k, dtype):
    """K cut into slices (the decode shape's path on a GPU), uneven ones and slices left empty
    (7 slices of 5 K tiles) included; the bias added once."""
    tensors, _ = quantize_gptq(random_weight(40, 160, seed=4), 32, act_order=False, sym=True,
                               v2=False)
    kept = Int4Weight.from_gptq(**tensors, group_size=32, zero_offset=1).to(DEVICE)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 160, generator=g).to(DEVICE, dtype)
    bias = torch.randn(40, generator=g).to(DEVICE, dtype)
    out = int4_gemm(x, kept.qweight, kept.zeros, kept.scales, 32, bias, split_k=split_k)
    _close(out, linear_reference(x, kept, bias), dtype)
