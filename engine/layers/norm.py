"""RMSNorm with Hugging Face's LlamaRMSNorm semantics (normalize in fp32, then scale).

``F.rms_norm`` is one fused kernel and gives the same bits as the textbook
``weight * (x * rsqrt(mean(x^2) + eps))`` in fp32, at a fraction of the memory traffic.

Given the residual stream too, the norm adds it first and returns the sum as the next residual
(vLLM's ``fused_add_rms_norm``): in fp32 the same two torch ops as before, so the same bits; in
bf16 on the CPU one pass of a C++ kernel, in place (``engine/kernels/cpu_fused_ops.py``).
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
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalize in fp32, round to the input dtype, then scale (as HF does).
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may overwrite ``x`` and ``residual``."""
        if (x.dim() == 2 and self.weight.dtype == torch.bfloat16
                and cpu_fused_ops.available(x) and residual.dtype == x.dtype):
            return cpu_fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``x_normed * (1 + weight)``,
    scaled in fp32 and only then rounded to the input dtype (Llama rounds first, then scales)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
