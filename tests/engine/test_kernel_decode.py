"""paged_decode_attention: kernel vs torch reference, and the reference vs dense naive attention.

Unused cache slots hold NaN, so a kernel that reads past a sequence's context fails loudly. Without
a GPU the kernel runs on CPU tensors under TRITON_INTERPRET=1, set before the kernel is imported.
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.paged_decode_attention import (  # noqa: E402
    DecodeConfig,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def naive_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q K^T) V for one query token over contiguous K/V, head by head, in float64."""
    num_heads, num_kv_heads = q.shape[0], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        scores = (k[:, kv].double() @ q[h].double()) * scale  # [context_len]
        weights = torch.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ v[:, kv].double()
    return out


def make_batch(
    context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3,
) -> tuple[torch.Tensor, ...]:
    """Dense per-sequence K/V scattered into shuffled cache blocks; every other slot is NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(context_lens), max(1, max(blocks_per_seq)), dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    dense_k, dense_v = [], []
    for s, n in enumerate(context_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ids = torch.tensor([free.pop() for _ in range(blocks_per_seq[s])], dtype=torch.int64)
        block_tables[s, : len(ids)] = ids.int()
        pos = torch.arange(n)
        k_cache[ids[pos // block_size], pos % block_size] = k
        v_cache[ids[pos // block_size], pos % block_size] = v
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, lens, dense_k, dense_v


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
def test_reference_matches_dense_naive(num_heads: int, num_kv_heads: int) -> None:
    q, k_cache, v_cache, tables, lens, dense_k, dense_v = make_batch(
        [1, 13, 40], num_heads, num_kv_heads, 16, 8, torch.float32
    )
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    for b in range(q.shape[0]):
        expected = naive_decode(q[b], dense_k[b], dense_v[b], 0.25)
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_kernel_matches_reference(
    device: str, num_heads: int, num_kv_heads: int, block_size: int, num_splits: int | None
) -> None:
    # Partial last blocks, a single-token context, a padded row and a multi-tile context.
    context_lens = [1, block_size + 3, 0, 3 * block_size - 1, 150]
    q, k_cache, v_cache, tables, lens, _, _ = make_batch(
        context_lens, num_heads, num_kv_heads, 32, block_size, torch.float32, seed=block_size
    )
    q, k_cache, v_cache, tables, lens = (t.to(device) for t in (q, k_cache, v_cache, tables, lens))
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2, num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # context_len 0: zeros, not NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_half_precision(device: str, dtype: torch.dtype, num_splits: int) -> None:
    q, k_cache, v_cache, tables, lens, _, _ = make_batch([7, 0, 90], 6, 2, 64, 16, dtype)
    q, k_cache, v_cache, tables, lens = (t.to(device) for t in (q, k_cache, v_cache, tables, lens))
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_more_splits_than_tiles_and_small_tiles(device: str) -> None:
    # Most splits are empty for short contexts; small tiles cross block boundaries.
    q, k_cache, v_cache, tables, lens, _, _ = make_batch([5, 17, 64], 3, 1, 16, 8, torch.float32)
    q, k_cache, v_cache, tables, lens = (t.to(device) for t in (q, k_cache, v_cache, tables, lens))
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    for config in (DecodeConfig(block_n=16), DecodeConfig(block_n=32)):
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, 7, config=config)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query_and_out_buffer(device: str) -> None:
    q, k_cache, v_cache, tables, lens, _, _ = make_batch([9, 33], 4, 2, 16, 8, torch.float32)
    q, k_cache, v_cache, tables, lens = (t.to(device) for t in (q, k_cache, v_cache, tables, lens))
    # q as a view into a fused qkv projection; out as a slice of a larger buffer.
    qkv = torch.zeros(2, 4 + 4, 16, device=device)
    qkv[:, :4] = q
    buffer = torch.full((3, 4, 16), 7.0, device=device)
    out = paged_decode_attention(
        qkv[:, :4], k_cache, v_cache, tables, lens, 0.25, 2, out=buffer[1:]
    )
    assert out.data_ptr() == buffer[1:].data_ptr()
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(buffer[1:], ref, **TOL[torch.float32])
    assert torch.equal(buffer[0], torch.full((4, 16), 7.0, device=device))


def test_default_num_splits_fills_the_machine_from_shapes() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(256, 8, 8192, cpu) == 1
    assert default_num_splits(1, 8, 8192, cpu) > 1
    assert default_num_splits(1, 8, 128, cpu) == 1  # too short to be worth splitting
    assert default_num_splits(1, 1, 1 << 20, cpu) <= 16


def test_rejects_bad_inputs() -> None:
    q, k_cache, v_cache, tables, lens, _, _ = make_batch([4, 8], 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(q, k_cache, v_cache, tables.long(), lens, 1.0)
    with pytest.raises(ValueError, match="context_lens must be"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens[:1], 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_decode_attention(q.half(), k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[:, :, :8], k_cache, v_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, k_cache[:, :6], v_cache[:, :6], tables, lens, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, num_splits=0)


def _poison_before_window(k_cache, v_cache, tables, lens, window, block_size):
    """NaN in every block wholly before a sequence's window: the kernel must never read them."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens.tolist()):
        for j in range(max(0, n - window) // block_size):
            k_cache[tables[b, j].long()] = float("nan")
            v_cache[tables[b, j].long()] = float("nan")
    return k_cache, v_cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 1, 9, 40])
@pytest.mark.parametrize("options", ["plain", "soft_cap", "sinks", "both"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_soft_cap_and_sinks(device: str, window: int | None, options: str,
                                   num_splits: int) -> None:
    block_size = 8
    q, k_cache, v_cache, tables, lens, _, _ = make_batch(
        [1, 11, 0, 47, 150], 6, 2, 32, block_size, torch.float32, seed=window or 0)
    soft_cap = 1.5 if options in ("soft_cap", "both") else None
    sinks = (torch.linspace(-2, 3, 6) if options in ("sinks", "both") else None)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.9, window, soft_cap,
                                     sinks)
    if window is not None:
        k_cache, v_cache = _poison_before_window(k_cache, v_cache, tables, lens, window,
                                                 block_size)
    args = [t.to(device) for t in (q, k_cache, v_cache, tables, lens)]
    out = paged_decode_attention(*args, 0.9, num_splits, window=window, soft_cap=soft_cap,
                                 sinks=None if sinks is None else sinks.to(device))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])
