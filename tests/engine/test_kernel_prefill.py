"""paged_prefill_attention: kernel vs torch reference, reference vs dense naive causal attention,
and chunked prefill through store_kvcache giving the same result as one whole prefill.

Unused cache slots hold NaN, so reading past a context fails loudly. Without a GPU the kernels run
on CPU tensors under TRITON_INTERPRET=1, set before the kernel modules are imported.
"""

from __future__ import annotations

import math
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.paged_prefill_attention import (  # noqa: E402
    PrefillConfig,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from engine.kernels.store_kvcache import store_kvcache  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
SMALL_TILES = PrefillConfig(block_m=16, block_n=16)


def naive_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """The last ``len(q)`` positions of causal softmax(QK^T)V over contiguous K/V, in float64."""
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        for i in range(query_len):
            visible = context_len - query_len + i + 1
            scores = (k[:visible, kv].double() @ q[i, h].double()) * scale
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v[:visible, kv].double()
    return out


def make_batch(
    query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Each sequence's whole context (prefix + chunk) already in shuffled blocks; rest NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
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
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, starts, lens, dense_k, dense_v


# (query_len, context_len): whole prompts, prefix-cache hits / later chunks, a one-token chunk.
SEQS = [(5, 5), (37, 37), (1, 20), (16, 50), (33, 40)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (3, 1), (4, 1)])
def test_reference_matches_dense_naive(num_heads: int, num_kv_heads: int) -> None:
    query_lens, context_lens = [s[0] for s in SEQS], [s[1] for s in SEQS]
    q, k_cache, v_cache, tables, starts, lens, dense_k, dense_v = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, 8, 8, torch.float32
    )
    out = paged_prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.3)
    for s in range(len(SEQS)):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        expected = naive_causal(q[rows], dense_k[s], dense_v[s], 0.3)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default", "small_tiles"])
def test_kernel_matches_reference(
    device: str, num_heads: int, num_kv_heads: int, block_size: int, config: PrefillConfig | None
) -> None:
    query_lens, context_lens = [s[0] for s in SEQS], [s[1] for s in SEQS]
    batch = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, 32, block_size, torch.float32,
        seed=block_size,
    )
    q, k_cache, v_cache, tables, starts, lens = (t.to(device) for t in batch[:6])
    out = paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, 0.2, max(query_lens), config=config
    )
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(device: str, dtype: torch.dtype) -> None:
    batch = make_batch([20, 3], [20, 45], 4, 2, 64, 16, dtype)
    q, k_cache, v_cache, tables, starts, lens = (t.to(device) for t in batch[:6])
    # max_query_len left out: the launcher reads it from query_start_loc.
    out = paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.125)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_equals_whole_prefill(device: str) -> None:
    """Writing a prompt's K/V chunk by chunk and attending per chunk gives the whole-prompt rows."""
    num_heads, num_kv_heads, head_dim, block_size, prompt_len = 4, 2, 16, 8, 29
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(prompt_len, num_heads, head_dim, generator=gen).to(device)
    k = torch.randn(prompt_len, num_kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(prompt_len, num_kv_heads, head_dim, generator=gen).to(device)
    blocks = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32, device=device)
    shape = (8, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=device)
    v_cache = torch.full(shape, float("nan"), device=device)
    pos = torch.arange(prompt_len, device=device)
    slots = blocks[0].long()[pos // block_size] * block_size + pos % block_size

    chunks = []
    for start, end in [(0, 11), (11, 12), (12, 29)]:
        store_kvcache(k[start:end], v[start:end], k_cache, v_cache, slots[start:end])
        starts = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        lens = torch.tensor([end], dtype=torch.int32, device=device)
        chunks.append(
            paged_prefill_attention(q[start:end], k_cache, v_cache, blocks, starts, lens, 0.25)
        )
    expected = naive_causal(q.cpu(), k.cpu(), v.cpu(), 0.25)
    torch.testing.assert_close(torch.cat(chunks).cpu().double(), expected, atol=1e-5, rtol=1e-4)


def test_rejects_bad_inputs() -> None:
    q, k_cache, v_cache, tables, starts, lens, _, _ = make_batch(
        [4, 2], [4, 9], 4, 2, 16, 8, torch.float32
    )
    with pytest.raises(ValueError, match="query_start_loc must be"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts[:2], lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_prefill_attention(q, k_cache, v_cache, tables[:1], starts, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts.long(), lens, 1.0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_prefill_attention(q[:, :3], k_cache, v_cache, tables, starts, lens, 1.0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_prefill_attention(q.double(), k_cache, v_cache, tables, starts, lens, 1.0)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 1.0, 0)
    with pytest.raises(ValueError, match="query_start_loc\\[-1\\]"):
        paged_prefill_attention_ref(q[:5], k_cache, v_cache, tables, starts, lens, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 1, 7, 20])
@pytest.mark.parametrize("options", ["plain", "soft_cap", "sinks", "both"])
def test_window_soft_cap_and_sinks(device: str, window: int | None, options: str) -> None:
    block_size = 8
    query_lens, context_lens = [s[0] for s in SEQS], [s[1] for s in SEQS]
    q, k_cache, v_cache, tables, starts, lens, _, _ = make_batch(
        query_lens, context_lens, 4, 2, 16, block_size, torch.float32, seed=3)
    soft_cap = 1.5 if options in ("soft_cap", "both") else None
    sinks = torch.linspace(-1, 2, 4) if options in ("sinks", "both") else None
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.8, window,
                                      soft_cap, sinks)
    if window is not None:  # NaN in the blocks before the first query's window: never read
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        for s, (q_len, ctx) in enumerate(SEQS):
            for j in range(max(0, ctx - q_len - window + 1) // block_size):
                k_cache[tables[s, j].long()] = float("nan")
                v_cache[tables[s, j].long()] = float("nan")
    args = [t.to(device) for t in (q, k_cache, v_cache, tables, starts, lens)]
    out = paged_prefill_attention(*args, 0.8, max(query_lens), config=SMALL_TILES,
                                  window=window, soft_cap=soft_cap,
                                  sinks=None if sinks is None else sinks.to(device))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), ref, **TOL[torch.float32])
