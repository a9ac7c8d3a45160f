"""The gated feed-forward block: ``down(act(gate(x)) * up(x))`` with gate and up in one matmul.

``activation`` is the checkpoint's name for it: ``silu`` (Llama, Mistral, Qwen, Phi-3) or
``gelu_pytorch_tanh`` (Gemma's GeGLU, GELU with the tanh approximation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_fused_ops
from engine.layers.linear import Linear

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 *, field: str = "hidden_act") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{field}={activation!r} is not implemented (the engine has "
                             f"{', '.join(ACTIVATIONS)})")
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if self.activation == "silu":
            if gate_up.dim() == 2 and cpu_fused_ops.available(gate_up):
                return self.down_proj(cpu_fused_ops.silu_and_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
