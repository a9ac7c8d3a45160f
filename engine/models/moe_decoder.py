"""The decoder the mixture-of-experts families share, and their weight loading.

A family file (``qwen3_moe.py``, ``mixtral.py``, ``olmoe.py``, ``gpt_oss.py``) says what its layers
are: ``make_attention`` and ``make_mlp`` (the MoE block, or a dense MLP on the layers a config
keeps dense), the norm, and where its checkpoint's expert tensors go (``expert_tensor``). The
layer itself is the pre-norm residual block every one of them is:
``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

Loading takes the checkpoint's Hugging Face names. Experts come either one tensor per expert
(``...experts.3.gate_proj.weight``, how the hub stores Qwen3-MoE, OLMoE and Mixtral's ``w1/w2/w3``)
or stacked (``...experts.gate_up_proj``, how transformers holds them in memory and gpt-oss stores
them); both fill the stacked ``FusedExperts`` parameters. A tensor with no place, of the wrong
shape, an expert index past ``num_experts`` or a tensor missing at the end is a ``ValueError``
naming the tensor and the config field it disagrees with.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.moe import FusedExperts, MoeConfig, SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy:
        params = {**legacy, **params}
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class GatedMLP(nn.Module):
    """A dense SwiGLU MLP (``gate_up_proj`` packed), for shared experts and dense layers."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
        return self.down_proj(F.silu(gate) * up)


class MoeDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int,
                 eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(positions, self.input_layernorm(hidden_states), rotary,
                                       kv_cache, attn, metadata)
        residual = residual + hidden_states
        return residual + self.mlp(self.post_attention_layernorm(residual))


