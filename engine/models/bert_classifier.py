"""A BERT cross-encoder: Hugging Face's ``BertForSequenceClassification`` with one label, which
scores a pair of texts packed as ``[CLS] a [SEP] b [SEP]`` (token type 0 up to the first
``[SEP]``, 1 after it; Nogueira and Cho, 2019, "Passage Re-ranking with BERT").

The encoder is ``engine/models/bert.py``'s, run over the packed step with the pairs' token
types; the head reads each sequence's ``[CLS]`` state through BERT's pooler (``pooler.dense``,
tanh) and the ``classifier`` linear layer into one logit. The activation on top (sigmoid,
identity, tanh: what the model's sentence-transformers files say) is the runner's
(``engine.layers.pooling.ScoreActivation``). Parameter names are Hugging Face's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.models.bert import BertModel


class BertPooler(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_states))  # [num_seqs, hidden_size]


class BertForSequenceClassification(nn.Module):
    """Token states of a packed step (``forward``), then one logit per sequence (``score``)."""

    causal = False

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        num_labels = getattr(config, "num_labels", 2)
        if num_labels != 1:
            raise ValueError(f"a cross-encoder scores with one label; this checkpoint has "
                             f"num_labels={num_labels} (a classifier, not a scorer)")
        self.bert = BertModel(config, max_position)
        self.pooler = BertPooler(config)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.max_position = self.bert.max_position
        self.vocab_size: int = self.bert.vocab_size
        self.hidden_size: int = self.bert.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.bert(input_ids, positions, attn, metadata, token_type_ids)

    def score(self, cls_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, hidden_size]`` [CLS] states -> ``[num_seqs]`` raw logits."""
        return self.classifier(self.pooler(cls_states))[:, 0]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The head's tensors (``bert.pooler.*``, ``classifier.*``) here, the rest to the
        encoder's loader."""
        head = dict(self.named_parameters())
        seen: set[str] = set()

        def encoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                local = name.removeprefix("bert.")
                if local.startswith("pooler.") or local.startswith("classifier."):
                    param = head[local]
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != "
                                         f"{tuple(param.shape)}")
                    param.copy_(tensor)
                    seen.add(local)
                else:
                    yield name, tensor

        self.bert.load_weights(encoder_weights())
        missing = [n for n in ("pooler.dense.weight", "pooler.dense.bias", "classifier.weight",
                               "classifier.bias") if n not in seen]
        if missing:
            raise ValueError(f"checkpoint is missing the cross-encoder head's tensors {missing}")
