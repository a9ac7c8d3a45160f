"""The Triton kernel for ggml's block formats (``triton_ggml_gemm``) against ``dequantize`` and
``linear_reference`` on every format. Without a GPU it runs on CPU tensors under
TRITON_INTERPRET=1 (conftest sets it), with small shapes: the interpreter runs each program in
numpy.

Tolerance. The kernel's weights equal ``dequantize``'s bit for bit (checked on its own: an
identity matrix of activations gives back the dequantized weight), so in fp32 the kernel and the
reference differ only in the order of each dot product's K additions: at most about
4 sqrt(K) u A each (u = 2^-24, A = sum_k |x_k w_k|, computed in float64; test_quant_gemm.py's
module docstring has the reasoning), twice that between the two. In bf16 the kernel also rounds
each weight to bf16 before the product (the reference multiplies the fp32 weights), at most
2^-9 A in all, and either output rounds by 2^-9 of itself: 2^-8 (A + |reference|) covers both.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.ggml_quants import FORMATS, dequantize, random_rows  # noqa: E402
from engine.kernels.quant_gemm import QuantWeight, linear_reference, pack  # noqa: E402
from engine.kernels.triton_ggml_gemm import ggml_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIMPLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def _depth(fmt: str) -> int:
    """Several blocks: 5 of 32 (two 64-wide K tiles and half of one), or 2 super-blocks."""
    return 160 if fmt in SIMPLE else 512


def _weight(fmt: str, out_features: int, in_features: int, seed: int) -> QuantWeight:
    """ggml's rows of random valid blocks, as a CUDA engine keeps them (never the C++ tiles)."""
    data = random_rows(fmt, out_features, in_features, torch.Generator().manual_seed(seed))
    return QuantWeight(fmt, data.to(DEVICE), out_features, in_features)


def _run(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
         **options: int) -> torch.Tensor:
    return ggml_linear(x, w.fmt, w.raw(), w.in_features, w.out_features, bias, **options)


