"""Write a random-weight checkpoint folder of any family, for benchmarks (no hub download).

``python -m bench.random_model OUT [--family gemma2|gemma3|phi3|llama|qwen3_moe|mixtral|gpt_oss]
[--seed 0]``

The default is a Gemma-2-like model of ~100M parameters (hidden 768, 8 layers, 4 heads of 128
dims over 2 KV heads, GeGLU 3072, sliding window 4096 on every other layer, attention and final
soft-caps, tied embeddings), with the default model's tokenizer and chat template (49,152
tokens), saved in fp32 safetensors. ``python -m bench.offline --model OUT`` then runs it; the
weights are random, so the text is noise, but the work per token is the real model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SHAPE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             max_position_embeddings=8192, rms_norm_eps=1e-6)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=128, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=512, query_pre_attn_scalar=128, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # Mixtures of experts at the same attention shape: 16 experts, top-2 (top-4 for Qwen3-MoE),
    # 768 expert columns, so a token's expert work is about the dense MLP's.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768, norm_topk_prob=True,
        tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, intermediate_size=1536,
        tie_word_embeddings=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, intermediate_size=1536,
        sliding_window=512, tie_word_embeddings=True)),
}


def write_random_model(out: Path, family: str = "gemma2", seed: int = 0) -> Path:
    import transformers

    from engine.checkpoint.loader import load_checkpoint
    from engine.checkpoint.model_cache import DEFAULT_MODEL

    tokenizer = load_checkpoint(DEFAULT_MODEL).load_tokenizer()
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **{**SHAPE, **extra})  # a family's own values win (the experts' sizes)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{family}: {num_params / 1e6:.1f}M parameters written to {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gemma2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_random_model(args.out, args.family, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
