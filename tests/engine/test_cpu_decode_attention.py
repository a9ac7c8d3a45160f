"""The C++ CPU paged decode-attention kernel against its reference and a dense softmax."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_decode_attention as kernel

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="no C++ toolchain")


def make_case(num_seqs, num_heads, num_kv_heads, head_dim, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1
    num_blocks = num_seqs * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)  # blocks scattered anywhere
    tables = perm[: num_seqs * max_blocks].view(num_seqs, max_blocks).contiguous()
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,lens",
    [
        (4, 4, 16, 8, [1, 7, 8, 9, 33]),
        (9, 3, 64, 16, [5, 16, 17, 300]),
        (8, 2, 32, 32, [64, 1, 100]),
        (6, 1, 12, 4, [3, 13]),  # head_dim not a multiple of 8
        (8, 2, 128, 16, [1, 50, 200]),  # the head_dim-128 specialisation
        (16, 1, 64, 8, [40, 9]),  # group 16: no specialisation, generic loop
        # 16-token score groups across block edges; more sequences than threads
        (9, 3, 64, 8, [1, 15, 16, 31, 32, 33, 47, 600] * 3),
    ],
)
@pytest.mark.parametrize("scale_factor", [1.0, 12.0])  # 12: a sharp softmax, most exps underflow
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, lens, scale_factor):
    q, k, v, tables, ctx = make_case(len(lens), num_heads, num_kv_heads, head_dim, block_size, lens)
    scale = head_dim**-0.5 * scale_factor
    got = kernel.paged_decode_attention(q, k, v, tables, ctx, scale)
    want = kernel.paged_decode_attention_ref(q, k, v, tables, ctx, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_equals_dense_attention_and_padding_rows_are_zero():
    q, k, v, tables, ctx = make_case(3, 4, 2, 8, 4, [6, 0, 11])
    scale = 0.3
    got = kernel.paged_decode_attention(q, k, v, tables, ctx, scale)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    for i in (0, 2):
        n = int(ctx[i])
        blocks = tables[i, : -(-n // 4)].long()
        keys = k[blocks].reshape(-1, 2, 8)[:n].repeat_interleave(2, dim=1).double()
        vals = v[blocks].reshape(-1, 2, 8)[:n].repeat_interleave(2, dim=1).double()
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), keys) * scale, -1)
        dense = torch.einsum("hl,lhd->hd", probs, vals)
        torch.testing.assert_close(got[i].double(), dense, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_rejected():
    q, k, v, tables, ctx = make_case(2, 4, 2, 8, 4, [3, 5])
    with pytest.raises(ValueError, match="multiple"):
        kernel.paged_decode_attention(q[:, :3], k, v, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="int32"):
        kernel.paged_decode_attention(q, k, v, tables.long(), ctx, 1.0)


# The same cases with a bf16 cache: the kernel widens bf16 to fp32 exactly and accumulates in fp32,
# so it matches the fp32 reference run on the same (bf16-valued) cache to fp32 rounding. The
# portable variant is the fallback of CPUs without AVX-512 (on such a CPU both variants run it).
@pytest.mark.parametrize("variant", ["native", "portable"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,lens",
    [
        (9, 3, 64, 16, [5, 16, 17, 300]),
        (6, 1, 12, 4, [3, 13]),
        (8, 2, 128, 16, [1, 50, 200]),
        (16, 1, 64, 8, [40, 9]),
        (9, 3, 64, 8, [1, 15, 16, 31, 32, 33, 47, 600] * 3),
    ],
)
def test_bf16_cache_matches_reference(variant, num_heads, num_kv_heads, head_dim, block_size,
                                      lens):
    if kernel.load(variant) is None:
        pytest.skip(f"the {variant} variant cannot be built here")
    q, k, v, tables, ctx = make_case(len(lens), num_heads, num_kv_heads, head_dim, block_size, lens)
    # a bf16 model's queries are bf16 values (the AVX512-BF16 path rounds q to bf16)
    q = q.bfloat16().float()
    k, v = k.bfloat16(), v.bfloat16()
    scale = head_dim**-0.5
    got = kernel.paged_decode_attention(q, k, v, tables, ctx, scale, variant=variant)
    want = kernel.paged_decode_attention_ref(q, k.float(), v.float(), tables, ctx, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a bf16 query comes back in bf16, one rounding of the fp32 result
    got_bf16 = kernel.paged_decode_attention(q.bfloat16(), k, v, tables, ctx, scale,
                                             variant=variant)
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, got.bfloat16())


def test_portable_variant_is_generic_and_matches_native():
    """The fallback really is the fallback: built without AVX-512, same results as native."""
    if kernel.load("portable") is None:
        pytest.skip("the portable variant cannot be built here")
    assert kernel.kernel_isa("portable") == "generic"
    assert kernel.kernel_isa("native") in ("generic", "avx512", "avx512_bf16")
    q, k, v, tables, ctx = make_case(4, 9, 3, 64, 16, [5, 16, 17, 300])
    for cache in (k, k.bfloat16()):
        values = v if cache.dtype == torch.float32 else v.bfloat16()
        # with a bf16 cache the AVX512-BF16 path rounds q to bf16 (exact for a bf16 model's
        # queries, which are bf16 values); the portable loops keep q in fp32
        query = q if cache.dtype == torch.float32 else q.bfloat16().float()
        torch.testing.assert_close(
            kernel.paged_decode_attention(query, cache, values, tables, ctx, 0.125,
                                          variant="native"),
            kernel.paged_decode_attention(query, cache, values, tables, ctx, 0.125,
                                          variant="portable"),
            rtol=1e-5, atol=1e-5,
        )


def test_mixed_cache_dtypes_are_rejected():
    q, k, v, tables, ctx = make_case(2, 4, 2, 8, 4, [3, 5])
    with pytest.raises(ValueError, match="v_cache"):
        kernel.paged_decode_attention(q, k.bfloat16(), v, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        kernel.paged_decode_attention(q, k.half(), v.half(), tables, ctx, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_into_out_from_a_strided_query(dtype):
    """The engine's call: q a view of the fused qkv rows, the result written into the first
    rows of the layer's output."""
    q, k, v, tables, ctx = make_case(3, 9, 3, 64, 16, [5, 17, 40])
    k, v = k.to(dtype), v.to(dtype)
    qkv = torch.randn(3, 15 * 64).to(dtype)
    qkv[:, : 9 * 64] = q.reshape(3, -1).to(dtype)
    q_view = qkv[:, : 9 * 64].view(3, 9, 64)
    assert not q_view.is_contiguous()
    want = kernel.paged_decode_attention(q_view.contiguous(), k, v, tables, ctx, 0.125)
    layer_out = torch.full((5, 9, 64), 7.0, dtype=dtype)
    got = kernel.paged_decode_attention(q_view, k, v, tables, ctx, 0.125, out=layer_out[:3])
    assert got.data_ptr() == layer_out.data_ptr()
    assert torch.equal(layer_out[:3], want)
    assert (layer_out[3:] == 7.0).all()
    with pytest.raises(ValueError, match="out must be"):
        kernel.paged_decode_attention(q_view, k, v, tables, ctx, 0.125, out=layer_out[:2])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,lens",
    [
        (4, 2, 16, 8, [1, 7, 8, 9, 33, 70]),  # generic loop
        (8, 2, 64, 16, [5, 16, 17, 40, 300]),  # AVX-512 specialisation (head_dim 64)
        (4, 1, 128, 8, [3, 24, 129]),  # head_dim 128
    ],
)
@pytest.mark.parametrize("window", [None, 1, 5, 16, 37])
@pytest.mark.parametrize("options", ["plain", "soft_cap", "sinks", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_soft_cap_and_sinks_match_reference(num_heads, num_kv_heads, head_dim,
                                                   block_size, lens, window, options, dtype):
    q, k, v, tables, ctx = make_case(len(lens), num_heads, num_kv_heads, head_dim, block_size,
                                     lens, seed=3)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    soft_cap = 2.0 if options in ("soft_cap", "both") else None
    sinks = (torch.randn(num_heads, generator=torch.Generator().manual_seed(5)) * 2
             if options in ("sinks", "both") else None)
    scale = head_dim**-0.5 * 4
    if window is not None:
        # Blocks wholly before every window are never read: poison them.
        for i, n in enumerate(lens):
            for j in range(max(0, n - window) // block_size):
                k[tables[i, j].long()] = float("nan")
                v[tables[i, j].long()] = float("nan")
    got = kernel.paged_decode_attention(q, k, v, tables, ctx, scale, window=window,
                                        soft_cap=soft_cap, sinks=sinks)
    want = kernel.paged_decode_attention_ref(q, k, v, tables, ctx, scale, window, soft_cap, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_sinks_take_probability_mass_and_bad_options_are_refused():
    q, k, v, tables, ctx = make_case(2, 4, 2, 16, 8, [9, 20])
    plain = kernel.paged_decode_attention(q, k, v, tables, ctx, 0.25)
    # A huge sink takes (almost) all the mass: the output shrinks toward zero.
    sunk = kernel.paged_decode_attention(q, k, v, tables, ctx, 0.25, sinks=torch.full((4,), 50.0))
    assert sunk.abs().max() < 1e-6 < plain.abs().max()
    with pytest.raises(ValueError, match="window"):
        kernel.paged_decode_attention(q, k, v, tables, ctx, 0.25, window=0)
    with pytest.raises(ValueError, match="sinks"):
        kernel.paged_decode_attention(q, k, v, tables, ctx, 0.25, sinks=torch.zeros(3))
