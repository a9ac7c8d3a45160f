"""Packed ragged attention: the Triton kernel (under TRITON_INTERPRET=1 without a GPU) against
its torch reference, the reference against dense attention of each sequence alone, and the CPU
backend (SDPA per sequence) against the reference, encoder (non-causal) and decoder (causal),
with grouped-query heads. A sequence that could see its neighbour would change every check."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.packed_attention import (  # noqa: E402
    PackedConfig,
    packed_attention,
    packed_attention_ref,
)
from engine.layers.attention_metadata import AttentionMetadata  # noqa: E402
from engine.layers.packed_attention import PackedAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILES = PackedConfig(block_m=16, block_n=16)


def _inputs(lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, num_heads, head_dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return q, k, v, torch.tensor(starts, dtype=torch.int32, device=DEVICE)


def _dense(q, k, v, scale, causal):
    """One sequence alone, in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:
        n = q.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1).to(q.device),
                                    float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_reference_equals_each_sequence_alone(causal, heads):
    lens = [1, 7, 16, 33, 2]
    q, k, v, cu = _inputs(lens, *heads, head_dim=16)
    out = packed_attention_ref(q, k, v, cu, 0.25, causal=causal)
    for s, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = _dense(q[lo:hi], k[lo:hi], v[lo:hi], 0.25, causal)
        torch.testing.assert_close(out[lo:hi].double(), alone, atol=1e-5, rtol=1e-5,
                                   msg=f"sequence {s}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[5], [1, 40, 3, 17, 16, 32], [64, 1, 1, 70]])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_kernel_matches_reference(causal, lens, head_dim):
    q, k, v, cu = _inputs(lens, 4, 2, head_dim)
    expected = packed_attention_ref(q, k, v, cu, head_dim**-0.5, causal=causal)
    got = packed_attention(q, k, v, cu, head_dim**-0.5, max(lens), causal=causal,
                           config=SMALL_TILES)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_kernel_bf16_matches_reference():
    q, k, v, cu = _inputs([9, 30, 2], 4, 4, 32, dtype=torch.bfloat16)
    expected = packed_attention_ref(q, k, v, cu, 0.2, causal=False)
    got = packed_attention(q, k, v, cu, 0.2, 30, causal=False, config=SMALL_TILES)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_kernel_checks_its_inputs():
    q, k, v, cu = _inputs([4, 4], 4, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        packed_attention(q, k, v, cu.long(), 1.0, 4, causal=False)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        packed_attention(q, k[:, :1].expand(-1, 3, -1).contiguous(), v[:, :1].expand(
            -1, 3, -1).contiguous(), cu, 1.0, 4, causal=False)


def _metadata(lens, cu) -> AttentionMetadata:
    empty = torch.zeros((0, 1), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=0,
        decode_block_tables=empty, decode_context_lens=torch.zeros(0, dtype=torch.int32),
        num_prefills=len(lens), prefill_query_start_loc=cu, prefill_block_tables=empty,
        prefill_context_lens=torch.tensor(lens, dtype=torch.int32),
        prefill_query_lens_list=list(lens), prefill_context_lens_list=list(lens))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_triton", [False, True])
def test_backend_matches_reference(causal, use_triton):
    lens = [3, 1, 25, 8]
    q, k, v, cu = _inputs(lens, 4, 2, 16)
    backend = PackedAttentionBackend(causal=causal, use_triton=use_triton)
    empty = torch.empty(0)
    got = backend.forward(q, k, v, empty, empty, _metadata(lens, cu), 0.25)
    torch.testing.assert_close(got, packed_attention_ref(q, k, v, cu, 0.25, causal=causal),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 32: all-MiniLM's; 16, 64, 128: the AVX-512 path's other widths; 24: the plain loops
@pytest.mark.parametrize("head_dim", [32, 16, 64, 128, 24])
def test_cpu_kernel_matches_reference(causal, dtype, head_dim):
    from engine.kernels import cpu_packed_attention

    lens = [1, 7, 33, 2, 120, 16]
    q, k, v, cu = _inputs(lens, 6, 2, head_dim, dtype=dtype)
    q, k, v, cu = q.cpu(), k.cpu(), v.cpu(), cu.cpu()
    if not cpu_packed_attention.available(q):
        pytest.skip("the CPU kernel library cannot be built here")
    scale = head_dim**-0.5
    expected = packed_attention_ref(q, k, v, cu, scale, causal=causal)
    # strided rows, as the model hands them over (q/k/v are views of one qkv row)
    qkv = torch.cat([q, k, v], dim=1)
    got = cpu_packed_attention.cpu_packed_attention(qkv[:, :6], qkv[:, 6:8], qkv[:, 8:],
                                                    cu, scale, causal=causal)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2,
                                                                       "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    backend = PackedAttentionBackend(causal=causal, use_triton=False, use_cpu_kernel=True)
    empty = torch.empty(0)
    via_backend = backend.forward(q, k, v, empty, empty, _metadata(lens, cu), scale)
    torch.testing.assert_close(via_backend.float(), expected.float(), **tol)
