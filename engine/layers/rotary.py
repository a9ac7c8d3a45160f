"""Rotary position embedding and its scaling variants, from a precomputed cos/sin table.

Variants, as Hugging Face's ``modeling_rope_utils`` defines them (``rope_type``):

- ``default``: ``theta^(-2i/d)``;
- ``linear``: every frequency divided by ``factor`` (position interpolation);
- ``dynamic``: dynamic NTK. Hugging Face rescales the base once a sequence runs past
  ``max_position_embeddings``; the engine never runs a sequence past it (``max_model_len`` is
  capped there), so within that length the frequencies are the default ones, exactly;
- ``yarn``: frequencies blended between interpolation and extrapolation by a linear ramp over
  the rotation counts ``beta_fast``..``beta_slow``, cos/sin scaled by ``attention_factor``;
- ``llama3``: long wavelengths slowed by ``factor``, short ones kept, the band between blended;
- ``longrope`` (``su``, Phi-3): per-frequency ``short_factor`` below
  ``original_max_position_embeddings`` and ``long_factor`` from there on, cos/sin scaled by
  ``attention_factor``. Hugging Face picks one set for a whole forward call by its longest
  position; a paged engine picks per position (as vLLM does), which is the same for every
  prompt that fits in the original length.

``partial_rotary_factor`` < 1 rotates only the first ``head_dim * factor`` dimensions of a head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kernels import cpu_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_ALIASES = {"su": "longrope"}


def rope_type_of(rope_parameters: dict[str, Any]) -> str:
    """The checkpoint's rope type, checked; a ValueError names the field otherwise."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not implemented (the engine "
                         f"has {', '.join(SUPPORTED_ROPE_TYPES)})")
    return rope_type


def _required(params: dict[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_scaling of type {rope_type!r} needs the field {key!r}")
    return params[key]


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def compute_inv_freq(
    dim: int, rope_parameters: dict[str, Any], max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(inverse frequencies, the long ones for ``longrope`` else None, cos/sin scale) for
    ``dim`` rotated dimensions, as the checkpoint's rope type says."""
    rope_type = rope_type_of(rope_parameters)
    p = rope_parameters
    base = float(p.get("rope_theta", 10000.0))
    inv_freq = _base_inv_freq(dim, base)
    if rope_type in ("default", "dynamic"):
        return inv_freq, None, 1.0
    if rope_type == "linear":
        return inv_freq / float(_required(p, "factor", rope_type)), None, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, p), None, 1.0
    original = int(_required(p, "original_max_position_embeddings", rope_type))
    factor = p.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError(f"rope_scaling of type {rope_type!r} needs the field 'factor'")
        factor = max_position_embeddings / original
    factor = float(factor)
    if rope_type == "yarn":
        return _yarn(dim, base, factor, original, p)
    # longrope
    short = torch.tensor(_required(p, "short_factor", rope_type), dtype=torch.float32)
    long = torch.tensor(_required(p, "long_factor", rope_type), dtype=torch.float32)
    if short.shape != (dim // 2,) or long.shape != (dim // 2,):
        raise ValueError(f"rope_scaling short_factor and long_factor need {dim // 2} values "
                         f"each, got {tuple(short.shape)} and {tuple(long.shape)}")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / (short * base**shape), 1.0 / (long * base**shape), float(attention_factor))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(_required(p, "factor", "llama3"))
    low_freq_factor = float(_required(p, "low_freq_factor", "llama3"))
    high_freq_factor = float(_required(p, "high_freq_factor", "llama3"))
    old_context_len = float(_required(p, "original_max_position_embeddings", "llama3"))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, factor: float, original: int, p: dict[str, Any]
          ) -> tuple[torch.Tensor, None, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # how much of each frequency is extrapolated (kept as is)
    return interpolation * (1 - keep) + extrapolation * keep, None, float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (first half / second half of the rotated dims).

    The cos/sin tables are fp32 (``keep_fp32`` after a dtype cast) and already carry the rope
    type's ``attention_factor``, as Hugging Face's ``cos * attention_scaling`` does."""

    cos_cache: torch.Tensor  # [max_position, rotary_dim]
    sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_position: int, rope_parameters: dict[str, Any],
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        factor = float(rope_parameters.get("partial_rotary_factor") or 1.0)
        self.rotary_dim = int(head_dim * factor)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor={factor} leaves {self.rotary_dim} of "
                             f"{head_dim} head dims to rotate; it must be an even count > 0")
        self.head_dim = head_dim
        inv_freq, long_inv_freq, scale = compute_inv_freq(
            self.rotary_dim, rope_parameters, max_position_embeddings)
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        if long_inv_freq is not None:
            original = int(rope_parameters["original_max_position_embeddings"])
            long = positions[:, None] * long_inv_freq[None, :]
            freqs = torch.where(positions[:, None] >= original, long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` on the rotated dims, computed half by half into
        one output (the same bits as the textbook form: ``a + (-b) == a - b``).

        ``x``: [num_tokens, num_heads, head_dim], any strides.
        """
        half = self.rotary_dim // 2
        # The tables repeat their first half, so half of each is all we need.
        cos = self.cos_cache[positions, :half].to(x.dtype).unsqueeze(1)  # [num_tokens, 1, half]
        sin = self.sin_cache[positions, :half].to(x.dtype).unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half: 2 * half]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
        torch.add(x2 * cos, x1 * sin, out=out[..., half: 2 * half])
        if self.rotary_dim < self.head_dim:
            out[..., self.rotary_dim:] = x[..., self.rotary_dim:]
        return out

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``rotate``, in place where a kernel does it in one pass (bf16 on the CPU: in fp32,
        rounded once); use the result, which may be ``x`` itself or a new tensor."""
        if (self.rotary_dim == self.head_dim and cpu_fused_ops.available(x)
                and positions.dtype == torch.int64):
            return cpu_fused_ops.rotary_neox(x, positions, self.cos_cache, self.sin_cache)
        return self.rotate(positions, x)


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """One flat rope dict from a config: ``rope_parameters`` (transformers 5), a legacy
    ``rope_scaling`` on top, ``rope_theta`` and ``partial_rotary_factor`` filled in."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy:
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if getattr(config, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", config.partial_rotary_factor)
    original = getattr(config, "original_max_position_embeddings", None)
    if original is not None:
        params.setdefault("original_max_position_embeddings", original)
    return params
