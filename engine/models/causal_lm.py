"""What every decoder-only family shares around its layers: the output head and weight loading.

A family file defines its decoder (``self.model``: ``embed_tokens``, ``layers``, ``norm``) and
sets the sizes below; this base loads Hugging Face-named tensors into it, packing ``q_proj`` /
``k_proj`` / ``v_proj`` into ``qkv_proj`` and ``gate_proj`` / ``up_proj`` into ``gate_up_proj``
as they arrive (a checkpoint that stores them packed, like Phi-3, loads as is). A weight
that arrives as a ``PackedWeight`` (a GGUF tensor kept quantized) swaps its module for a
quantized one (``load_packed_weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.layers.attention import SelfAttention
from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.layers.quantized import DenseWeight, PackedWeight, swap_packed
from engine.layers.rotary import RotaryEmbedding


class CausalLM(nn.Module):
    """Base of the family classes. Subclasses build ``self.model`` and call ``_finish``."""

    model: nn.Module
    # Packed parameters: checkpoint projection name -> (packed name, shard index).
    _PACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # ``final_logit_softcapping``: logits become ``cap * tanh(logits / cap)`` (Gemma 2).
    final_logit_softcap: float | None = None

    def _finish(self, config, intermediate_size: int) -> None:
        """Sizes the runner and the loader read, and the output head (tied or not)."""
        first = self.attention_layers()[0]
        self.head_dim: int = first.head_dim
        self.num_kv_heads: int = first.num_kv_heads
        self.q_size: int = first.q_size
        self.kv_size: int = first.kv_size
        self.intermediate_size = intermediate_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            embed_tokens = self.model.embed_tokens
            assert isinstance(embed_tokens, nn.Embedding)
            self.lm_head.weight = embed_tokens.weight

    def attention_layers(self) -> list[SelfAttention]:
        return [m for m in self.modules() if isinstance(m, SelfAttention)]

    @property
    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (None: the whole context), in layer order."""
        return [layer.attn.sliding_window for layer in self.attention_layers()]

    def keep_fp32(self) -> None:
        """After a cast to the run's dtype: the rotary tables go back to fp32."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden_states))  # [num_sampled, vocab_size]

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

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
                rows = self._destination_rows(name, params)
            except ValueError:
                return None  # load_weights reports it
            fits = (rows is not None and tuple(rows.shape) == shape and rows.dtype == dtype
                    and rows.device.type == "cpu" and rows.is_contiguous())
            return rows if fits else None

        return destination

    def _destination_rows(self, name: str,
                          params: dict[str, nn.Parameter]) -> torch.Tensor | None:
        """The memory checkpoint tensor ``name`` is copied into unchanged, or None (skipped,
        or converted on the way); ``ValueError`` for a name with no place."""
        place = self._place(name, params)
        return None if place is None else place[2].detach()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, packing q/k/v and gate/up as they arrive. A
        tensor that already is its destination's memory (``weight_destination``) is not
        copied."""
        self.load_packed_weights(weights)

    @torch.no_grad()
    def load_packed_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]
    ) -> None:
        """``load_weights``, where a weight may also arrive packed (a GGUF tensor kept
        quantized): its module becomes a ``QuantizedLinear`` / ``QuantizedEmbedding``
        (``engine/layers/quantized.py``) once every tensor is in, a fused projection from its
        shards' pieces, a tied output layer over the embedding's packed weight. (The mixtures
        of experts load their own way and take no packed weights.)"""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        packed: dict[str, dict[int | None, PackedWeight]] = {}
        for name, tensor in weights:
            place = self._place(name, params)
            if place is None:
                continue
            target, shard, rows = place
            if not isinstance(tensor, torch.Tensor):
                shape = (tensor.out_features, tensor.in_features)
                if shape != tuple(rows.shape) or not target.endswith(".weight"):
                    raise ValueError(f"{name}: packed weight of shape {shape} has no place in "
                                     f"{target} {tuple(rows.shape)}")
                packed.setdefault(target, {})[shard] = tensor
            elif rows.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(rows.shape)}")
            elif not (tensor.data_ptr() == rows.data_ptr() and tensor.dtype == rows.dtype
                      and tensor.device == rows.device):
                rows.copy_(tensor)
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        self._check_all_loaded(params, loaded)
        if packed:
            swap_packed(self, self._packed_modules(packed, params))

    def _packed_modules(self, packed: dict[str, dict[int | None, PackedWeight]],
                        params: dict[str, nn.Parameter]) -> dict[str, list[PackedWeight]]:
        """Module path -> its weight's pieces in row order (``swap_packed``): a fused
        projection's shards, one stored unquantized among packed ones kept as its own rows."""
        modules: dict[str, list[PackedWeight]] = {}
        for target, shards in packed.items():
            path = target.removesuffix(".weight")
            if None in shards:
                modules[path] = [shards[None]]
                continue
            proj = "q_proj" if path.endswith("qkv_proj") else "gate_proj"
            pieces: list[PackedWeight] = []
            for shard in range(3 if proj == "q_proj" else 2):
                if shard in shards:
                    pieces.append(shards[shard])
                else:
                    rows = params[target].detach().narrow(0, *self._shard_range(proj, shard))
                    pieces.append(DenseWeight(rows.clone()))
            modules[path] = pieces
        if self.tie_word_embeddings and "model.embed_tokens" in modules:
            modules["lm_head"] = modules["model.embed_tokens"]  # the same object: one copy
        return modules

    def _shard_range(self, proj: str, shard: int) -> tuple[int, int]:
        if proj in ("q_proj", "k_proj", "v_proj"):
            sizes = [self.q_size, self.kv_size, self.kv_size]
        else:
            sizes = [self.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if name in loaded:
                continue  # stored packed (Phi-3), or not a packed parameter
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                want = [f"{name}#{i}" for i in range(3)]
            elif name.endswith("gate_up_proj.weight"):
                want = [f"{name}#{i}" for i in range(2)]
            else:
                want = [name]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window from a config: ``layer_types`` when the config has them
    (``sliding_attention`` layers get ``sliding_window``), else ``sliding_window`` for every
    layer (Mistral, Phi-3). None: full attention."""
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for "
                             f"{num_layers} layers")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not implemented (the engine has "
                             "full_attention, sliding_attention)")
        if window is None and "sliding_attention" in layer_types:
            raise ValueError("layer_types has sliding_attention layers but sliding_window "
                             "is not set")
        return [window if t == "sliding_attention" else None for t in layer_types]
    return [window] * num_layers


def check_window(window: int | None) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return window
