"""Tiny random mixture-of-experts checkpoints (config, safetensors, tokenizer), built from
transformers' own classes, for the MoE families' tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import build_tokenizer

# Several experts, top-k > 1, a dense layer where the family allows one.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=16, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "qwen3_moe_unnormed": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                               norm_topk_prob=False, head_dim=16),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32,
                  norm_topk_prob=False, clip_qkv=3.0),
    # sliding window 8 on every other layer (prompts run past it), YaRN, a tight SwiGLU clamp
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    head_dim=16, num_hidden_layers=4, sliding_window=8, swiglu_limit=1.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                     "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 128,
                                     "truncate": False}),
}


def _classes(arch: str):
    import transformers

    return {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[arch]


def make_moe_config(family: str, vocab_size: int, **overrides):
    arch = "qwen3_moe" if family.startswith("qwen3_moe") else family
    config_cls, _ = _classes(arch)
    values: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
    )
    values.update(FAMILIES.get(family, {}))
    values.update(overrides)
    return arch, config_cls(**values)


def make_moe_checkpoint(path: Path, family: str, *, seed: int = 0, tie_router_rows: bool = False,
                        tokenizer: Any = None, **overrides) -> Path:
    """Save a random-weight checkpoint of ``family`` into ``path``. ``tie_router_rows`` makes
    experts 1 and 2 score every token alike (equal router rows), so routing ties happen and go
    as transformers sends them."""
    import torch

    tokenizer = tokenizer or build_tokenizer()
    arch, config = make_moe_config(
        family, len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **overrides)
    _, model_cls = _classes(arch)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    if tie_router_rows:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                    param[2] = param[1]
                if name.endswith("mlp.router.bias"):
                    param[2] = param[1]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
