"""load_checkpoint on HF folders: weights as transformers has them, tokenizers, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from engine.checkpoint.loader import SUPPORTED_ARCHITECTURES, Checkpoint, load_checkpoint
from engine.checkpoint.model_config import ENGINE_FIELDS

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SAMPLE_TEXTS = (
    "Hello world!",
    "The quick brown fox, 123 times.",
    "  spaces\tand\nlines  ",
    "héllo ☃",
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, general Kenobi.",
    "Batch inference serves many requests at once; the engine schedules them.",
    "def main():\n    return 42\n",
] * 4


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style, ~300 tokens) with ChatML specials and template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(kind: str, vocab_size: int = 96) -> PretrainedConfig:
    """A two-layer config of each supported family; GQA (4 query heads, 2 KV heads)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if kind == "llama-tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=128)
    raise ValueError(kind)


def random_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A model with every parameter random (norms and biases too), so a mix-up cannot hide."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model.eval()


def expected_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's state dict as the loader should yield it: no lm_head when tied."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def save_checkpoint(folder: Path, kind: str, **save_kwargs: object) -> PreTrainedModel:
    model = random_model(tiny_config(kind))
    model.save_pretrained(folder, **save_kwargs)
    return model


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "qwen3", "mistral"])
def test_hf_folder_weights_match_transformers(tmp_path: Path, kind: str) -> None:
    model = save_checkpoint(tmp_path, kind)
    checkpoint = load_checkpoint(str(tmp_path))

    assert checkpoint.path == tmp_path
    assert checkpoint.config.architectures == [type(model).__name__]
    assert checkpoint.config.architectures[0] in SUPPORTED_ARCHITECTURES
    # The engine's own reading of config.json: every field it reads is transformers' value.
    for field in ENGINE_FIELDS:
        assert getattr(checkpoint.config, field, None) == getattr(model.config, field, None), field
    loaded = checkpoint.config.to_transformers().to_dict()
    saved = model.config.to_dict()
    del loaded["_name_or_path"], saved["_name_or_path"]
    assert loaded == saved
    weights = dict(checkpoint.iter_weights(torch.float32))
    expected = expected_weights(model)
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
    if kind == "qwen2":
        assert "model.layers.0.self_attn.k_proj.bias" in weights
    if kind == "qwen3":
        assert weights["model.layers.1.self_attn.q_norm.weight"].shape == (16,)


def test_sharded_folder_and_dtype_cast(tmp_path: Path) -> None:
    model = save_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    weights = dict(load_checkpoint(str(tmp_path)).iter_weights(torch.bfloat16))
    expected = expected_weights(model)
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(weights[name], tensor.to(torch.bfloat16), rtol=0, atol=0)


def test_tokenizer_from_folder_and_override(tmp_path: Path) -> None:
    tokenizer = tiny_tokenizer()
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    save_checkpoint(model_dir, "llama")
    tokenizer.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)

    for checkpoint in (
        load_checkpoint(str(model_dir)),
        load_checkpoint(str(model_dir), tokenizer=str(tokenizer_dir)),
    ):
        loaded = checkpoint.load_tokenizer()
        assert loaded.chat_template == CHAT_TEMPLATE
        assert loaded.eos_token == "<|im_end|>"
        for text in SAMPLE_TEXTS:
            assert loaded.encode(text) == tokenizer.encode(text)
        rendered = loaded.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
        assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert load_checkpoint(str(model_dir), tokenizer=str(tokenizer_dir)).tokenizer_path == (
        tokenizer_dir
    )


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "llama")
    checkpoint = load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="no tokenizer files .*pass a tokenizer"):
        checkpoint.load_tokenizer()


def test_cached_name_resolves_to_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(tmp_path))
    save_checkpoint(tmp_path / "my-tiny-llama", "llama")
    monkeypatch.chdir(tmp_path.parent)  # so the name is not also a relative path

    checkpoint = load_checkpoint("my-tiny-llama")
    assert checkpoint.path == tmp_path / "my-tiny-llama"
    assert isinstance(checkpoint, Checkpoint)


def test_missing_path_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="not an existing folder or .gguf file.*SmolLM2"):
        load_checkpoint(str(tmp_path / "nowhere"))


def test_folder_without_weights(tmp_path: Path) -> None:
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no weights: expected model\.safetensors"):
        load_checkpoint(str(tmp_path))


def test_folder_with_missing_shard(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "llama", max_shard_size="40KB")
    next(iter(sorted(tmp_path.glob("*.safetensors")))).unlink()
    with pytest.raises(ValueError, match="missing shards"):
        load_checkpoint(str(tmp_path))


def test_folder_without_config_or_gguf(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither config.json .* nor a .gguf file"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        # LlamaModel and BertModel load as embedding models (tests/engine/test_embeddings.py)
        ({"architectures": ["T5EncoderModel"], "model_type": "t5"}, "T5EncoderModel"),
        ({"model_type": "roberta"}, "model_type 'roberta'"),
    ],
)
def test_unsupported_architecture(tmp_path: Path, config: dict, named: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=f"{named}.*not supported.*LlamaForCausalLM"):
        load_checkpoint(str(tmp_path))


def test_architecture_inferred_from_model_type(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, "qwen2")
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_checkpoint(str(tmp_path)).config.architectures == ["Qwen2ForCausalLM"]


def test_bad_files(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_checkpoint(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        load_checkpoint(str(tmp_path))
