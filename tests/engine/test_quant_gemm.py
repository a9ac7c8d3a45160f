"""QuantWeight: pack's checks, the reference product, rows(), raw() and to(); and the C++ kernel
(every path: fused, panel, the generic fallback, auto) against the reference on every format.

Tolerance. The kernel's dequantized weights equal gguf's bit for bit (csrc/quant_gemm.cpp), so
kernel and reference differ only in the order of each fp32 dot product's K additions. Each
addition rounds by at most u = 2^-24 of a partial sum, and no partial sum exceeds
A = sum_k |x_k w_k|; the rounding errors, of random sign, add up like a random walk: about
sqrt(K) * u * A, for either order. The tests allow 4 sqrt(K) u A per output (A computed in
float64 from |x| @ |W|.T), and in bf16 also one bf16 rounding step (2^-8 of the value), since
two fp32 sums a hair apart may round to neighbouring bf16 values. On unit-scale data (A ~ K/2)
that is ~1e-4 * sqrt(K) at K = 768, in line with what fp32 GEMMs are held to, while a single
wrong weight moves an output by ~|x_k w_k| ~ 0.5. Where a bf16 x takes the bf16 panel
(``bf16_panel``: a CPU with AVX512-BF16), the reference's weights are the dequantized values
rounded to bf16 (the dequantize mode's bf16 weights), with the same tolerance: bf16 products are
exact in fp32.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.ggml_quants import FORMATS, dequantize, random_rows, row_bytes
from engine.kernels.quant_gemm import (
    PATHS,
    QuantWeight,
    amx_available,
    bf16_panel,
    kernel_formats,
    kernel_isa,
    linear_reference,
    pack,
    quant_linear,
)

needs_kernel = pytest.mark.skipif(not kernel_formats(), reason="the CPU kernel library is "
                                  "not built here")


def _weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[
        QuantWeight, torch.Tensor]:
    data = random_rows(fmt, out_features, in_features, torch.Generator().manual_seed(seed))
    return pack(fmt, data, in_features), data


def _assert_matches(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor,
                    bias: torch.Tensor | None, path: str = "auto") -> None:
    """``out`` equals (x.float() @ dense.T + bias).to(x.dtype) within the module's tolerance;
    ``dense`` rounded to bf16 first where ``path`` takes the bf16 panel for ``x``."""
    if bf16_panel(x.dtype, x.numel() // x.shape[-1], path):
        dense = dense.to(torch.bfloat16).float()
    x64, w64 = x.double(), dense.double()
    exact = x64 @ w64.T + (bias.double() if bias is not None else 0)
    magnitude = x64.abs() @ w64.abs().T  # A: the largest a partial sum can be
    depth = x.shape[-1]
    atol = 4 * depth ** 0.5 * 2.0 ** -24 * magnitude
    if out.dtype == torch.bfloat16:
        atol = atol + 2.0 ** -8 * exact.abs()
    error = (out.double() - exact).abs()
    worst = (error - atol).max()
    assert worst <= 0, f"off by {error.max():.3g} (allowed {atol.flatten()[error.argmax()]:.3g})"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_pack_keeps_ggml_bytes(fmt):
    in_features = 2 * FORMATS[fmt].block_size
    w, data = _weight(fmt, 21, in_features)
    assert (w.fmt, w.out_features, w.in_features) == (fmt, 21, in_features)
    assert w.kernel == (fmt in kernel_formats())
    assert torch.equal(w.raw(), data)
    assert torch.equal(w.dequantize(), dequantize(fmt, data, in_features))
    assert w.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_resident_bytes_within_the_issue_bound(fmt):
    # the issue's target: at most 1.15x ggml's bytes (tiles pad the last 8 rows; K-quants keep
    # their 6-bit scales a byte each)
    in_features = 4 * FORMATS[fmt].block_size
    w, data = _weight(fmt, 576, in_features)
    assert w.nbytes <= 1.03 * data.nbytes
    small, small_data = _weight(fmt, 13, in_features)
    assert small.nbytes <= 16 / 13 * 1.03 * small_data.nbytes


def test_pack_errors():
    with pytest.raises(ValueError, match=r"Q4_K expects 288 bytes a row \(2 blocks of 144 "
                                         r"bytes for 512 values\), got 287"):
        pack("Q4_K", torch.zeros(4, 287, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack("Q8_0", torch.zeros(4, 34), 32)
    with pytest.raises(ValueError, match="2-D uint8"):
        pack("Q8_0", torch.zeros(34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="blocks of 32 values; in_features=40"):
        pack("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 40)
    with pytest.raises(ValueError, match="unknown ggml format"):
        pack("F16", torch.zeros(4, 34, dtype=torch.uint8), 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_is_the_dequantized_product(dtype, with_bias):
    w, data = _weight("Q4_K", 13, 512)
    x = torch.randn(2, 5, 512).to(dtype)
    bias = torch.randn(13) if with_bias else None
    dense = dequantize("Q4_K", data, 512)
    expected = x.float() @ dense.T + (bias if bias is not None else 0)
    out = linear_reference(x, w, bias)
    assert out.shape == (2, 5, 13) and out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="x has 256 features, the weight takes 512"):
        linear_reference(torch.randn(3, 256), w)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q6_K", "Q4_1"])
def test_rows_are_the_dequantized_rows(fmt):
    w, _ = _weight(fmt, 43, 256)
    ids = torch.tensor([[3, 0, 42], [3, 17, 8]])
    got = w.rows(ids, torch.float32)
    assert got.shape == (2, 3, 256)
    assert torch.equal(got, w.dequantize()[ids])
    assert torch.equal(w.rows(ids, torch.bfloat16), w.dequantize(torch.bfloat16)[ids])
    assert w.rows(torch.tensor([], dtype=torch.long), torch.float32).shape == (0, 256)
    with pytest.raises(IndexError):
        w.rows(torch.tensor([43]), torch.float32)  # a padding row of the last tile is no row


def test_to_the_same_device_is_itself():
    w, data = _weight("Q5_0", 9, 64)
    assert w.to("cpu") is w
    assert torch.equal(w.to("cpu").raw(), data)


def test_kernel_formats_are_known_formats():
    assert kernel_formats() <= set(FORMATS)


@needs_kernel
def test_every_format_has_a_kernel():
    assert kernel_formats() == set(FORMATS)
    assert kernel_isa() in ("avx512_bf16", "avx2", "generic")


def test_row_bytes_of_a_packed_weight():
    w, _ = _weight("Q5_K", 3, 768)
    assert w.raw().shape == (3, row_bytes("Q5_K", 768))


def _dtypes(path: str) -> tuple[torch.dtype, ...]:
    """x's dtypes a path takes: ``amx`` only bf16, and only where the CPU has the tiles (none
    elsewhere)."""
    if path != "amx":
        return (torch.float32, torch.bfloat16)
    return (torch.bfloat16,) if amx_available() else ()


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("path", PATHS)
def test_kernel_equals_the_reference(fmt, path):
    if not _dtypes(path):
        pytest.skip("no AMX tiles on this CPU (or the process may not use them)")
    # odd shapes: 13 rows (a partial tile), 40 (5 tiles: the panel path's last pair has one);
    # one block of depth and many (32-value formats: 9 blocks, past one 256-value panel)
    block = FORMATS[fmt].block_size
    generator = torch.Generator().manual_seed(1)
    for out_features, in_features in ((13, block), (40, block * (3 if block == 256 else 9))):
        w, data = _weight(fmt, out_features, in_features, seed=out_features)
        assert w.kernel
        dense = dequantize(fmt, data, in_features)
        # the AMX path: 17 rows padded to 32; 65 rows two groups of its 64 rows of sums
        for rows in (1, 3, 17, 65):
            x = torch.randn(rows, in_features, generator=generator)
            bias = torch.randn(out_features, generator=generator)
            for dtype in _dtypes(path):
                xd = x.to(dtype)
                for b in (None, bias):
                    out = quant_linear(xd, w, b, path=path)
                    assert out.dtype == dtype and out.shape == (rows, out_features)
                    _assert_matches(out, xd, dense, b, path)


@needs_kernel
@pytest.mark.parametrize("rows", [3, 17])  # the fused path and the (bf16) panel
def test_fp32_out_keeps_the_sums_unrounded(rows):
    # out_dtype=float32 from a bf16 x: the fp32 sums as they are (the logits of a bf16
    # model's kept output layer), not their bf16 rounding widened
    w, data = _weight("Q8_0", 40, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    bias = torch.randn(40)
    out = quant_linear(x, w, bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    _assert_matches(out, x.float(), (dequantize("Q8_0", data, 256).bfloat16().float()
                                     if bf16_panel(x.dtype, rows) else
                                     dequantize("Q8_0", data, 256)), bias)
    assert not torch.equal(out, out.bfloat16().float())
    assert torch.equal(quant_linear(x, w, bias, out_dtype=torch.bfloat16),
                       quant_linear(x, w, bias))
    reference = linear_reference(x, w, bias, out_dtype=torch.float32)
    assert reference.dtype == torch.float32
    assert torch.equal(w.linear(x, bias, out_dtype=torch.float32), out)
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16"):
        quant_linear(x, w, out_dtype=torch.float16)


@needs_kernel
def test_linear_takes_the_kernel_and_keeps_leading_dims():
    w, data = _weight("Q4_0", 24, 64)
    x = torch.randn(2, 3, 64)
    out = w.linear(x)
    assert out.shape == (2, 3, 24)
    _assert_matches(out.reshape(6, 24), x.reshape(6, 64), dequantize("Q4_0", data, 64), None)
    assert w.linear(torch.randn(0, 64)).shape == (0, 24)
    # a dtype the kernel does not take goes to the reference
    half = w.linear(x.half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, linear_reference(x.half(), w))


@needs_kernel
def test_kernel_errors():
    w, _ = _weight("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="x has 32 features, the weight takes 64"):
        w.linear(torch.randn(2, 32))
    with pytest.raises(ValueError, match="path must be one of"):
        quant_linear(torch.randn(2, 64), w, path="fast")
    with pytest.raises(ValueError, match="path='amx' takes a bfloat16 x"):
        quant_linear(torch.randn(2, 64), w, path="amx")
    with pytest.raises(ValueError, match="CPU float32 or bfloat16"):
        quant_linear(torch.randn(2, 64).half(), w)
    raw = QuantWeight("Q8_0", w.raw(), 8, 64)
    with pytest.raises(ValueError, match="not in the kernel's tiles"):
        quant_linear(torch.randn(2, 64), raw)


@needs_kernel
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_repack_round_trips_every_bit(fmt):
    # random bytes everywhere (not only valid scales): the tiles are a permutation of the bits
    in_features = 2 * FORMATS[fmt].block_size
    data = torch.randint(0, 256, (19, row_bytes(fmt, in_features)), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(2))
    w = pack(fmt, data, in_features)
    assert torch.equal(w.raw(), data)
    assert torch.equal(w.rows(torch.tensor([18, 0, 7]), torch.float32).nan_to_num(1e30),
                       dequantize(fmt, data[[18, 0, 7]], in_features).nan_to_num(1e30))


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K"])
def test_panel_blocks_of_rows(fmt):
    # at a depth of 2048 the panel path takes 48 rows at a time: 97 rows are 48 + 48 + 1
    w, data = _weight(fmt, 24, 2048)
    x = torch.randn(97, 2048, generator=torch.Generator().manual_seed(3))
    for path in ("panel", "amx"):
        for dtype in _dtypes(path):
            # the AMX path's sums: 97 rows are 64 + 33 (padded to 48), through memory a panel
            out = quant_linear(x.to(dtype), w, path=path)
            _assert_matches(out, x.to(dtype), dequantize(fmt, data, 2048), None, path)


@needs_kernel
def test_auto_takes_the_amx_tiles_for_bf16_panels():
    if not amx_available():
        pytest.skip("no AMX tiles on this CPU (or the process may not use them)")
    w, _ = _weight("Q4_K", 24, 512)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    amx = quant_linear(x, w, path="amx")
    assert torch.equal(quant_linear(x, w), amx)
    # 4 rows and fewer stay on the fused path under auto (bound by reading the weight)
    assert torch.equal(quant_linear(x[:4], w), quant_linear(x[:4], w, path="fused"))
