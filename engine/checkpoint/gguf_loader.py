"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: its config and its weights, HF-named.

Tensors are dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants and the others gguf implements) and renamed from llama.cpp's ``blk.N.attn_q`` scheme to
``model.layers.N.self_attn.q_proj``. llama.cpp's converter interleaves the rows of Q and K for the
``llama`` architecture (its rope rotates adjacent pairs, HF's rotates halves); that is undone here.
Qwen2 and Qwen3 files use the half-rotation rope and are stored as HF has them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import PretrainedConfig

from engine.checkpoint.gguf_config import config_from_gguf, gguf_architecture

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
        return GGUFReader(path, "r")
    except Exception as error:  # gguf raises ValueError, struct.error, IndexError... on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def load_gguf_config(path: Path) -> PretrainedConfig:
    """The HF config of a GGUF file (see ``engine.checkpoint.gguf_config``)."""
    return config_from_gguf(open_gguf(path))


def iter_gguf_weights(
    path: Path, config: PretrainedConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for each weight in the file, dequantized, cast to ``dtype``."""
    for name, tensor in iter_gguf_tensors(path, config):
        yield name, tensor.to(dtype)


def iter_gguf_tensors(path: Path, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for each weight, dequantized, in gguf's own output dtype.

    The converted cache (``engine.checkpoint.gguf_cache``) stores these uncast, so a cast of its
    tensors equals a cast of these, bit for bit.
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
        weights = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rows(weights, config.num_attention_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rows(weights, config.num_key_value_heads)
        if arch in _NORM_SHIFTED and name.endswith("norm.weight"):
            weights = weights - 1.0  # a new array: llama.cpp's + 1 undone
        if not weights.flags.writeable:  # F32 tensors are views of the read-only file mapping
            weights = weights.copy()
        yield name, torch.from_numpy(weights)


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
