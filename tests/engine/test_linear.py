"""Prepacked linears (engine/layers/linear.py): MKL or oneDNN for fp32, oneDNN for bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.linear import (
    Linear,
    bf16_packing_available,
    fp32_gemm,
    mkl_packing_available,
    onednn_linear,
    onednn_packing_available,
    pack_linear_weights,
    row_bucket,
)


def make_linear(dtype: torch.dtype, bias: bool) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(160, generator=g))
    return layer, torch.randn(3, 5, 96, generator=g).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,gemm", [(torch.float32, "mkl"), (torch.float32, "onednn"),
                                        (torch.bfloat16, "onednn")])
def test_packed_equals_plain_linear(dtype, gemm, bias):
    if gemm == "mkl" and not mkl_packing_available():
        pytest.skip("no MKL packing here")
    if gemm == "onednn" and not onednn_packing_available(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    layer, x = make_linear(dtype, bias)
    want = F.linear(x, layer.weight, layer.bias)
    layer.pack(gemm=gemm)
    assert layer.packed_by == gemm
    assert layer.weight.untyped_storage().nbytes() <= layer.weight.element_size()  # dropped
    got = layer(x)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)
    assert layer(x[:0]).shape == (0, 5, 160)


def test_row_buckets_are_few_and_cover_every_row_count():
    buckets = {row_bucket(rows) for rows in range(1, 2049)}
    assert all(row_bucket(rows) >= rows for rows in range(1, 2049))
    assert [row_bucket(r) for r in (1, 16, 17, 32, 33, 256, 257, 321)] == [
        1, 16, 32, 32, 48, 256, 320, 384]
    assert len(buckets) <= 64  # x five weight shapes stays inside oneDNN's 1,024 primitives


@pytest.mark.parametrize("rows", [1, 7, 17, 100, 257])
def test_bucketed_onednn_rows_equal_their_unpadded_results(rows):
    """Padding to the bucket is invisible: the rows asked for, each its own dot products."""
    if not bf16_packing_available():
        pytest.skip("oneDNN packs bf16 only on CPUs with bf16 units")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(160, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(160, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    got = onednn_linear(x, packed, bias)
    assert got.shape == (rows, 160) and got.is_contiguous()
    want = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_gelu_is_gelu_of_the_product(dtype, approximate):
    # bf16 packed by oneDNN: GELU of the fp32 sums inside the product, so within one bf16
    # rounding of GELU of the exact product (the two-step path rounds the product first);
    # fp32, and a plain (unpacked) layer: the two steps themselves
    layer, x = make_linear(dtype, bias=True)
    exact = F.gelu(F.linear(x.double(), layer.weight.double(), layer.bias.double()),
                   approximate=approximate)
    plain = layer.forward_gelu(x, approximate)
    assert torch.equal(plain, F.gelu(layer(x), approximate=approximate))
    if dtype == torch.bfloat16 and not bf16_packing_available():
        pytest.skip("oneDNN packs bf16 only on CPUs with bf16 units")
    layer.pack(gemm="onednn")
    got = layer.forward_gelu(x, approximate)
    assert got.shape == (3, 5, 160) and got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, F.gelu(layer(x), approximate=approximate))
    else:
        # one bf16 rounding (2^-8 relative) of each output, and the products' fp32 sums
        tol = 2.0 ** -8 * exact.abs() + 1e-4 * x.double().abs().sum(-1, keepdim=True)
        assert ((got.double() - exact).abs() <= tol).all()
        two_step = F.gelu(layer(x), approximate=approximate)
        assert not torch.equal(got, two_step)  # the fused path ran: rounded once, not twice
    assert layer.forward_gelu(x[:0], approximate).shape == (0, 5, 160)


def test_packing_refuses_other_dtypes():
    layer, _ = make_linear(torch.float16, bias=False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer.pack()


def test_bf16_packing_refused_with_a_value_error_where_onednn_cannot(monkeypatch):
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "bf16_packing_available", lambda: False)
    layer, x = make_linear(torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="bf16 units"):
        layer.pack()
    assert layer.packed_weight is None  # still a plain linear, still usable
    assert layer(x).shape == (3, 5, 160)


def test_fp32_gemm_is_mkl_on_intel_and_onednn_elsewhere(monkeypatch):
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "mkl_packing_available", lambda: True)
    monkeypatch.setattr(linear, "onednn_packing_available", lambda dtype: True)
    monkeypatch.setattr(linear, "cpu_vendor", lambda: "GenuineIntel")
    assert fp32_gemm() == "mkl"
    assert fp32_gemm("onednn") == "onednn"  # an explicit choice wins
    monkeypatch.setattr(linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert fp32_gemm() == "onednn"
    assert fp32_gemm("mkl") == "mkl"
    monkeypatch.setattr(linear, "onednn_packing_available", lambda dtype: False)
    assert fp32_gemm() == "mkl"  # the other library where the preferred one cannot pack
    with pytest.raises(ValueError, match="cpu_gemm 'onednn'.*cannot pack"):
        fp32_gemm("onednn")
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        fp32_gemm("blas")
    monkeypatch.setattr(linear, "mkl_packing_available", lambda: False)
    assert fp32_gemm() is None  # nothing packs: the linears stay plain


@pytest.mark.parametrize("rows", [1, 7, 17, 100, 257])
def test_onednn_fp32_rows_of_every_bucket_match_plain_linear(rows):
    if not onednn_packing_available(torch.float32):
        pytest.skip("oneDNN does not pack fp32 here")
    layer, _ = make_linear(torch.float32, bias=True)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer, gemm="onednn") == 1
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)


def test_engine_config_names_cpu_gemm_choices():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_gemm must be 'mkl' or 'onednn'"):
        EngineConfig(model="m", cpu_gemm="openblas")


def test_packing_gemm_by_dtype(monkeypatch):
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "fp32_gemm", lambda choice=None: choice or "mkl")
    monkeypatch.setattr(linear, "bf16_packing_available", lambda: True)
    assert linear.packing_gemm(torch.float32) == "mkl"
    assert linear.packing_gemm(torch.float32, "onednn") == "onednn"
    assert linear.packing_gemm(torch.bfloat16, "mkl") == "onednn"  # bf16: oneDNN only
    assert linear.packing_gemm(torch.float16) is None
    monkeypatch.setattr(linear, "bf16_packing_available", lambda: False)
    assert linear.packing_gemm(torch.bfloat16) is None