def _reference(x: torch.Tensor, w: QuantWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear_reference`` on the CPU (see ``test_rows_dequantize_on_another_device``)."""
    on_cpu = QuantWeight(w.fmt, w.raw().cpu(), w.out_features, w.in_features)
    return linear_reference(x.cpu(), on_cpu, None if bias is None else bias.cpu())


def _assert_matches_reference(out: torch.Tensor, x: torch.Tensor, w: QuantWeight,
                              bias: torch.Tensor | None) -> None:
    """``out`` equals ``linear_reference(x, w, bias)`` within the module's tolerance."""
    ref = _reference(x, w, bias)
    out, x = out.cpu(), x.cpu()
    assert out.dtype == x.dtype and out.shape == ref.shape
    dense = dequantize(w.fmt, w.raw().cpu(), w.in_features)
    magnitude = x.double().abs() @ dense.double().abs().T  # A
    if x.dtype == torch.float32:
        atol = 8 * w.in_features ** 0.5 * 2.0 ** -24 * magnitude
    else:
        atol = 2.0 ** -8 * (magnitude + ref.double().abs())
    error = (out.double() - ref.double()).abs()
    worst = (error - atol).max()
    assert worst <= 0, f"off by {error.max():.3g} (allowed {atol.flatten()[error.argmax()]:.3g})"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_weights_equal_dequantize_bit_for_bit(fmt):
    # x = I: each output is one weight times 1 plus zeros, exact in fp32 ("ieee", no TF32)
    w = _weight(fmt, 24, _depth(fmt), seed=1)
    eye = torch.eye(w.in_features, device=DEVICE)
    out = _run(eye, w)
    assert torch.equal(out.T.cpu(), dequantize(fmt, w.raw().cpu(), w.in_features))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kernel_equals_the_reference(fmt):
    # 70 outputs: a full and a partial column tile; 1, 3 (with a leading batch dim) and 17 rows
    # (a full row tile and one more)
    w = _weight(fmt, 70, _depth(fmt), seed=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(70, generator=g).to(DEVICE)
    for shape in ((1, w.in_features), (1, 3, w.in_features), (17, w.in_features)):
        x = torch.randn(*shape, generator=g).to(DEVICE)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            for b in (None, bias.to(dtype)):
                out = _run(xd, w, b)
                assert out.shape == (*shape[:-1], 70)
                _assert_matches_reference(out, xd, w, b)


@pytest.mark.parametrize("fmt", ["Q5_1", "Q6_K"])
def test_float16_activations(fmt):
    w = _weight(fmt, 24, _depth(fmt), seed=4)
    x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = _run(x.half(), w)
    ref = _reference(x.half(), w)
    assert out.dtype == torch.float16
    scale = ref.float().abs().max().item()
    assert (out.cpu().float() - ref.float()).abs().max().item() <= 2e-3 * scale


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("split_k", [3, 7])
def test_split_k_matches_the_reference(fmt, split_k):
    """K cut into slices (a decode step's path on a GPU): uneven ones and, with 7 slices of 3 or
    8 K tiles, empty ones; the bias added once."""
    w = _weight(fmt, 40, _depth(fmt), seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, w.in_features, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    _assert_matches_reference(_run(x, w, bias, split_k=split_k), x, w, bias)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("block_k", [32, 128, 256])
def test_every_k_tile(fmt, block_k):
    # 32: one 32-block (two of Q6_K's 16-value sub-blocks); 256: a whole super-block, or 8
    # blocks of 32 in a 160-deep row's partly empty tile
    w = _weight(fmt, 24, _depth(fmt), seed=8)
    x = torch.randn(2, w.in_features, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    _assert_matches_reference(_run(x, w, block_k=block_k), x, w, None)


@pytest.mark.skipif(DEVICE != "cuda", reason="QuantWeight.linear takes the kernel for a weight "
                    "on CUDA")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quant_weight_on_cuda_takes_the_kernel(fmt):
    data = random_rows(fmt, 40, _depth(fmt), torch.Generator().manual_seed(10))
    w = pack(fmt, data, _depth(fmt)).to("cuda")  # ggml's rows moved to the GPU
    assert not w.kernel and w.device.type == "cuda"
    x = torch.randn(2, 3, w.in_features, device="cuda")
    out = w.linear(x)
    assert out.shape == (2, 3, 40)
    _assert_matches_reference(out.reshape(6, 40), x.reshape(6, -1), w, None)


def test_launcher_checks_shapes():
    w = _weight("Q8_0", 8, 64, seed=0)
    data = w.raw()
    x = torch.zeros(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"Q8_0 data must be uint8 \[8, 68\]"):
        ggml_linear(x, "Q8_0", data[:, :67], 64, 8)
    with pytest.raises(ValueError, match=r"Q8_0 data must be uint8 \[7, 68\]"):
        ggml_linear(x, "Q8_0", data, 64, 7)
    with pytest.raises(ValueError, match=r"x must be float32, float16 or bfloat16 \[\.\.\., 64\]"):
        ggml_linear(torch.zeros(3, 32, device=DEVICE), "Q8_0", data, 64, 8)
    with pytest.raises(ValueError, match="x must be float32"):
        ggml_linear(x.double(), "Q8_0", data, 64, 8)
    with pytest.raises(ValueError, match="x is on meta, the weight on cpu"):
        ggml_linear(x.to("meta"), "Q8_0", data, 64, 8)
    with pytest.raises(ValueError, match="bias must be"):
        ggml_linear(x, "Q8_0", data, 64, 8, torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="block_k must be one of"):
        ggml_linear(x, "Q8_0", data, 64, 8, block_k=48)
    with pytest.raises(ValueError, match="unknown ggml format 'Q3_K'"):
        ggml_linear(x, "Q3_K", data, 64, 8)
    assert ggml_linear(torch.zeros(2, 0, 64, device=DEVICE), "Q8_0", data, 64, 8).shape == (
        2, 0, 8)


# QuantWeight.rows on a weight off the CPU (a GPU's embedding lookup) dequantizes there: every
# format's bit shifts are made on the data's device (meta stands in for CUDA here).
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rows_dequantize_on_another_device(fmt):
    w = QuantWeight(fmt, random_rows(fmt, 6, 256, torch.Generator()).to("meta"), 6, 256)
    assert w.rows(torch.tensor([4, 1]), torch.bfloat16).shape == (2, 256)
