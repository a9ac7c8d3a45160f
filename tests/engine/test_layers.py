"""Layers give the same bits as Hugging Face's: RMSNorm and rotary embeddings."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def norms(dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    ours, theirs = RMSNorm(64, 1e-5), LlamaRMSNorm(64, 1e-5)
    weight = torch.randn(64)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    return ours.to(dtype), theirs.to(dtype)


def test_rmsnorm_is_bit_identical_in_fp32():
    ours, theirs = norms(torch.float32)
    for shape in [(37, 64), (5, 9, 64)]:
        x = torch.randn(shape)
        assert torch.equal(ours(x), theirs(x))


def test_rmsnorm_in_bf16_rounds_once_from_a_bf16_or_fp32_stream():
    """The fp32 norm of the same values, rounded once to bf16 (Hugging Face rounds before it
    scales too: one bf16 step from ours at most), whether x is bf16 or the fp32 residual
    stream; and the fused add keeps the stream in fp32."""
    ours, theirs = norms(torch.bfloat16)
    exact = RMSNorm(64, 1e-5)
    exact.weight.data = ours.weight.data.float()
    x = torch.randn(37, 64) * 4
    for given in (x, x.to(torch.bfloat16)):
        got = ours(given)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exact(given.float()).to(torch.bfloat16))
    x16 = x.to(torch.bfloat16)
    torch.testing.assert_close(ours(x16), theirs(x16), rtol=2**-7, atol=0)

    residual = torch.randn(37, 64)
    got, stream = ours.add_and_norm(x16.clone(), residual.clone())
    assert stream.dtype == torch.float32 and torch.equal(stream, residual + x16.float())
    torch.testing.assert_close(got, ours(stream), rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ],
)
def test_rotary_is_bit_identical(rope):
    head_dim, heads, kv_heads = 32, 4, 2
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=256,
                         rope_parameters=rope)
    theirs = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(head_dim, 256, rope)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    q = torch.randn(len(positions), heads, head_dim)
    k = torch.randn(len(positions), kv_heads, head_dim)
    cos, sin = theirs(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = ours(positions, q, k)
    assert torch.equal(got_q, ref_q[0].transpose(0, 1))
    assert torch.equal(got_k, ref_k[0].transpose(0, 1))
    # A strided view (q and k side by side inside a fused projection) rotates the same.
    fused = torch.cat([q, k], dim=1)
    assert torch.equal(ours.rotate(positions, fused), torch.cat([got_q, got_k], dim=1))
