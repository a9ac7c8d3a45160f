"""BERT (Devlin et al., 2018) as an encoder for embeddings: Hugging Face's ``BertModel``.

Token, absolute position and token-type embeddings are summed and layer-normalized; each layer is
bidirectional self-attention and a GELU MLP, each followed by a residual add and a LayerNorm
(post-norm). Attention goes through the packed backend (``engine/layers/packed_attention.py``)
with ``causal`` off: a step's sequences lie back to back and each attends over itself only.
Parameter names are Hugging Face's (``encoder.layer.3.attention.output.LayerNorm.weight``), except
that query, key and value are packed into one matmul (``attention.self.qkv_proj``); the pooler
head (``pooler.dense``) is not used by sentence embeddings and is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention_metadata import AttentionBackend, AttentionMetadata
from engine.layers.linear import Linear
from engine.models.llama import head_dim_of

# hidden_act -> GELU's ``approximate`` (torch's name, and oneDNN's for the fused product);
# relu beside them
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
_ACTIVATIONS = (*_GELU, "relu")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Without token types, one segment per input: type 0, as a tokenizer gives a single
        # text; a cross-encoder's pair has type 1 from its second text on.
        token_types = (self.token_type_embeddings.weight[0] if token_type_ids is None
                       else self.token_type_embeddings(token_type_ids))
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + token_types
        return self.LayerNorm(x)  # [num_tokens, hidden_size]


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim  # hidden_size, or a rank's share of it
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, 3 * self.q_size, bias=True)

    def forward(self, hidden_states: torch.Tensor, attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, 3 * q_size]
        # [num_tokens, num_heads, head_dim] each
        q, k, v = qkv.view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        empty = hidden_states.new_empty(0)
        o = attn.forward(q, k, v, empty, empty, metadata, self.scale)
        return o.reshape(num_tokens, self.q_size)


class BertSelfOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = Linear(config.num_attention_heads * head_dim_of(config),
                            config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: torch.Tensor, attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden_states, attn, metadata), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: "
                             f"{sorted(_ACTIVATIONS)}")
        self.gelu = _GELU.get(act)  # None: relu
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # -> [num_tokens, intermediate_size]
        if self.gelu is None:
            return F.relu(self.dense(x))
        return self.dense.forward_gelu(x, self.gelu)  # inside the product where oneDNN can


class BertOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: torch.Tensor, attn: AttentionBackend,
                metadata: AttentionMetadata) -> torch.Tensor:
        attention_output = self.attention(hidden_states, attn, metadata)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Hidden states of the last layer for a packed step; pooling is the runner's."""

    causal = False

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported, got "
                             f"{config.position_embedding_type!r}")
        if getattr(config, "is_decoder", False):
            raise ValueError("a BERT decoder (is_decoder=True) cannot embed here")
        self.config = config
        self.max_position = min(max_position, config.max_position_embeddings)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.vocab_size: int = config.vocab_size
        self.hidden_size: int = config.hidden_size
        self.num_heads: int = config.num_attention_heads

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], 0-based within each sequence
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]; None: all type 0
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden_states = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden_states = layer(hidden_states, attn, metadata)
        return hidden_states

    # ---- weights ---------------------------------------------------------------------------

    _QKV = {"query": 0, "key": 1, "value": 2}
    _SKIPPED = ("pooler.", "cls.", "embeddings.position_ids")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (a ``bert.`` prefix, as task heads save it, is
        dropped; old ``gamma``/``beta`` LayerNorm names are read as ``weight``/``bias``)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        size = self.num_heads * head_dim_of(self.config)  # q, k and v rows (a rank's share)
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(self._SKIPPED):
                continue
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias")
            parts = name.split(".")
            rows: torch.Tensor | None
            if len(parts) >= 2 and parts[-2] in self._QKV:
                shard = self._QKV[parts[-2]]
                target = ".".join([*parts[:-2], "qkv_proj", parts[-1]])
                param = params.get(target)
                rows = None if param is None else param.narrow(0, shard * size, size)
                key = f"{target}#{shard}"
            else:
                target, key = name, name
                rows = params.get(target)
            if rows is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            if rows.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(rows.shape)}")
            rows.copy_(tensor)
            loaded.add(key)
        missing = []
        for name in params:
            want = [f"{name}#{i}" for i in range(3)] if ".qkv_proj." in name else [name]
            missing += [w for w in want if w not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
