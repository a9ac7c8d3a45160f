"""Shared fixtures: tiny random-weight checkpoints built from configs (no hub, no download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: one torch thread per test process keeps parallel runs from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run on the CPU through the interpreter, which triton reads when it is first
# imported: any test module may import it (peft does), so set it before every one of them.
# On a GPU, TRITON_INTERPRET=0 compiles them instead (bench/gpu_check.py runs the tests so).
os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference packs many requests into large regular batches.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests while others decode.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ?",
]


def build_tokenizer(vocab_size: int = 384):
    """A small byte-level BPE tokenizer with chat special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_checkpoint(path: Path, arch: str = "llama", *, tie: bool = False, seed: int = 0,
                    **overrides) -> Path:
    """Save a random-weight HF checkpoint (config, safetensors, tokenizer) into ``path``."""
    import torch
    import transformers

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    if arch in ("qwen3", "gemma2", "gemma3"):
        common.setdefault("head_dim", 16)
    if arch in ("gemma2", "gemma3"):
        common.setdefault("query_pre_attn_scalar", 16)
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama (GQA 4:2, untied) with a byte-level BPE tokenizer and a chat template."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


def pytest_terminal_summary(terminalreporter) -> None:
    """The figures the reliability and load tests recorded (tests/figures.py)."""
    from tests.figures import render

    text = render()
    if text:
        terminalreporter.write_sep("=", "figures")
        terminalreporter.write_line(text)
