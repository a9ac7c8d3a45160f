"""TritonAttentionBackend on mixed steps: decodes (one padded) then prefill chunks, one of them
behind a cached prefix, checked against dense naive attention and the torch references.

Without a GPU the kernels run on CPU tensors under TRITON_INTERPRET=1, set before they are imported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.paged_decode_attention import paged_decode_attention_ref  # noqa: E402
from engine.kernels.paged_prefill_attention import paged_prefill_attention_ref  # noqa: E402
from engine.kernels.store_kvcache import store_kvcache_ref  # noqa: E402
from engine.layers.attention_metadata import AttentionMetadata  # noqa: E402
from engine.layers.triton_attention import TritonAttentionBackend  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SCALE = 6, 2, 16, 0.25


@dataclass
class Seq:
    num_cached: int  # tokens already in the cache before this step
    num_new: int  # tokens computed this step (1 for a decode)


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    full_k: list[torch.Tensor]  # per sequence, every position, for the dense check
    full_v: list[torch.Tensor]


def build_step(
    decodes: list[Seq | None], prefills: list[Seq], block_size: int, device: str
) -> Step:
    """``None`` in ``decodes`` is a padded CUDA-graph row (slot -1, context_len 0)."""
    gen = torch.Generator().manual_seed(block_size)
    seqs = [s for s in decodes if s is not None] + prefills
    num_blocks = sum(math.ceil((s.num_cached + s.num_new) / block_size) for s in seqs) + 2
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(math.ceil((s.num_cached + s.num_new) / block_size) for s in seqs)

    tables, lens, slots, new_k, new_v, full_k, full_v = [], [], [], [], [], [], []
    for s in decodes + prefills:
        table = torch.zeros(max_blocks, dtype=torch.int64)
        if s is None:
            tables.append(table)
            lens.append(0)
            slots.append(torch.tensor([-1]))
            new_k.append(torch.randn(1, NUM_KV_HEADS, HEAD_DIM, generator=gen))
            new_v.append(torch.randn(1, NUM_KV_HEADS, HEAD_DIM, generator=gen))
            continue
        n = s.num_cached + s.num_new
        ids = torch.tensor([free.pop() for _ in range(math.ceil(n / block_size))])
        table[: len(ids)] = ids
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        pos = torch.arange(n)
        slot = ids[pos // block_size] * block_size + pos % block_size
        cached = slice(0, s.num_cached)
        k_cache[slot[cached] // block_size, slot[cached] % block_size] = k[cached]
        v_cache[slot[cached] // block_size, slot[cached] % block_size] = v[cached]
        tables.append(table)
        lens.append(n)
        slots.append(slot[s.num_cached :])
        new_k.append(k[s.num_cached :])
        new_v.append(v[s.num_cached :])
        full_k.append(k)
        full_v.append(v)

    num_decodes = len(decodes)
    query_lens = [s.num_new for s in prefills]
    num_tokens = num_decodes + sum(query_lens)
    table_t = torch.stack(tables).int()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        num_decodes=num_decodes,
        decode_block_tables=table_t[:num_decodes].to(device),
        decode_context_lens=lens_t[:num_decodes].to(device),
        num_prefills=len(prefills),
        prefill_query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()],
            dtype=torch.int32,
        ).to(device),
        prefill_block_tables=table_t[num_decodes:].to(device),
        prefill_context_lens=lens_t[num_decodes:].to(device),
        prefill_query_lens_list=query_lens,
        prefill_context_lens_list=lens[num_decodes:],
        decode_context_lens_list=lens[:num_decodes],
    )
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    return Step(
        q.to(device),
        torch.cat(new_k).to(device),
        torch.cat(new_v).to(device),
        k_cache.to(device),
        v_cache.to(device),
        metadata,
        full_k,
        full_v,
    )


def naive_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over contiguous K/V, float64."""
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    query_len, context_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    q_pos = torch.arange(context_len - query_len, context_len)[:, None]
    scores = scores.masked_fill(torch.arange(context_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_forward(step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    md = step.metadata
    k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
    store_kvcache_ref(step.k, step.v, k_cache, v_cache, md.slot_mapping)
    nd = md.num_decodes
    out = torch.cat(
        [
            paged_decode_attention_ref(
                step.q[:nd], k_cache, v_cache, md.decode_block_tables, md.decode_context_lens,
                SCALE,
            ),
            paged_prefill_attention_ref(
                step.q[nd:], k_cache, v_cache, md.prefill_block_tables,
                md.prefill_query_start_loc, md.prefill_context_lens, SCALE,
            ),
        ]
    )
    return out, k_cache, v_cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_step_matches_dense_and_reference(device: str, block_size: int) -> None:
    decodes = [Seq(9, 1), None, Seq(40, 1), Seq(0, 1)]
    prefills = [Seq(0, 12), Seq(16, 5), Seq(3, 30)]
    step = build_step(decodes, prefills, block_size, device)
    ref_out, ref_k_cache, ref_v_cache = reference_forward(step)

    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    backend.prepare(step.metadata)
    out = backend.forward(
        step.q, step.k, step.v, step.k_cache, step.v_cache, step.metadata, SCALE
    )

    assert out.shape == step.q.shape and not out.isnan().any()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(step.k_cache, ref_k_cache, equal_nan=True)
    torch.testing.assert_close(step.v_cache, ref_v_cache, equal_nan=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padded decode row

    # Token by token against dense causal attention over each sequence's full K/V.
    rows, seq_index = 0, 0
    for s in decodes + prefills:
        if s is None:
            rows += 1
            continue
        k, v = step.full_k[seq_index], step.full_v[seq_index]
        expected = naive_rows(step.q[rows : rows + s.num_new].cpu(), k, v)
        torch.testing.assert_close(
            out[rows : rows + s.num_new].cpu().double(), expected, atol=1e-5, rtol=1e-4
        )
        rows += s.num_new
        seq_index += 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["decode_only", "prefill_only"])
def test_single_kind_steps(device: str, kind: str) -> None:
    if kind == "decode_only":
        step = build_step([Seq(5, 1), Seq(17, 1)], [], 8, device)
    else:
        step = build_step([], [Seq(0, 7), Seq(8, 9)], 8, device)
    ref_out, _, _ = reference_forward(step)
    out = TritonAttentionBackend().forward(
        step.q, step.k, step.v, step.k_cache, step.v_cache, step.metadata, SCALE
    )
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_step(device: str) -> None:
    step = build_step([Seq(20, 1), None], [Seq(6, 10)], 16, device)
    for name in ("q", "k", "v", "k_cache", "v_cache"):
        setattr(step, name, getattr(step, name).bfloat16())
    ref_out, _, _ = reference_forward(step)
    out = TritonAttentionBackend().forward(
        step.q, step.k, step.v, step.k_cache, step.v_cache, step.metadata, SCALE
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
