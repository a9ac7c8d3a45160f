"""The decoder the mixture-of-experts families share, and their weight loading.

A family file (``qwen3_moe.py``, ``qwen2_moe.py``, ``mixtral.py``, ``olmoe.py``, ``gpt_oss.py``)
says what a layer is (``make_layer``: the shared ``SelfAttention`` with the family's options, the
MoE block or, on the layers a config keeps dense, a ``GatedMLP``) and how its checkpoint names
expert tensors. The layer itself is the pre-norm residual block every one of them is:
``h = x + attn(norm(x)); out = h + mlp(norm(h))``; sliding windows per layer come from the config
as for the dense families (``causal_lm.layer_windows``).

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
from torch import nn

from engine.layers.moe import FusedExperts, MoeConfig, SparseMoeBlock
from engine.layers.rotary import RotaryEmbedding, rope_parameters_of
from engine.models.causal_lm import CausalLM, check_window, layer_windows
from engine.models.llama import DecoderLayer, DecoderModel, head_dim_of


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


class MoeForCausalLM(CausalLM):
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
        rotary = RotaryEmbedding(head_dim_of(config), max_position, rope_parameters_of(config),
                                 config.max_position_embeddings)
        windows = [check_window(window) for window in layer_windows(config)]
        self.model = DecoderModel(config, rotary, [
            self.make_layer(config, i, rotary, window) for i, window in enumerate(windows)])
        self._finish(config, config.intermediate_size)

    # --- what a family defines -------------------------------------------------------------
    def make_layer(self, config, layer_idx: int, rotary: RotaryEmbedding,
                   window: int | None) -> DecoderLayer:
        raise NotImplementedError

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
        return Slot(f"{prefix}.{names[stored]}", _whole, self.expert_names(prefix, names[stored]))

    # --- loading (CausalLM's, plus experts) ---------------------------------------------------
    def _experts_of(self, prefix: str) -> FusedExperts:
        module = self.get_submodule(prefix)
        if not isinstance(module, FusedExperts):
            raise ValueError(f"{prefix} is not an experts module")
        return module

    def expert_names(self, prefix: str, param: str) -> tuple[str, ...]:
        """The checkpoint names that fill the stacked parameter ``param`` of ``prefix``: one per
        expert and projection (``...experts.3.gate_proj.weight``); gpt-oss stores them stacked."""
        experts = self._experts_of(prefix)
        kind = "bias" if param.endswith("_bias") else "weight"
        stacked = param.removesuffix("_bias")
        projs = [p for p, (t, _) in self.EXPERT_PROJECTIONS.items() if t == stacked]
        return tuple(f"{prefix}.{e}.{p}.{kind}"
                     for e in range(experts.num_held) for p in projs)

    def _expected(self) -> list[str]:
        """Every name the checkpoint must account for, per expert where experts are stacked."""
        names: list[str] = []
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            prefix, _, param = name.rpartition(".")
            if isinstance(self.get_submodule(prefix), FusedExperts):
                names += self.expert_names(prefix, param)
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
        num_experts = experts.num_held
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

    def _destination_rows(self, name: str,
                          params: dict[str, nn.Parameter]) -> torch.Tensor | None:
        """As ``CausalLM``'s, through the family's checkpoint names; a tensor converted at
        load (MXFP4 experts, a transposed layout) has no memory to be read into."""
        slot = self._slot(self.checkpoint_name(name), params)
        if slot is None or slot.convert is not None:
            return None
        return slot.part(params[slot.target].detach())

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
