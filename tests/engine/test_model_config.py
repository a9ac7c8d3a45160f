"""The engine's own config.json reader against transformers' config classes, and what a start-up
no longer imports because of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.model_config import DEFAULTS, ENGINE_FIELDS, ModelConfig, read_model_config
from tests.engine.test_loader import save_checkpoint

CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
           "qwen3": Qwen3Config}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
# config.json contents the reader must take exactly as transformers does (with _SMALL added)
VARIANTS: list[dict[str, Any]] = [
    {},  # every default
    {"num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 100},
    {"num_key_value_heads": None, "head_dim": None},
    {"rope_theta": 500000.0},
    {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 512},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    {"rope_parameters": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 5.0},
    {"use_sliding_window": True, "sliding_window": 128},
    {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 1},
    {"use_sliding_window": False, "sliding_window": 128},
    {"sliding_window": None},
    {"eos_token_id": [2, 7], "bos_token_id": None, "pad_token_id": 0},
    {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 300},
    {"attention_bias": True, "head_dim": 32},
]


def transformers_config(model_type: str, raw: dict[str, Any], folder: Path) -> Any:
    """What ``AutoConfig.from_pretrained`` makes of ``raw`` written as config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **raw}))
    return AutoConfig.from_pretrained(str(folder))


def fields(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name, "<absent>") for name in ENGINE_FIELDS
            if name != "architectures"}


@pytest.mark.parametrize("model_type", sorted(CLASSES))
def test_defaults_are_transformers_defaults(model_type: str) -> None:
    # A transformers upgrade that changes a class default fails here, not in a model's output.
    instance = CLASSES[model_type](**_SMALL)
    for name, value in DEFAULTS[model_type].items():
        if name in _SMALL or name in ("head_dim", "num_key_value_heads", "rope_parameters",
                                      "sliding_window", "layer_types"):
            continue  # filled in by __post_init__: compared through the variants below
        assert getattr(instance, name) == value, name


@pytest.mark.parametrize("model_type", sorted(CLASSES))
@pytest.mark.parametrize("index", range(len(VARIANTS)))
def test_every_engine_field_matches_transformers(tmp_path: Path, model_type: str,
                                                 index: int) -> None:
    raw = {**_SMALL, **VARIANTS[index]}
    ours = read_model_config({"model_type": model_type, **raw})
    assert isinstance(ours, ModelConfig)
    try:
        theirs = transformers_config(model_type, raw, tmp_path)
    except Exception as exc:  # noqa: BLE001 -- transformers refuses this file for this family
        pytest.skip(f"transformers rejects it: {exc}")
    assert fields(ours) == fields(theirs)


@pytest.mark.parametrize("raw", [
    {"model_type": "gpt2"},
    {"model_type": "llama", "partial_rotary_factor": 0.5},
    {"model_type": "llama", "original_max_position_embeddings": 4096},
    {"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}},
    {"model_type": "qwen2",
     "rope_scaling": {"type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
])
def test_what_it_does_not_reproduce_is_left_to_transformers(tmp_path: Path,
                                                            raw: dict[str, Any]) -> None:
    assert read_model_config(raw) is None
    if raw["model_type"] == "gpt2":
        return
    # The loader then reads the folder with transformers' AutoConfig.
    model_dir = tmp_path / "m"
    save_checkpoint(model_dir, "llama" if raw["model_type"] == "llama" else "qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(raw)
    (model_dir / "config.json").write_text(json.dumps(config))
    checkpoint = load_checkpoint(str(model_dir))
    assert not isinstance(checkpoint.config, ModelConfig)
    assert type(checkpoint.config).__name__ in ("LlamaConfig", "Qwen2Config")
    assert checkpoint.config.architectures == [ARCHITECTURES[raw["model_type"]]]


def test_a_folder_start_imports_no_transformers_config(tmp_path: Path) -> None:
    """Importing the engine and reading a folder's checkpoint config pull in neither
    transformers nor torch.distributed (the ~1.5 s that LlamaConfig costs)."""
    save_checkpoint(tmp_path / "m", "llama")
    code = (
        "import sys; import engine.llm_engine, cli.offline, cli.main\n"
        "from engine.checkpoint.loader import load_checkpoint\n"
        f"checkpoint = load_checkpoint({str(tmp_path / 'm')!r})\n"
        "print(type(checkpoint.config).__name__, checkpoint.config.num_key_value_heads)\n"
        "heavy = sorted(m for m in sys.modules if m == 'transformers' or m.startswith("
        "('transformers.', 'torch.distributed.tensor', 'gguf')))\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.splitlines() == ["ModelConfig 2", "[]"]
