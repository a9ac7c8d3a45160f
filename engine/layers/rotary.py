"""Rotary position embedding (default, linear, llama3 scaling) from a precomputed cos/sin table."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels import cpu_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(head_dim: int, rope_parameters: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)``, rescaled as the checkpoint's rope type says."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (have {SUPPORTED_ROPE_TYPES})")
    base = float(rope_parameters.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"])
    if rope_type == "llama3":
        factor = float(rope_parameters["factor"])
        low_freq_factor = float(rope_parameters["low_freq_factor"])
        high_freq_factor = float(rope_parameters["high_freq_factor"])
        old_context_len = float(rope_parameters["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # [max_position, head_dim]
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, rope_parameters: dict[str, Any]
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, rope_parameters)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin``, computed half by half into one output.

        Same bits as the textbook form (``a + (-b) == a - b``), with no ``cat`` or ``neg``.
        ``x``: [num_tokens, num_heads, head_dim], any strides.
        """
        half = x.shape[-1] // 2
        # The tables repeat their first half, so half of each is all we need.
        cos = self.cos_cache[positions, :half].to(x.dtype).unsqueeze(1)  # [num_tokens, 1, half]
        sin = self.sin_cache[positions, :half].to(x.dtype).unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
        torch.add(x2 * cos, x1 * sin, out=out[..., half:])
        return out

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``rotate``, in place where a kernel does it in one pass (bf16 on the CPU: in fp32,
        rounded once); use the result, which may be ``x`` itself or a new tensor."""
        if cpu_fused_ops.available(x) and positions.dtype == torch.int64:
            return cpu_fused_ops.rotary_neox(x, positions, self.cos_cache, self.sin_cache)
        return self.rotate(positions, x)
