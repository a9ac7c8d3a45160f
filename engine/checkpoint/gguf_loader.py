"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: its config and its weights, HF-named.

Tensors are renamed from llama.cpp's ``blk.N.attn_q`` scheme to
``model.layers.N.self_attn.q_proj``. A 2-D weight in a block format (Q4_0/1, Q5_0/1, Q8_0, the
K-quants and the others gguf knows) comes out as its ggml rows (``ggml_rows.GGMLRows``),
checked, for the engine to keep quantized or to dequantize with ``gguf.quants.dequantize``;
F32, F16 and BF16 tensors and the norms come out dense. llama.cpp's converter interleaves the
rows of Q and K for the ``llama`` architecture (its rope rotates adjacent pairs, HF's rotates
halves); that is undone here, on the ggml rows' bytes for a quantized Q/K (rows are independent
blocks). Qwen2 and Qwen3 files use the half-rotation rope and are stored as HF has them.

A tensor whose bytes do not lie whole in the file (truncated), or that holds more bytes than its
shape and type need before the next tensor (a corrupt shape), is refused when the file is
opened, naming the tensor and the bytes it needs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import PretrainedConfig

from engine.checkpoint.ggml_rows import GGMLRows, from_numpy, ggml_rows, materialize
from engine.checkpoint.gguf_config import config_from_gguf, gguf_architecture
from engine.layers.quantized import PackedWeight

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per architecture, where its names differ from the table above: Gemma's four norms a layer,
# Phi-3's fused q/k/v and gate/up (llama.cpp's ``ffn_up`` holds both).
_ARCH_BLOCK_NAMES = {
    "gemma2": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_ARCH_BLOCK_NAMES["gemma3"] = _ARCH_BLOCK_NAMES["gemma2"]
# llama.cpp's Gemma converters store every RMSNorm weight plus one (Gemma scales by 1 + w).
_NORM_SHIFTED = ("gemma2", "gemma3")
# Tensors whose content already went into the config.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight",
                             "rope_factors_short.weight"})
