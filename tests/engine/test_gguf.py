"""GGUF loading: tiny files written here, checked against transformers and the source weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.checkpoint import model_cache
from engine.checkpoint.gguf_config import _llama3_rope_parameters
from engine.checkpoint.loader import load_checkpoint
from tests.engine.test_loader import (
    CHAT_TEMPLATE,
    SAMPLE_TEXTS,
    SPECIAL_TOKENS,
    expected_weights,
    random_model,
    tiny_config,
    tiny_tokenizer,
)

_GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
# Worst error of each type relative to the tensor's largest magnitude (Q4_0 clips one end).
_TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 5e-3, Q.Q4_0: 0.13, Q.Q4_1: 0.07}


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows for the llama architecture."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(path: Path, model: PreTrainedModel, arch: str, qtype: Q,
               extra=None) -> None:
    """Write ``model`` and ``tiny_tokenizer()`` as llama.cpp's converter would, in ``qtype``;
    ``extra(writer)`` adds an architecture's own keys and tensors."""
    config, tokenizer = model.config, tiny_tokenizer()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if extra is not None:
        extra(writer)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if (rope_type := rope.get("rope_type")) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])
        orig = config.rope_parameters["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(orig)
    elif rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_parameters["factor"])

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_token_merges([" ".join(merge) for merge in backend["model"]["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    name_map = gguf.get_tensor_name_map(_GGUF_ARCH[arch], config.num_hidden_layers)
    for name, tensor in expected_weights(model).items():
        base, kind = name.rsplit(".", 1)
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith("q_proj"):
            data = _llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = _llama_cpp_permute(data, config.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and base.endswith("norm"):
            data = data + 1.0  # llama.cpp's Gemma converters store 1 + w
        gguf_name = f"{name_map.get_name(base)}.{kind}"
        if data.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_gguf(folder: Path, kind: str, qtype: Q) -> tuple[Path, PreTrainedModel]:
    config = tiny_config(kind, vocab_size=len(tiny_tokenizer()))
    model = random_model(config)
    arch = "llama" if kind.startswith("llama") else kind
    path = folder / f"tiny-{kind}.{qtype.name}.gguf"
    write_gguf(path, model, arch, qtype)
    return path, model


def transformers_gguf_weights(path: Path) -> dict[str, torch.Tensor]:
    """What ``from_pretrained(gguf_file=...)`` loads for these architectures (its legacy reader).

    ``AutoModelForCausalLM.from_pretrained`` needs ``accelerate`` for GGUF, which boxcar does not
    depend on; it hands llama/qwen2/qwen3 files to this same function.
    """
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


_CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def assert_config_matches(ours: PretrainedConfig, theirs: PretrainedConfig) -> None:
    assert type(ours) is type(theirs)
    for field in _CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.rope_parameters == theirs.rope_parameters
    if ours.model_type == "llama":
        assert ours.head_dim == theirs.head_dim


@pytest.mark.parametrize(
    ("kind", "qtype"),
    [
        ("llama", Q.F32),
        ("llama", Q.F16),
        ("llama", Q.BF16),
        ("llama", Q.Q8_0),
        ("llama-tied", Q.Q4_0),
        ("llama", Q.Q4_1),
        ("qwen2", Q.F32),
        ("qwen2", Q.Q8_0),
    ],
)
def test_gguf_matches_transformers_and_source(tmp_path: Path, kind: str, qtype: Q) -> None:
    path, model = make_gguf(tmp_path, kind, qtype)
    checkpoint = load_checkpoint(str(path))

    assert checkpoint.path == path
    assert checkpoint.config.architectures == [type(model).__name__]
    assert_config_matches(
        checkpoint.config, AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    )
    assert checkpoint.config.tie_word_embeddings == model.config.tie_word_embeddings

    ours = dict(checkpoint.iter_weights(torch.float32))
    source = expected_weights(model)
    theirs = transformers_gguf_weights(path)
    assert sorted(ours) == sorted(source)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor.float(), rtol=0, atol=0, msg=name)
    for name, tensor in source.items():  # this also checks the Q/K un-permutation
        tolerance = _TOLERANCE[qtype] * tensor.abs().max().item() if ours[name].ndim > 1 else 0
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=tolerance, msg=name)


def test_gguf_qwen3_against_source(tmp_path: Path) -> None:
    # transformers' legacy GGUF reader leaves Qwen3's head_dim at the class default, so the source
    # model is the reference here; head_dim 16 != hidden / heads checks it is read from the file.
    path, model = make_gguf(tmp_path, "qwen3", Q.F16)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.config.architectures == ["Qwen3ForCausalLM"]
    assert checkpoint.config.head_dim == 16
    assert checkpoint.config.attention_bias is False
    ours = dict(checkpoint.iter_weights(torch.float32))
    source = expected_weights(model)
    assert sorted(ours) == sorted(source)
    for name, tensor in source.items():
        atol = 1e-3 * tensor.abs().max().item() if tensor.ndim > 1 else 0
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=atol, msg=name)


def test_gguf_tokenizer_and_folder_lookup(tmp_path: Path) -> None:
    path, _ = make_gguf(tmp_path, "llama", Q.F16)
    checkpoint = load_checkpoint(str(tmp_path))  # a folder holding one .gguf
    assert checkpoint.path == path

    tokenizer = checkpoint.load_tokenizer()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    source = tiny_tokenizer()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"
    for text in SAMPLE_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text) == source.encode(text)
    conversation = [{"role": "user", "content": "Hi"}]
    assert (
        tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        == (source.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"])
    )


def test_gguf_rope_scaling_metadata(tmp_path: Path) -> None:
    config = tiny_config("qwen2", vocab_size=len(tiny_tokenizer()))
    config.rope_parameters = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = tmp_path / "yarn.gguf"
    write_gguf(path, random_model(config), "qwen2", Q.F32)
    assert load_checkpoint(str(path)).config.rope_parameters == config.rope_parameters


def test_llama3_rope_recovered_from_rope_freqs() -> None:
    # Llama 3.1's rope as llama.cpp's converter bakes it into the rope_freqs tensor
    theta, head_dim, factor, low, high, original = 500000.0, 128, 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    params = _llama3_rope_parameters(np.array(divisors, dtype=np.float32), theta, head_dim)
    assert params["rope_type"] == "llama3"
    assert params["original_max_position_embeddings"] == original

    def inv_freq(rope_parameters: dict) -> torch.Tensor:
        config = tiny_config("llama")
        config.head_dim, config.rope_parameters = head_dim, rope_parameters
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]

    reference = {"rope_type": "llama3", "rope_theta": theta, "factor": factor}
    reference |= {"low_freq_factor": low, "high_freq_factor": high}
    reference["original_max_position_embeddings"] = original
    torch.testing.assert_close(inv_freq(params), inv_freq(reference), rtol=1e-5, atol=0)


def test_bad_gguf_files(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_checkpoint(str(tmp_path / "junk.gguf"))

    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'; supported .*'llama'"):
        load_checkpoint(str(tmp_path / "gpt2.gguf"))

    with pytest.raises(ValueError, match=r"several \.gguf files"):
        load_checkpoint(str(tmp_path))


@pytest.mark.slow
def test_default_model_matches_transformers() -> None:
    path = model_cache.pull(quiet=True)
    checkpoint = load_checkpoint("default")
    assert checkpoint.path == path
    config = checkpoint.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.tie_word_embeddings
    reference_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert_config_matches(config, reference_config)

    # A two-layer skeleton makes transformers keep only the first two blocks (it still reads all).
    reference_config.num_hidden_layers = 2
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(reference_config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert len(theirs) == 2 + 2 * 9  # embedding, final norm, 9 tensors per block
    ours = {name: t for name, t in checkpoint.iter_weights(torch.float32) if name in theirs}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)

    tokenizer = checkpoint.load_tokenizer()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in (*SAMPLE_TEXTS, "<|im_start|>user\nWhat is 2+2?<|im_end|>"):
        assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