class MoeModel(nn.Module):
    def __init__(self, layers: list[MoeDecoderLayer], config, rotary: RotaryEmbedding,
                 num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(positions, hidden_states, self.rotary_emb, kv_cache, attn,
                                  metadata)
        return self.norm(hidden_states)


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: parameter ``target``, the part of it ``part`` selects,
    the conversion ``convert`` the stored tensor needs first, and the names it accounts for."""

    target: str
    part: Callable[[torch.Tensor], torch.Tensor]
    covers: tuple[str, ...]
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.narrow(0, start, length)


def _expert_rows(t: torch.Tensor, expert: int, start: int = 0,
                 length: int | None = None) -> torch.Tensor:
    rows = t[expert]
    return rows if length is None else rows.narrow(0, start, length)


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<kind>"
                         r"weight|bias)$")


class MoeForCausalLM(nn.Module):
    """The shared causal LM: a family subclass builds its layers in ``make_layer``."""

    # checkpoint projection name inside an expert -> (stacked parameter, shard: 0 gate, 1 up,
    # None for the whole of w2)
    EXPERT_PROJECTIONS: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
    }
    # module path of the MoE block inside a layer, as the checkpoint names it
    MOE_MODULE = "mlp"

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        layers = [self.make_layer(config, i) for i in range(config.num_hidden_layers)]
        attention: Any = layers[0].self_attn  # every family's attention has these two
        head_dim, num_kv_heads = int(attention.head_dim), int(attention.num_kv_heads)
        rotary = self.make_rotary(config, head_dim, max_position)
        self.model = MoeModel(layers, config, rotary, num_kv_heads, head_dim)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # --- what a family defines -------------------------------------------------------------
    def make_layer(self, config, layer_idx: int) -> MoeDecoderLayer:
        raise NotImplementedError

    def make_rotary(self, config, head_dim: int, max_position: int) -> RotaryEmbedding:
        return RotaryEmbedding(head_dim, max_position, rope_parameters(config))

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name in this model's terms (Mixtral's ``block_sparse_moe`` ->
        ``mlp``); the identity by default."""
        return name

    def stacked_expert_slot(self, prefix: str, stored: str) -> Slot | None:
        """A stacked expert tensor (``...experts.gate_up_proj``): transformers' in-memory layout,
        ``[num_experts, 2 * intermediate, hidden]`` gate then up, ``[num_experts, hidden,
        intermediate]`` for down; gpt-oss overrides this for its transposed, interleaved one."""
        names = {"gate_up_proj": "w13", "down_proj": "w2"}
        if stored not in names:
            return None
        return Slot(f"{prefix}.{names[stored]}", _whole, self._all_experts(prefix, names[stored]))

    # --- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)  # [num_sampled, vocab_size]

    # --- loading -----------------------------------------------------------------------------
    _PACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def _experts_of(self, prefix: str) -> FusedExperts:
        module = self.get_submodule(prefix)
        if not isinstance(module, FusedExperts):
            raise ValueError(f"{prefix} is not an experts module")
        return module

    def _all_experts(self, prefix: str, param: str) -> tuple[str, ...]:
        """The per-expert names a whole stacked parameter accounts for."""
        experts = self._experts_of(prefix)
        kind = "bias" if param.endswith("_bias") else "weight"
        stacked = param.removesuffix("_bias")
        projs = [p for p, (t, _) in self.EXPERT_PROJECTIONS.items() if t == stacked]
        return tuple(f"{prefix}.{e}.{p}.{kind}"
                     for e in range(experts.config.num_experts) for p in projs)

    def _expected(self) -> list[str]:
        """Every name the checkpoint must account for, per expert where experts are stacked."""
        names: list[str] = []
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            prefix, _, param = name.rpartition(".")
            if isinstance(self.get_submodule(prefix), FusedExperts):
                names += self._all_experts(prefix, param)
            elif param in ("weight", "bias") and prefix.endswith(("qkv_proj", "gate_up_proj")):
                base = prefix.rpartition(".")[0]
                projs = (("q_proj", "k_proj", "v_proj") if prefix.endswith("qkv_proj")
                         else ("gate_proj", "up_proj"))
                names += [f"{base}.{p}.{param}" for p in projs]
            else:
                names.append(name)
        return names

    def _slot(self, name: str, params: dict[str, nn.Parameter]) -> Slot | None:
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        match = _PER_EXPERT.match(name)
        if match and match["prefix"] + ".w13" in params:
            return self._per_expert_slot(name, match)
        prefix, _, stored = name.rpartition(".")
        if prefix.endswith(".experts") and prefix + ".w13" in params:
            slot = self.stacked_expert_slot(prefix, stored)
            if slot is None:
                raise ValueError(f"checkpoint tensor {name!r} is not an expert tensor "
                                 f"{type(self).__name__} knows")
            return slot
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self._PACKED:
            packed, shard = self._PACKED[parts[-2]]
            target = ".".join([*parts[:-2], packed, parts[-1]])
            if target in params:
                sizes = self._packed_sizes(target)
                start = sum(sizes[:shard])
                return Slot(target, partial(_rows, start=start, length=sizes[shard]), (name,))
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        return Slot(name, _whole, (name,))

    def _per_expert_slot(self, name: str, match: re.Match) -> Slot:
        prefix, expert, proj, kind = (match["prefix"], int(match["expert"]), match["proj"],
                                      match["kind"])
        experts = self._experts_of(prefix)
        num_experts = experts.config.num_experts
        if expert >= num_experts:
            raise ValueError(f"checkpoint tensor {name!r} is expert {expert}, but the config says "
                             f"num_experts (num_local_experts) = {num_experts}")
        if proj not in self.EXPERT_PROJECTIONS:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        stacked, shard = self.EXPERT_PROJECTIONS[proj]
        target = f"{prefix}.{stacked}" + ("_bias" if kind == "bias" else "")
        inter = experts.config.intermediate_size
        if shard is None:
            return Slot(target, partial(_expert_rows, expert=expert), (name,))
        return Slot(target, partial(_expert_rows, expert=expert, start=shard * inter,
                                    length=inter), (name,))

    def _packed_sizes(self, target: str) -> list[int]:
        module: Any = self.get_submodule(target.rpartition(".")[0].rpartition(".")[0])
        if target.rpartition(".")[0].endswith("qkv_proj"):
            return [int(module.q_size), int(module.kv_size), int(module.kv_size)]
        return [int(module.intermediate_size)] * 2

    def weight_destination(self) -> Callable[[str, tuple[int, ...], torch.dtype],
                                             torch.Tensor | None]:
        """For ``Checkpoint.iter_weights(destination=...)``: the memory a stored tensor can be
        read straight into (contiguous, same shape and dtype, no conversion), else None."""
        params = dict(self.named_parameters())

        def destination(name: str, shape: tuple[int, ...],
                        dtype: torch.dtype) -> torch.Tensor | None:
            try:
                slot = self._slot(self.checkpoint_name(name), params)
            except ValueError:
                return None  # load_weights reports it
            if slot is None or slot.convert is not None:
                return None
            rows = slot.part(params[slot.target].detach())
            fits = (tuple(rows.shape) == shape and rows.dtype == dtype
                    and rows.device.type == "cpu" and rows.is_contiguous())
            return rows if fits else None

        return destination

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for stored_name, tensor in weights:
            name = self.checkpoint_name(stored_name)
            slot = self._slot(name, params)
            if slot is None:
                continue
            if slot.convert is not None:
                tensor = slot.convert(tensor)
            rows = slot.part(params[slot.target])
            if rows.shape != tensor.shape:
                raise ValueError(self._shape_error(stored_name, tensor, rows))
            if not (tensor.data_ptr() == rows.data_ptr() and tensor.dtype == rows.dtype
                    and tensor.device == rows.device):
                rows.copy_(tensor)
            loaded.update(slot.covers)
        missing = [n for n in self._expected() if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _shape_error(self, name: str, tensor: torch.Tensor, rows: torch.Tensor) -> str:
        message = f"{name}: shape {tuple(tensor.shape)} != {tuple(rows.shape)}"
        moe = self._moe_config_of(name)
        if moe is not None:
            message += (f" (the config says num_experts (num_local_experts)={moe.num_experts}, "
                        f"hidden_size={moe.hidden_size}, expert intermediate size "
                        f"{moe.intermediate_size})")
        return message

    def _moe_config_of(self, name: str) -> MoeConfig | None:
        match = re.match(r"^(model\.layers\.\d+)\.", self.checkpoint_name(name))
        if match is None:
            return None
        try:
            block = self.get_submodule(f"{match[1]}.{self.MOE_MODULE}")
        except AttributeError:
            return None
        return block.config if isinstance(block, SparseMoeBlock) else None


def moe_field(config, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config has (families name the same thing differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"the config has none of {names}; a mixture-of-experts model needs it")
    return default
