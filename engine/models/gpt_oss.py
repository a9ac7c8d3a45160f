"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with a learned sink logit per head, a sliding
window on every other layer (``layer_types``), YaRN rotary, biases on q/k/v/o; a MoE MLP whose
router (with a bias) picks the top-k logits and softmaxes over them, and whose experts (with
biases) use a clamped SwiGLU: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``,
``g = min(gate, limit)``.

The checkpoint stores the experts stacked, transposed and with gate and up interleaved
(``gate_up_proj [num_experts, hidden, 2 * intermediate]``, column ``2i`` gate, ``2i + 1`` up); they
are reordered at load into the engine's ``w13`` (gate rows, then up rows). The released
checkpoints quantise them to MXFP4 (``*_blocks`` / ``*_scales``): dequantised at load
(``engine/models/mxfp4.py``), kept in the run's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.layers.attention import SelfAttention
from engine.layers.moe import MoeConfig, SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer, head_dim_of
from engine.models.moe_decoder import MoeForCausalLM, Slot
from engine.models.mxfp4 import pair_mxfp4


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns (or rows) ``g0 u0 g1 u1 ...`` -> ``g0 g1 ... u0 u1 ...``."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def _gate_up(t: torch.Tensor) -> torch.Tensor:
    # [num_experts, hidden, 2 * inter] interleaved -> [num_experts, 2 * inter, hidden]
    return _deinterleave(t.transpose(1, 2), 1)


def _gate_up_bias(t: torch.Tensor) -> torch.Tensor:
    return _deinterleave(t, 1)  # [num_experts, 2 * inter]


def _down(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [num_experts, inter, hidden] -> [num_experts, hidden, inter]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


_STACKED = {  # checkpoint name -> (engine parameter, conversion)
    "gate_up_proj": ("w13", _gate_up), "gate_up_proj_bias": ("w13_bias", _gate_up_bias),
    "down_proj": ("w2", _down), "down_proj_bias": ("w2_bias", None),
}


class GptOssForCausalLM(MoeForCausalLM):
    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding,
                   window: int | None) -> DecoderLayer:
        moe = MoeConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            scoring="topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation="swiglu_clamped",
            swiglu_alpha=float(config.swiglu_alpha),
            swiglu_limit=float(config.swiglu_limit),
        )
        bias = bool(config.attention_bias)
        attention = SelfAttention(config.hidden_size, config.num_attention_heads,
                                  config.num_key_value_heads, head_dim_of(config), rotary,
                                  qkv_bias=bias, o_bias=bias, sliding_window=window,
                                  use_sinks=True)
        return DecoderLayer(attention, SparseMoeBlock(moe), config.hidden_size,
                               config.rms_norm_eps)

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def stacked_expert_slot(self, prefix: str, stored: str) -> Slot | None:
        if stored not in _STACKED:
            return None
        param, convert = _STACKED[stored]
        return Slot(f"{prefix}.{param}", _whole, (f"{prefix}.{stored}",), convert)

    def expert_names(self, prefix: str, param: str) -> tuple[str, ...]:
        names = {p: stored for stored, (p, _) in _STACKED.items()}
        return (f"{prefix}.{names[param]}",)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """MXFP4 expert tensors (``*_blocks`` + ``*_scales``) are dequantised as they pair up."""
        dtype = self.lm_head.weight.dtype
        super().load_weights(pair_mxfp4(weights, dtype))
