"""RMSNorm with Hugging Face's LlamaRMSNorm semantics (normalize in fp32, then scale); in a lower
precision, rounded once after the scale.

``F.rms_norm`` is one fused kernel and gives the same bits as the textbook
``weight * (x * rsqrt(mean(x^2) + eps))`` in fp32, at a fraction of the memory traffic.

Given the residual stream too, the norm adds it first and returns the sum as the next residual
(vLLM's ``fused_add_rms_norm``): in fp32 the same two torch ops as before, so the same bits; in
bf16 on the CPU one pass of a C++ kernel, in place (``engine/kernels/cpu_fused_ops.py``).

The residual stream stays in fp32 whatever the model's dtype (``residual_stream``): each layer
adds its bf16 output to an fp32 sum, and only the norms' outputs, the layers' inputs, are rounded
to the model's dtype, once. Hugging Face's bf16 models round the sum at every add (twice a layer)
and the normalized value before the scale: roundings that only move bf16 away from fp32. On the
default model (SmolLM2-135M Q4_1, teacher-forced top-1 agreement with the fp32 engine over 2,863
positions, ``python -m bench.quantized --models default``, Zen 4): HF's roundings 98.81%
dequantized / 98.74% kept quantized (mean |delta logprob| 0.0137); an fp32 stream with one
rounding a norm 99.16% / 99.41% (0.0085). The stream is [tokens, hidden]: a few KB a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In the weight's dtype (the model's), whatever ``x``'s (an fp32 residual stream)."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalize and scale in fp32, round once to the model's dtype (HF
        # rounds before it scales too: a second rounding, only further from fp32).
        return F.rms_norm(x.float(), self.shape, self.weight.float(), self.eps).to(
            self.weight.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum in ``residual``'s dtype (fp32: the
        module docstring); may overwrite ``x`` and ``residual``."""
        if (x.dim() == 2 and self.weight.dtype == torch.bfloat16
                and cpu_fused_ops.available(x) and residual.dtype == torch.float32):
            return cpu_fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


def residual_stream(hidden_states: torch.Tensor) -> torch.Tensor:
    """The residual stream that starts at ``hidden_states``: in fp32 (the module docstring); the
    tensor itself when it is fp32 already."""
    return hidden_states.float()


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``x_normed * (1 + weight)``,
    scaled in fp32 and only then rounded to the input dtype (Llama rounds first, then scales)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """In ``out_dtype``, by default the weight's (the model's) whatever ``x``'s; the
        post-norms give fp32 to the fp32 residual stream they are added to, unrounded."""
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(out_dtype or self.weight.dtype)
