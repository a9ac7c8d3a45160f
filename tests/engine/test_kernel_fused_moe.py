"""fused_moe: the Triton kernel against its torch reference (the MoE layer's grouped path).

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

from engine.kernels.fused_moe import align_by_expert, fused_moe  # noqa: E402
from engine.layers.moe import experts_grouped, swiglu_clamped  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation):
    """The kernel's reference: the MoE layer's grouped torch path, on the same arguments."""
    return experts_grouped(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
            dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    b13 = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) if bias else None
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] += 3  # expert 0 is popular: its run spans several blocks
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    tensors = [x, w13, w2, weights, ids, b13, b2]
    return [t.to(DEVICE, dtype if t.is_floating_point() else t.dtype) if t is not None else None
            for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "bias"), [
    (1, 32, 16, 4, 2, False),
    (7, 64, 48, 8, 3, True),
    (40, 48, 32, 6, 2, False),
])
def test_kernel_matches_reference(dtype, num_tokens, hidden, inter, num_experts, top_k, bias):
    args = _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype, bias)
    out = fused_moe(*args, _silu_and_mul)
    ref = fused_moe_ref(*args, _silu_and_mul)
    # bf16: the kernel adds biases to the fp32 accumulator, torch to the rounded product
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-2, 3e-2)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_kernel_with_gpt_oss_activation():
    args = _inputs(9, 32, 32, 4, 2, torch.float32, True)

    def act(gate_up):
        return swiglu_clamped(gate_up, 1.702, 7.0)

    torch.testing.assert_close(fused_moe(*args, act), fused_moe_ref(*args, act),
                               rtol=1e-5, atol=1e-5)


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [0, 1], [2, 0], [0, 2]])
    sorted_pairs, block_experts = align_by_expert(ids, 4, block_m=4)
    num_pairs = ids.numel()
    blocks = sorted_pairs.view(-1, 4).tolist()
    experts = block_experts.tolist()
    seen = []
    for block, expert in zip(blocks, experts, strict=True):
        real = [p for p in block if p != num_pairs]
        if expert == 4:
            assert real == []  # blocks past the last expert are idle
            continue
        assert all(ids.flatten()[p] == expert for p in real)
        seen += real
    assert sorted(seen) == list(range(num_pairs))
    assert experts[:3] == [0, 1, 2]  # expert 0's four pairs fill one block exactly


def test_shapes_are_checked():
    x, w13, w2, weights, ids, _, _ = _inputs(3, 32, 16, 4, 2, torch.float32, False)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x[:, :16], w13, w2, weights, ids, None, None, _silu_and_mul)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights[:, :1], ids, None, None, _silu_and_mul)
