"""The MoE layer against transformers' own routers and experts, ties included; the grouped
GEMM path against the per-expert path; bad configs refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.layers import moe
from engine.layers.moe import FusedExperts, MoeConfig, TopKRouter, experts_grouped

HIDDEN, NUM_EXPERTS = 32, 8


def _router_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(NUM_EXPERTS, HIDDEN, generator=g)
    weight[2] = weight[1]  # experts 1 and 2 tie on every token
    weight[5] = weight[4]
    bias = torch.randn(NUM_EXPERTS, generator=g)
    bias[2] = bias[1]
    x = torch.randn(37, HIDDEN, generator=g)
    x[:3] = 0  # all-zero rows: every expert ties
    return weight, bias, x


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_normed", "mixtral", "gpt_oss"])
def test_router_matches_transformers_with_ties(family: str, top_k: int) -> None:
    weight, bias, x = _router_inputs()
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=top_k)
    if family.startswith("qwen3_moe"):
        hf_config = transformers.Qwen3MoeConfig(num_experts=NUM_EXPERTS,
                                                norm_topk_prob=family.endswith("normed"),
                                                **common)
        hf: torch.nn.Module = Qwen3MoeTopKRouter(hf_config)
        ours = MoeConfig(HIDDEN, 16, NUM_EXPERTS, top_k, renormalize=hf_config.norm_topk_prob)
    elif family == "mixtral":
        hf = MixtralTopKRouter(transformers.MixtralConfig(num_local_experts=NUM_EXPERTS,
                                                          **common))
        ours = MoeConfig(HIDDEN, 16, NUM_EXPERTS, top_k, renormalize=True, fp32_weights=True)
    else:
        hf = GptOssTopKRouter(transformers.GptOssConfig(num_local_experts=NUM_EXPERTS,
                                                        **common))
        ours = MoeConfig(HIDDEN, 16, NUM_EXPERTS, top_k, scoring="topk_softmax",
                         router_bias=True)
    router = TopKRouter(ours)
    with torch.no_grad():
        hf.weight.copy_(weight)
        router.weight.copy_(weight)
        if router.bias is not None:
            hf.bias.copy_(bias)
            router.bias.copy_(bias)
        _, hf_weights, hf_ids = hf(x)
        weights, ids = router(x)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)
    assert weights.dtype == hf_weights.dtype


def _experts(config: MoeConfig, seed: int = 0) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    experts = FusedExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return experts


def _routing(num_tokens: int, top_k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=g)
    logits[:, 7] -= 100  # expert 7 receives no token
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_experts_match_transformers(num_tokens: int) -> None:
    config = MoeConfig(HIDDEN, 16, NUM_EXPERTS, 2)
    ours = _experts(config)
    hf_config = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=16,
                                           num_local_experts=NUM_EXPERTS)
    hf_config._experts_implementation = "eager"  # the reference loop over experts
    hf = MixtralExperts(hf_config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(ours.w13)
        hf.down_proj.copy_(ours.w2)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens, 2)
    with torch.no_grad():
        expected = hf(x, ids, weights)
        out = ours(x, weights, ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_and_per_expert_gemms_agree(monkeypatch, activation, dtype) -> None:
    config = MoeConfig(HIDDEN, 16, NUM_EXPERTS, 3, expert_bias=True, activation=activation)
    experts = _experts(config).to(dtype)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    weights, ids = _routing(29, 3)
    weights = weights.to(dtype)
    with torch.no_grad():
        grouped = experts(x, weights, ids)
        monkeypatch.setattr(moe, "grouped_mm_available", lambda x, w: False)
        looped = experts(x, weights, ids)
        # the definition, token by token
        expected = torch.zeros_like(x, dtype=torch.float32)
        for t in range(x.shape[0]):
            for j in range(3):
                e = int(ids[t, j])
                h = experts.activation(x[t] @ experts.w13[e].T + experts.w13_bias[e])
                y = h @ experts.w2[e].T + experts.w2_bias[e]
                expected[t] += (weights[t, j] * y).float()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(grouped, looped, rtol=tol, atol=tol)
    torch.testing.assert_close(grouped.float(), expected, rtol=tol, atol=tol)


def test_grouped_compute_has_no_token_loop(monkeypatch) -> None:
    """One GEMM per expert that got rows (per projection), whatever the token count."""
    calls = []
    real = torch.matmul

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    config = MoeConfig(HIDDEN, 16, NUM_EXPERTS, 2)
    experts = _experts(config)
    weights, ids = _routing(200, 2)
    monkeypatch.setattr(moe, "grouped_mm_available", lambda x, w: False)
    monkeypatch.setattr(torch, "matmul", counting)
    with torch.no_grad():
        experts(torch.randn(200, HIDDEN), weights, ids)
    hit = int((torch.bincount(ids.flatten(), minlength=NUM_EXPERTS) > 0).sum())
    assert len(calls) == 2 * hit and sum(calls) == 2 * 400


def test_experts_grouped_is_the_layer_forward() -> None:
    config = MoeConfig(HIDDEN, 16, NUM_EXPERTS, 2)
    experts = _experts(config)
    x = torch.randn(9, HIDDEN)
    weights, ids = _routing(9, 2)
    with torch.no_grad():
        a = experts(x, weights, ids)
        b = experts_grouped(x, experts.w13, experts.w2, weights, ids, None, None,
                            experts.activation)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(num_experts=0, top_k=1), "num_experts"),
    (dict(num_experts=4, top_k=5), "num_experts_per_tok"),
    (dict(num_experts=4, top_k=0), "num_experts_per_tok"),
])
def test_bad_moe_config_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        MoeConfig(hidden_size=8, intermediate_size=8, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("expert_bias", [False, True])
def test_packed_experts_equal_the_stacked_weights(dtype, expert_bias) -> None:
    """oneDNN-packed experts (the CPU path where oneDNN multiplies) give the stacked weights'
    result, an expert without rows included, and hold no stacked copy afterwards."""
    from engine.layers.linear import onednn_packing_available

    if not onednn_packing_available(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    config = MoeConfig(HIDDEN, 16, NUM_EXPERTS, 2, expert_bias=expert_bias)
    experts = _experts(config).to(dtype)
    weights, ids = _routing(23, 2)
    x = torch.randn(23, HIDDEN).to(dtype)
    with torch.no_grad():
        want = experts(x, weights.to(dtype), ids)
        assert moe.pack_experts(torch.nn.Sequential(experts)) == 1
        got = experts(x, weights.to(dtype), ids)
    assert experts.w13.untyped_storage().nbytes() <= experts.w13.element_size()
    assert experts.packed is not None and len(experts.packed[0]) == NUM_EXPERTS
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
