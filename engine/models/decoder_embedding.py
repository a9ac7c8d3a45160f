"""A decoder used as an embedder (Qwen3-Embedding's recipe): the family's own model, its output
layer dropped, causal attention through the packed backend, the last token's state pooled.

The family file is the generation one (``engine/models/llama.py`` and the others of
``engine.models.registry``), not a copy: the embedder
builds that ``*ForCausalLM``, keeps its ``model`` (embeddings, layers, final norm) and loads
the same Hugging Face names. A checkpoint saved from the base class (``Qwen3Model``: names
without the ``model.`` prefix) and one saved from the causal-LM class (``lm_head`` ignored) both
load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.models.causal_lm import CausalLM


class DecoderEmbeddingModel(nn.Module):
    causal = True

    def __init__(self, config, causal_lm_cls: type[CausalLM], max_position: int) -> None:
        super().__init__()
        lm = causal_lm_cls(config, max_position)
        del lm.lm_head  # an embedder never computes logits
        lm.tie_word_embeddings = False
        self.lm = lm
        self.config = config
        self.max_position = max_position
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.num_layers: int = config.num_hidden_layers

    def keep_fp32(self) -> None:
        """After a cast to the run's dtype: the rotary tables go back to fp32."""
        self.lm.keep_fp32()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each sequence
        attn: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        empty = torch.empty(0, device=input_ids.device)
        return self.lm.model(input_ids, positions, [(empty, empty)] * self.num_layers, attn,
                             metadata)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    continue
                yield (name if name.startswith("model.") else f"model.{name}"), tensor

        self.lm.load_weights(renamed())
