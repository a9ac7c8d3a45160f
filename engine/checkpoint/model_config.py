"""A checkpoint's config.json read without transformers' config classes, for the engine's families.

Importing ``transformers.LlamaConfig`` (or ``AutoConfig``) costs ~1.5 s of a start-up: it scans
every model folder of transformers and pulls in ``torch.distributed.tensor`` through its
activations and hub-kernel modules. The engine reads a dozen fields of the config, so for the
architectures it runs (``model_type`` llama, mistral, qwen2, qwen3) this module fills them the way
transformers' classes do: the class defaults, the file's values on top, then the classes'
``__post_init__`` rules (KV heads default to the heads; ``head_dim`` to hidden/heads for
Llama and Mistral; Qwen's ``sliding_window`` is None unless ``use_sliding_window``; the RoPE
fields standardised into ``rope_parameters`` with ``rope_theta`` and ``rope_type``).

``read_model_config`` returns None for anything outside that (another model type, nested or
partial RoPE parameters, a top-level ``original_max_position_embeddings``): the loader then uses
``transformers.AutoConfig``. ``tests/engine/test_model_config.py`` checks every field the engine
reads against transformers' classes, defaults included, so a transformers upgrade that changes a
default fails there.
"""

from __future__ import annotations

import copy
from typing import Any

DEFAULT_ROPE_THETA = 10_000.0
# The fields of a config the engine (and its benches) read; the test compares exactly these.
ENGINE_FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "sliding_window", "use_sliding_window",
    "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "layer_types",
)
_COMMON: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None,
    "pad_token_id": None,
}
# transformers' class defaults for the fields above (LlamaConfig, MistralConfig, Qwen2Config,
# Qwen3Config); a field a class does not have is absent here too.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON, "vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": None,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False, "mlp_bias": False, "head_dim": None,
    },
    "mistral": {
        **_COMMON, "vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
        "head_dim": None, "max_position_embeddings": 4096 * 32, "bos_token_id": 1,
        "eos_token_id": 2, "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
        "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
        "bos_token_id": None, "eos_token_id": None, "max_window_layers": 28, "layer_types": None,
    },
    "qwen3": {
        **_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
        "head_dim": 128, "max_position_embeddings": 32768, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096, "bos_token_id": None,
        "eos_token_id": None, "max_window_layers": 28, "layer_types": None,
    },
}
_SCALED_ROPE_TYPES = ("llama3", "yarn", "longrope")


class ModelConfig:
    """A config.json's values as attributes (``config.hidden_size``), with transformers'
    defaults and normalisation for the engine's families. ``to_dict`` gives the values;
    ``to_transformers`` builds transformers' own config from the same file (for tools that
    need one, such as building the reference model)."""

    architectures: list[str]

    def __init__(self, values: dict[str, Any], raw: dict[str, Any]) -> None:
        self.__dict__.update(values)
        self._raw = raw

    def to_dict(self) -> dict[str, Any]:
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if k != "_raw"}

    def to_transformers(self) -> Any:
        from transformers import AutoConfig

        raw = dict(self._raw)
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        config.architectures = list(getattr(self, "architectures", None) or [])
        return config

    def __repr__(self) -> str:
        return f"ModelConfig({self.to_dict()!r})"


def read_model_config(raw: dict[str, Any]) -> ModelConfig | None:
    """The config of a config.json's contents, or None when transformers must read it."""
    model_type = raw.get("model_type")
    if model_type not in DEFAULTS or not _simple_rope(raw):
        return None
    values = {**DEFAULTS[model_type], **copy.deepcopy(raw)}
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type in ("llama", "mistral") and values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if model_type in ("qwen2", "qwen3"):
        if not values.get("use_sliding_window"):
            values["sliding_window"] = None
        if values.get("layer_types") is None:  # the layers from max_window_layers on slide
            values["layer_types"] = [
                "sliding_attention"
                if values["sliding_window"] is not None and i >= values["max_window_layers"]
                else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
    values["rope_parameters"] = _rope_parameters(values)
    return ModelConfig(values, copy.deepcopy(raw))


def _simple_rope(raw: dict[str, Any]) -> bool:
    """One flat RoPE dict (or none), no partial rotary factor, no top-level original length:
    the cases ``_rope_parameters`` reproduces exactly."""
    if "partial_rotary_factor" in raw or "original_max_position_embeddings" in raw:
        return False
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or "partial_rotary_factor" in value:
            return False
        if any(isinstance(v, dict) for v in value.values()):
            return False
    return True


def _rope_parameters(values: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``convert_rope_params_to_dict`` + ``standardize_rope_params`` for one flat
    dict: a legacy ``rope_scaling`` wins over ``rope_parameters``; ``rope_theta`` (top-level, else
    10000) and ``rope_type`` (its legacy ``type``, else default) are filled in; scaled types get
    ``original_max_position_embeddings`` (the model's length when absent)."""
    rope = dict(values.pop("rope_scaling", None) or values.get("rope_parameters") or {})
    rope.setdefault("rope_theta", values.pop("rope_theta", DEFAULT_ROPE_THETA))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _SCALED_ROPE_TYPES:
        rope.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    return rope
