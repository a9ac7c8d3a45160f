"""store_kvcache: the Triton kernel against its torch reference, and the reference against slots.

Without a GPU the kernel runs on CPU tensors under TRITON_INTERPRET=1, which must be set before
the kernel module is imported (Triton reads it when the @triton.jit decorator runs).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels.store_kvcache import store_kvcache, store_kvcache_ref  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _inputs(
    num_tokens: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
    dtype: torch.dtype, device: str, seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # k and v are views into one fused projection, as a model produces them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=gen).to(dtype)
    k = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padded rows
    return tuple(t.to(device) for t in (k, v, k_cache, v_cache, slots))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(2, 16, 8), (3, 24, 16), (1, 64, 32)]
)
def test_kernel_matches_reference(
    device: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    k, v, k_cache, v_cache, slots = _inputs(
        11, num_kv_heads, head_dim, 6, block_size, dtype, device
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, slots)
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_reference_writes_each_slot() -> None:
    k, v, k_cache, v_cache, slots = _inputs(9, 2, 8, 4, 8, torch.float32, "cpu")
    before_k, before_v = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_cache, v_cache, slots)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = k[t]
            expected_v[slot // 8, slot % 8] = v[t]
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, before_k)


@pytest.mark.parametrize("device", DEVICES)
def test_all_padding_and_empty_write_nothing(device: str) -> None:
    k, v, k_cache, v_cache, slots = _inputs(4, 2, 8, 2, 8, torch.float32, device)
    before = k_cache.clone()
    store_kvcache(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    store_kvcache(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, before)


def test_rejects_bad_inputs() -> None:
    k, v, k_cache, v_cache, slots = _inputs(4, 2, 8, 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        store_kvcache(k, v, k_cache, v_cache, slots.int())
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        store_kvcache(k, v, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="share one dtype"):
        store_kvcache(k.double(), v.double(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cache holds"):
        store_kvcache(k[:, :1], v[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k and v must both be"):
        store_kvcache(k, v[:, :, :4], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="stride 1"):
        store_kvcache(k.transpose(1, 2).contiguous().transpose(1, 2), v, k_cache, v_cache, slots)