# gguf's element types (everything else is blocks: a 2-D tensor of those is kept as ggml rows)
DENSE_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16, GGMLQuantizationType.F64,
                         GGMLQuantizationType.I8, GGMLQuantizationType.I16,
                         GGMLQuantizationType.I32, GGMLQuantizationType.I64})
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_LEVEL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name of a llama.cpp tensor name; None for names this loader does not map."""
    if match := _BLOCK_TENSOR.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif match := _TOP_LEVEL_TENSOR.fullmatch(gguf_name):
        part, kind = match.groups()
        if part in _TOP_LEVEL_NAMES:
            return f"{_TOP_LEVEL_NAMES[part]}.{kind}"
    return None


def open_gguf(path: Path) -> GGUFReader:
    """A reader for ``path``; parsing the metadata of a real file takes seconds, so it is reused."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as error:
        raise ValueError(f"cannot read GGUF file {path}: {error}") from error
    return _open_gguf(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFReader:
    # mtime and size are part of the key so that a rewritten file is read again
    try:
        return _CheckedReader(path, "r")
    except TensorBytesError:
        raise
    except Exception as error:  # gguf raises ValueError, struct.error, IndexError... on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def load_gguf_config(path: Path) -> PretrainedConfig:
    """The HF config of a GGUF file (see ``engine.checkpoint.gguf_config``)."""
    return config_from_gguf(open_gguf(path))


def iter_gguf_weights(
    path: Path, config: PretrainedConfig, dtype: torch.dtype, *, quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Yield ``(hf_name, weight)`` for each weight in the file: with ``quantized``, each
    quantized 2-D weight packed (``GGMLRows.pack``), else dequantized; the rest cast to
    ``dtype``."""
    for name, tensor in iter_gguf_tensors(path, config):
        yield name, materialize(tensor, dtype, quantized)


def iter_gguf_tensors(
    path: Path, config: PretrainedConfig
) -> Iterator[tuple[str, torch.Tensor | GGMLRows]]:
    """Yield ``(hf_name, tensor)`` for each weight as the file stores it: a quantized 2-D
    weight as its checked ggml rows, any other tensor dequantized by gguf in its own output
    dtype (F16 stays F16).

    The converted cache (``engine.checkpoint.gguf_cache``) stores these as they are, so what it
    loads equals what the file loads, bit for bit.
    """
    reader = open_gguf(path)
    arch = gguf_architecture(reader)
    permute_qk = arch == "llama"
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_tensor_name(tensor.name, arch)
        if name is None:
            raise ValueError(
                f"GGUF file {path} has tensor {tensor.name!r}, which has no place in a "
                f"{(config.architectures or ['this model'])[0]}; is it another architecture?"
            )
        # ggml lists dimensions fastest-first, torch slowest-first
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        if tensor.tensor_type not in DENSE_TYPES and len(shape) == 2:
            data = tensor.data  # uint8 [rows, row bytes]: a view of the file's mapping
            if permute_qk and name.endswith("q_proj.weight"):
                data = _unpermute_rows(data, config.num_attention_heads)
            elif permute_qk and name.endswith("k_proj.weight"):
                data = _unpermute_rows(data, config.num_key_value_heads)
            yield name, ggml_rows(tensor.name, tensor.tensor_type.name, from_numpy(data),
                                  (shape[0], shape[1]))
            continue
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rows(weights, config.num_attention_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rows(weights, config.num_key_value_heads)
        if arch in _NORM_SHIFTED and name.endswith("norm.weight"):
            weights = weights - 1.0  # a new array: llama.cpp's + 1 undone
        yield name, from_numpy(weights)  # F32 tensors are views of the read-only mapping


def quantized_types(path: Path) -> dict[str, list[str]]:
    """The block types of the file's quantized 2-D weights -> those tensors' GGUF names (what
    ``iter_gguf_tensors`` yields as ggml rows)."""
    types: dict[str, list[str]] = {}
    for tensor in open_gguf(path).tensors:
        if (tensor.tensor_type not in DENSE_TYPES and len(tensor.shape) == 2
                and tensor.name not in _CONFIG_TENSORS):
            types.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    return types


def _unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: per head, rows ``x0 y0 x1 y1 ...`` -> ``x0 x1 ... y0 y1 ...``.

    llama.cpp reshapes the HF rows to ``[num_heads, 2, head_dim // 2]`` and swaps the last two axes;
    the inverse reads them as ``[num_heads, head_dim // 2, 2]`` and swaps back.
    """
    rows = weights.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise ValueError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    split = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(weights.shape)


class TensorBytesError(ValueError):
    """A tensor's bytes do not fit the file: truncated, or a corrupt shape or offset."""


class _CheckedReader(GGUFReader):
    """``GGUFReader`` that checks where each tensor's bytes lie before it maps them: gguf's own
    failure on a truncated file is a reshape error that names no tensor."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        extents = []
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            ggml_type = GGMLQuantizationType(int(raw_dtype[0]))
            block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
            num_bytes = int(np.prod(dims)) * block_bytes // block_values
            name = bytes(name_data).decode("utf-8", "replace")
            shape = " x ".join(str(int(d)) for d in reversed(dims.tolist()))
            extents.append((start_offs + int(offset[0]), num_bytes, name,
                            f"{ggml_type.name}, {shape}"))
        extents.sort()
        file_size = len(self.data)
        for i, (start, num_bytes, name, kind) in enumerate(extents):
            last = i + 1 == len(extents)
            limit = file_size if last else extents[i + 1][0]
            held = limit - start
            if held < num_bytes:
                where = ("the end of the file" if last
                         else f"the next tensor, {extents[i + 1][2]!r}")
                raise TensorBytesError(
                    f"GGUF file {self.data.filename}: tensor {name!r} ({kind}) needs "
                    f"{num_bytes} bytes, but only {max(held, 0)} lie before {where}: the file "
                    "is truncated or corrupt")
            if not last and held - num_bytes >= self.alignment:
                raise TensorBytesError(
                    f"GGUF file {self.data.filename}: tensor {name!r} ({kind}) needs "
                    f"{num_bytes} bytes, but {held} lie before the next tensor: its shape or "
                    "type is corrupt")
        super()._build_tensors(start_offs, fields)
