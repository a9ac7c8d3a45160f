"""Linears and embeddings whose weights stay packed: a GGUF tensor kept in its ggml blocks
(``engine/kernels/quant_gemm.py``'s ``QuantWeight``), or any other packed form that multiplies
itself (``PackedWeight``: the AWQ/GPTQ/FP8 weights of Hugging Face checkpoints take the same
road).

The model is built as for dense weights (parameters from ``torch.empty``: pages never written
cost no memory) and loaded; then ``swap_packed`` replaces each module whose weight arrived packed:
a linear by a ``QuantizedLinear``, the token embedding by a ``QuantizedEmbedding``, and the old
module with its dense parameter is dropped. A fused projection (``qkv_proj``, ``gate_up_proj``)
is made of row ranges that may come in different formats (Gemma 3 270M's Q4_K_M file has Q5_0
q/k and a Q8_0 v), so a ``QuantizedLinear`` holds one or more pieces; adjacent ``QuantWeight``
pieces of one format are joined into one (one product, not two). A tied output layer is a
``QuantizedLinear`` over the embedding's own weight object: one copy.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.quant_gemm import QuantWeight, pack


@runtime_checkable
class PackedWeight(Protocol):
    """A ``[out_features, in_features]`` weight kept in a packed form that multiplies itself."""

    @property
    def out_features(self) -> int: ...

    @property
    def in_features(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """The bytes it keeps resident."""
        ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] @ W.T (+ bias)`` -> ``[..., out]`` in ``x.dtype``."""
        ...

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight, ``[out, in]`` in ``dtype``."""
        ...

    def to(self, device: torch.device | str) -> PackedWeight: ...


@runtime_checkable
class PackedRows(PackedWeight, Protocol):
    """A packed weight that can also hand out some of its rows: an embedding table."""

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize(dtype)[ids]`` without dequantizing the rest: ``[*ids.shape, in]``."""
        ...


class DenseWeight:
    """A dense row range among packed ones: a fused projection whose shards came in different
    forms (one stored F16 beside quantized ones) keeps that shard as plain rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [out, in], the model's dtype

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def to(self, device: torch.device | str) -> DenseWeight:
        return DenseWeight(self.weight.to(device))


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s product over row ranges of packed weights (``pieces``, in row order)."""

    packed_by: str | None = None  # no oneDNN-packed copy (``LoRALinear`` asks)
    # None: the output in x's dtype. float32 (the runner sets it on a bf16 model's output layer
    # kept in ggml blocks, ``QuantWeight`` pieces only): the logits' fp32 sums, unrounded, as
    # the dense path's greedy screen takes its argmax of, and no bf16 [rows, vocab] to widen.
    out_dtype: torch.dtype | None = None

    def __init__(self, pieces: Sequence[PackedWeight], bias: torch.Tensor | None) -> None:
        super().__init__()
        if not pieces:
            raise ValueError("a QuantizedLinear needs at least one weight piece")
        in_features = {piece.in_features for piece in pieces}
        if len(in_features) != 1:
            raise ValueError(f"the pieces of one linear must share in_features, got "
                             f"{sorted(in_features)}")
        self.pieces = list(pieces)
        self.in_features = pieces[0].in_features
        self.out_features = sum(piece.out_features for piece in pieces)
        self.row_offsets = [sum(p.out_features for p in pieces[:i]) for i in range(len(pieces))]
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} "
                             "output features")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.pieces) == 1:
            return self._linear(self.pieces[0], x, self.bias)
        outs = []
        for piece, start in zip(self.pieces, self.row_offsets, strict=True):
            bias = None if self.bias is None else self.bias[start: start + piece.out_features]
            outs.append(self._linear(piece, x, bias))  # [..., piece.out_features]
        return torch.cat(outs, dim=-1)

    def _linear(self, piece: PackedWeight, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if self.out_dtype is None:
            return piece.linear(x, bias)
        return piece.linear(x, bias, out_dtype=self.out_dtype)  # type: ignore[call-arg]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[out, in]`` (tests and references only: it is the dense copy)."""
        return torch.cat([piece.dequantize(dtype) for piece in self.pieces])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, pieces={self.pieces}")


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over a packed table: each step dequantizes only its tokens' rows."""

    def __init__(self, weight: PackedRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight_packed = weight
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.dtype = dtype  # of the rows it returns: the model's

    @property
    def nbytes(self) -> int:
        return self.weight_packed.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_packed.rows(input_ids, self.dtype)  # [*ids.shape, embedding_dim]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, weight={self.weight_packed}"


def join_pieces(pieces: Sequence[PackedWeight]) -> list[PackedWeight]:
    """Adjacent ``QuantWeight`` pieces of one format become one (ggml rows are independent, so
    their bytes stack): Gemma 3's q/k (both Q5_0) run as one product beside its Q8_0 v."""
    joined: list[PackedWeight] = []
    run: list[QuantWeight] = []

    def flush() -> None:
        if len(run) == 1:
            joined.append(run[0])
        elif run:
            joined.append(pack(run[0].fmt, torch.cat([w.raw() for w in run]),
                               run[0].in_features))
        run.clear()

    for piece in pieces:
        if isinstance(piece, QuantWeight) and (not run or (
                piece.fmt == run[0].fmt and piece.in_features == run[0].in_features)):
            run.append(piece)
            continue
        flush()
        if isinstance(piece, QuantWeight):
            run.append(piece)
        else:
            joined.append(piece)
    flush()
    return joined


def swap_packed(model: nn.Module, weights: dict[str, list[PackedWeight]]) -> None:
    """Replace each module named in ``weights`` (``"model.layers.0.self_attn.qkv_proj"``: its
    weight's row pieces, in order) by its packed twin: an ``nn.Embedding`` by a
    ``QuantizedEmbedding`` (one piece that has ``rows``), an ``nn.Linear`` by a
    ``QuantizedLinear`` keeping its bias. The replaced modules, and their dense weights, are
    dropped. Entries naming the same piece objects share them (a tied output layer). Pieces
    are read on the CPU; a model built on a GPU gets them moved to its module's device (AWQ /
    GPTQ / FP8 weights kept for their Triton kernels), each piece once."""
    moved: dict[int, PackedWeight] = {}
    for path, pieces in weights.items():
        module = model.get_submodule(path)
        weight = module.weight
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
        if device.type != "cpu":
            for piece in pieces:
                if id(piece) not in moved:
                    moved[id(piece)] = piece.to(device)
            pieces = [moved[id(piece)] for piece in pieces]
        new: nn.Module
        if isinstance(module, nn.Embedding):
            table = pieces[0]
            if len(pieces) != 1 or not isinstance(table, PackedRows):
                raise ValueError(f"{path}: an embedding kept packed needs one weight that can "
                                 f"hand out rows, got {pieces}")
            new = QuantizedEmbedding(table, module.weight.dtype)
        elif isinstance(module, nn.Linear):
            new = QuantizedLinear(join_pieces(pieces), module.bias)
        else:
            raise ValueError(f"{path} is a {type(module).__name__}; only linears and the "
                             "embedding take packed weights")
        if (new_shape := _shape(new)) != tuple(module.weight.shape):
            raise ValueError(f"{path}: packed weight of shape {new_shape} for a "
                             f"{tuple(module.weight.shape)} weight")
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)


def _shape(module: QuantizedLinear | QuantizedEmbedding) -> tuple[int, int]:
    if isinstance(module, QuantizedEmbedding):
        return module.num_embeddings, module.embedding_dim
    return module.out_features, module.in_features
