"""Rebuild a Hugging Face config from a GGUF file's metadata (llama.cpp key names)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

# GGUF `general.architecture` -> (HF architecture, config class). Mistral files say "llama".
GGUF_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig]]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config),
    "gemma2": ("Gemma2ForCausalLM", Gemma2Config),
    "gemma3": ("Gemma3ForCausalLM", Gemma3TextConfig),
    "phi3": ("Phi3ForCausalLM", Phi3Config),
}
# llama.cpp's Gemma 3 layer pattern when the file does not say: every sixth layer is global.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10_000.0

_MISSING = object()


def _filename(reader: GGUFReader) -> str:
    return str(getattr(reader.data, "filename", "<gguf>"))


def field_value(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """The value stored under ``key``; ``default`` when absent, else a ValueError naming the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file {_filename(reader)} has no metadata key {key!r}")
        return default
    return field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    """The file's ``general.architecture``, checked against the ones this loader maps."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {_filename(reader)} has architecture {arch!r}; supported GGUF "
            f"architectures are {sorted(GGUF_ARCHITECTURES)} (Mistral files use 'llama')"
        )
    return arch


def config_from_gguf(reader: GGUFReader) -> PretrainedConfig:
    """The HF config (LlamaConfig, Qwen2Config or Qwen3Config) the file's metadata describes."""
    arch = gguf_architecture(reader)
    hf_architecture, config_class = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = _MISSING) -> Any:
        return field_value(reader, f"{arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    hidden_size = int(key("embedding_length"))
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {_filename(reader)} has no token_embd.weight tensor")
    # The embedding's row count is what the weights need, whatever the metadata claims.
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    q_proj = tensors.get("blk.0.attn_q.weight")
    head_dim = key("attention.key_length", None)
    if head_dim is None:
        # ggml shapes are [in_features, out_features]
        head_dim = (
            int(q_proj.shape[1]) // num_heads if q_proj is not None else hidden_size // num_heads
        )
    head_dim = int(head_dim)

    kwargs: dict[str, Any] = {
        "architectures": [hf_architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_parameters": (_phi3_rope(reader, tensors, head_dim) if arch == "phi3"
                            else _rope_parameters(reader, arch, head_dim)),
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _eos_token_ids(reader),
        "pad_token_id": field_value(reader, "tokenizer.ggml.padding_token_id", None),
    }
    context_length = key("context_length", None)
    if context_length is not None:
        kwargs["max_position_embeddings"] = int(context_length)
    if arch in ("llama", "qwen3"):
        kwargs["head_dim"] = int(head_dim)
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_gate.bias" in tensors
    if arch in ("gemma2", "gemma3", "phi3"):
        kwargs["sliding_window"] = key("attention.sliding_window", None)
    if arch in ("gemma2", "gemma3"):
        kwargs.update(_gemma(key, arch, kwargs, head_dim))
    if arch == "phi3":
        kwargs.pop("rope_parameters")
        kwargs["rope_scaling"] = _phi3_rope(reader, tensors, head_dim)
        if "original_max_position_embeddings" in kwargs["rope_scaling"]:
            kwargs["original_max_position_embeddings"] = kwargs["rope_scaling"][
                "original_max_position_embeddings"]
        # llama.cpp stores gate and up as one ffn_up of 2 * intermediate rows
        kwargs["intermediate_size"] = int(tensors["blk.0.ffn_up.weight"].shape[1]) // 2
    return config_class(**kwargs)


def _gemma(key, arch: str, kwargs: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma's fields: head_dim, soft-caps, the query scale llama.cpp derives from the model
    size (hidden / heads on the 27B models, head_dim otherwise), the layer pattern and the
    local layers' rope base (Gemma 3)."""
    num_layers = kwargs["num_hidden_layers"]
    is_27b = num_layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "head_dim": head_dim,
        "query_pre_attn_scalar": (kwargs["hidden_size"] // kwargs["num_attention_heads"]
                                  if is_27b else head_dim),
        "tie_word_embeddings": True,
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = key("attn_logit_softcapping", None)
        out["final_logit_softcapping"] = key("final_logit_softcapping", None)
        return out
    pattern = int(key("attention.sliding_window_pattern", _GEMMA3_PATTERN))
    out["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                          for i in range(num_layers)]
    full = dict(kwargs.pop("rope_parameters"))
    out["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_BASE},
    }
    return out


def _phi3_rope(reader: GGUFReader, tensors: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Phi-3's rope: LongRoPE from the ``rope_factors_long`` / ``rope_factors_short`` tensors
    llama.cpp writes, else the default; a partial rotary dimension count on Phi-4-mini."""
    theta = float(field_value(reader, "phi3.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    rotary = field_value(reader, "phi3.rope.dimension_count", None)
    if rotary is not None and int(rotary) != head_dim:
        params["partial_rotary_factor"] = int(rotary) / head_dim
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None or short is None:
        return params
    params.update(
        rope_type="longrope",
        long_factor=dequantize(long.data, long.tensor_type).reshape(-1).tolist(),
        short_factor=dequantize(short.data, short.tensor_type).reshape(-1).tolist(),
    )
    original = field_value(reader, "phi3.rope.scaling.original_context_length", None)
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    attn_factor = field_value(reader, "phi3.rope.scaling.attn_factor", None)
    if attn_factor is not None:
        params["attention_factor"] = float(attn_factor)
    return params


def _eos_token_ids(reader: GGUFReader) -> int | list[int] | None:
    """EOS, plus end-of-turn / end-of-message ids when the file names different ones."""
    eos_ids: list[int] = []
    for name in ("eos", "eot", "eom"):
        token_id = field_value(reader, f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    if not eos_ids:
        return None
    return eos_ids[0] if len(eos_ids) == 1 else eos_ids


def _rope_parameters(reader: GGUFReader, arch: str, head_dim: int) -> dict[str, Any]:
    """HF ``rope_parameters`` from the ``{arch}.rope.*`` keys or a llama3 ``rope_freqs`` tensor."""
    theta = float(field_value(reader, f"{arch}.rope.freq_base", 10000.0))
    scaling = field_value(reader, f"{arch}.rope.scaling.type", None)
    factor = field_value(reader, f"{arch}.rope.scaling.factor", None)
    if scaling is None and (linear := field_value(reader, f"{arch}.rope.scale_linear", None)):
        scaling, factor = "linear", linear
    if scaling == "linear" and factor not in (None, 0.0, 1.0):
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if scaling in (None, "none", "linear"):
        rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if rope_freqs is not None:
            factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
            return _llama3_rope_parameters(factors, theta, head_dim)
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "yarn" and factor is not None:
        params: dict[str, Any] = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor)}
        original = field_value(reader, f"{arch}.rope.scaling.original_context_length", None)
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field_value(reader, f"{arch}.rope.scaling.{gguf_key}", None)
            if value is not None:
                params[hf_key] = float(value)
        return params
    raise ValueError(
        f"GGUF file {_filename(reader)} uses rope scaling {scaling!r}; supported: none, "
        "linear, yarn, and llama3 (a rope_freqs tensor)"
    )


def _llama3_rope_parameters(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 rope parameters from llama.cpp's per-frequency divisors.

    llama.cpp stores, for each rotary frequency, the divisor HF's llama3 rule applies: 1 above the
    high-frequency cut, ``factor`` below the low-frequency cut, ``1 / ((1 - s) / factor + s)`` in
    between, where ``s = (L / wavelen - low) / (high - low)`` for ``L`` the original context. The
    rule only depends on ``L / low`` and ``L / high``, so fixing ``low = 1`` loses nothing: two
    points in the smooth band give ``L`` and ``high`` by a line fit, and the result is checked by
    recomputing every divisor.
    """
    factors = factors.astype(np.float64)
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != wavelen.shape:
        raise ValueError(
            f"rope_freqs has {factors.size} entries, expected head_dim / 2 = {wavelen.size}"
        )
    factor = float(factors.max())
    if factor <= 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    high_band = np.isclose(factors, 1.0)
    low_band = np.isclose(factors, factor)
    smooth = ~(high_band | low_band)
    if smooth.sum() >= 2:
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[smooth], s, 1)  # s = slope / wavelen + intercept
        high_freq_factor = 1 - 1 / intercept
        original = -slope / intercept
    elif not smooth.any() and high_band.any() and low_band.any():
        # no smooth band: any cuts between the two bands reproduce the divisors
        original = float(wavelen[low_band].min()) * (1 - 1e-6)
        high_freq_factor = original / (float(wavelen[high_band].max()) * (1 + 1e-6))
    else:
        raise ValueError("cannot express this GGUF file's rope_freqs as llama3 rope scaling")
    if abs(original - round(original)) < 1e-3 * original:
        original = round(original)
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high_freq_factor),
        "original_max_position_embeddings": original,
    }
    if not np.allclose(_llama3_divisors(params, wavelen), factors, rtol=1e-3):
        raise ValueError("cannot express this GGUF file's rope_freqs as llama3 rope scaling")
    return params


def _llama3_divisors(params: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    """The per-frequency divisors HF's llama3 rope rule gives for ``params`` (for the check)."""
    factor, original = params["factor"], params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    s = (original / wavelen - low) / (high - low)
    divisors = 1 / ((1 - s) / factor + s)
    divisors = np.where(wavelen < original / high, 1.0, divisors)
    return np.where(wavelen > original / low, factor, divisors)
