"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Follows Hugging Face's LlamaForCausalLM layer for layer. Q/K/V and gate/up are packed into one
matmul each (bigger, fewer GEMMs); ``load_weights`` takes Hugging Face names and packs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_fused_ops
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def _rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy:
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rotary.rotate_(positions, q), rotary.rotate_(positions, k)
        else:
            # q and k side by side in qkv: rotate both in one pass.
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(-1, (-1, self.head_dim))
            # [num_tokens, num_heads + num_kv_heads, head_dim]; qkv is this call's own tensor
            qk = rotary.rotate_(positions, qk)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = attn.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        if gate_up.dim() == 2 and cpu_fused_ops.available(gate_up):
            return self.down_proj(cpu_fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP's output and the residual stream before it: the next layer (or the
        final norm) adds them, fused with its norm (``RMSNorm.add_and_norm``)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_and_norm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, rotary, kv_cache, attn, metadata)
        hidden_states, residual = self.post_attention_layernorm.add_and_norm(
            hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, qk_norm: bool, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, qk_norm) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        attn = cast(LlamaDecoderLayer, self.layers[0]).self_attn
        self.head_dim: int = attn.head_dim
        self.num_kv_heads: int = attn.num_kv_heads
        self.q_size: int = attn.q_size
        self.kv_size: int = attn.kv_size
        self.intermediate_size: int = config.intermediate_size
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_position, _rope_parameters(config))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, self.rotary_emb, kv_cache, attn, metadata, residual
            )
        if residual is None:  # no layers
            return self.norm(hidden_states)
        return self.norm.add_and_norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Qwen2 puts biases on q/k/v; Qwen3 normalizes q and k per head.
    qkv_bias = False
    qk_norm = False

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_sampled, vocab_size]

    _PACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def _place(self, name: str, params: dict[str, nn.Parameter]
               ) -> tuple[str, int | None, torch.Tensor] | None:
        """Where the checkpoint tensor ``name`` goes: (parameter name, shard or None, the
        parameter or its shard's rows); None for tensors that are skipped."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in self._PACKED:
            packed_name, shard = self._PACKED[parts[-2]]
            target = ".".join([*parts[:-2], packed_name, parts[-1]])
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        if shard is None:
            return target, None, param
        return target, shard, param.narrow(0, *self._shard_range(parts[-2], shard))

    def weight_destination(self) -> Callable[[str, tuple[int, ...], torch.dtype],
                                             torch.Tensor | None]:
        """For ``Checkpoint.iter_weights(destination=...)``: the parameter (or the rows of a packed
        one) a checkpoint tensor of that name, shape and dtype can be read straight into, so
        ``load_weights`` has nothing left to copy; None where it cannot (another shape or
        dtype, a skipped tensor, a parameter off the CPU)."""
        params = dict(self.named_parameters())

        def destination(name: str, shape: tuple[int, ...],
                        dtype: torch.dtype) -> torch.Tensor | None:
            try:
                place = self._place(name, params)
            except ValueError:
                return None  # load_weights reports it
            if place is None:
                return None
            rows = place[2].detach()
            fits = (tuple(rows.shape) == shape and rows.dtype == dtype
                    and rows.device.type == "cpu" and rows.is_contiguous())
            return rows if fits else None

        return destination

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, packing q/k/v and gate/up as they arrive. A
        tensor that already is its destination's memory (``weight_destination``) is not
        copied."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            place = self._place(name, params)
            if place is None:
                continue
            target, shard, rows = place
            if rows.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(rows.shape)}")
            if not (tensor.data_ptr() == rows.data_ptr() and tensor.dtype == rows.dtype
                    and tensor.device == rows.device):
                rows.copy_(tensor)
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        self._check_all_loaded(params, loaded)

    def _shard_range(self, proj: str, shard: int) -> tuple[int, int]:
        m = self.model
        if proj in ("q_proj", "k_proj", "v_proj"):
            sizes = [m.q_size, m.kv_size, m.kv_size]
        else:
            sizes = [m.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                want = [f"{name}#{i}" for i in range(3)]
            elif name.endswith("gate_up_proj.weight"):
                want = [f"{name}#{i}" for i in range(2)]
            else:
                want = [name]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
