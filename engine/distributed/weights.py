"""A rank's slices of a safetensors checkpoint, read without the rest.

``safe_open``'s slices read only the bytes a slice covers, so a rank's peak memory is its share of
the model (plus one slice), not the model. The names stay Hugging Face's, so the family's own
``load_weights`` places them (its parameters have the local sizes already).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engine.checkpoint.ggml_rows import ggml_rows
from engine.checkpoint.gguf_cache import quantized_entries
from engine.checkpoint.loader import Checkpoint, safetensors_files, safetensors_metadata
from engine.distributed.sharding import ShardPlan, is_vocabulary


def iter_shard_weights(checkpoint: Checkpoint, plan: ShardPlan,
                       dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)``: this rank's slice of each split tensor, the whole of the
    replicated ones (norms), cast to ``dtype``."""
    from safetensors import safe_open

    if checkpoint.is_gguf:
        raise ValueError("tensor_parallel_size > 1 reads a safetensors folder; this .gguf file "
                         "has none yet (run `boxcar model pull` on it to convert it once)")
    tied = bool(getattr(checkpoint.config, "tie_word_embeddings", False))
    for file in safetensors_files(Path(checkpoint.path)):
        rows = quantized_entries(safetensors_metadata(file))  # a converted GGUF's ggml rows
        with safe_open(str(file), framework="pt") as stored:
            for name in stored.keys():
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                local_name = plan.local_expert_name(name)
                if local_name is None:
                    continue  # (expert parallel) another rank's expert
                source = stored.get_slice(name)
                if name in rows:  # dequantized whole (as one device would), then sliced
                    entry = rows[name]
                    source = _Whole(ggml_rows(entry.gguf_name, entry.fmt, stored.get_tensor(
                        name), (entry.out_features, entry.in_features)).dequantize())
                tensor = _read_slice(source, name, plan)
                yield local_name, tensor.to(dtype) if tensor.is_floating_point() else tensor


class _Whole:
    """A tensor already in memory, sliced as ``safe_open``'s slices are."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def _read_slice(stored, name: str, plan: ShardPlan) -> torch.Tensor:
    if plan.is_row_parallel_bias(name) and plan.rank != 0:
        return torch.zeros_like(stored[:])  # a bias: small
    stacked = plan.stacked_expert_slice(name)
    if stacked is not None:
        dim, start, length = stacked
        index = [slice(None)] * len(stored.get_shape())
        index[dim] = slice(start, start + length)
        return stored[tuple(index)]
    norm = plan.norm_rows(name, stored.get_shape()[0])
    if norm is not None:
        return stored[norm[0]:norm[0] + norm[1]]
    rows = plan.row_slices(name)
    if rows is not None:
        parts = [stored[start:start + length] for start, length in rows]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        if is_vocabulary(name):
            missing = plan.vocab_shard - tensor.shape[0]  # the last rank's padding rows
            if missing:
                tensor = torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
        return tensor
    columns = plan.column_slice(name)
    if columns is not None:
        start, length = columns
        return stored[:, start:start + length]
    return stored[:]
