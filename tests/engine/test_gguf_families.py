"""GGUF files of Gemma 2, Gemma 3 and Phi-3 as llama.cpp writes them (its tensor names, Gemma's
norm weights stored plus one, Phi-3's fused q/k/v and gate/up, LongRoPE factors as tensors):
the config and weights come back as the Hugging Face checkpoint had them, and the engine's
greedy tokens equal transformers' on the source model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from engine import LLM, SamplingParams
from engine.checkpoint.loader import load_checkpoint, prepare_model
from tests.engine.test_gguf import write_gguf
from tests.engine.test_loader import expected_weights, tiny_tokenizer

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             initializer_range=0.2)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)],
            "original_max_position_embeddings": 128}


def _gemma2_keys(config):
    def extra(writer):
        writer.add_sliding_window(config.sliding_window)
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
    return extra


def _gemma3_keys(config):
    def extra(writer):
        writer.add_sliding_window(config.sliding_window)
    return extra


def _phi3_keys(config):
    rope = config.rope_parameters

    def extra(writer):
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight",
                          np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight",
                          np.asarray(rope["short_factor"], dtype=np.float32))
    return extra


CASES = {
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, tie_word_embeddings=True), _gemma2_keys),
    # llama.cpp's Gemma 3: every sixth layer global, local rope base 10000
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        tie_word_embeddings=True), _gemma3_keys),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        sliding_window=10, rope_scaling=LONGROPE, tie_word_embeddings=False), _phi3_keys),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_family_gguf_loads_as_its_checkpoint(tmp_path, arch):
    config_cls, model_cls, fields, keys = CASES[arch]
    tokenizer = tiny_tokenizer()
    config = config_cls(**{**SHAPE, **fields}, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # Gemma's norms start at zero: give them something to shift
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.1)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, model, arch, Q.F32, extra=keys(config))

    checkpoint = load_checkpoint(str(path))
    got = checkpoint.config
    assert got.architectures == [model_cls.__name__]
    for field in ("sliding_window", "head_dim", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "layer_types"):
        assert getattr(got, field, None) == getattr(config, field, None), field
    if arch == "phi3":
        rope = got.rope_parameters
        assert rope["rope_type"] == "longrope"
        np.testing.assert_allclose(rope["long_factor"], LONGROPE["long_factor"], rtol=1e-6)
    weights = dict(checkpoint.iter_weights(torch.float32))
    want = expected_weights(model)
    assert weights.keys() == want.keys()
    for name, tensor in want.items():
        # (w + 1) - 1 in fp32 for Gemma's norms: within an ulp of 1
        torch.testing.assert_close(weights[name], tensor, atol=2e-7, rtol=0)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(tokenizer), (n,), generator=g).tolist() for n in (6, 25)]
    model.generation_config.eos_token_id = None
    llm = LLM(str(path), dtype="float32", block_size=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.load_state_dict({n: weights[n] for n in want} | (
        {"lm_head.weight": weights["model.embed_tokens.weight"]}
        if config.tie_word_embeddings else {}), strict=False)
    hf = hf.float().eval()
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref

    # Converted once into the cached folder (as boxcar model pull does): the same tokens.
    folder = prepare_model(str(path))
    assert folder.is_dir() and load_checkpoint(str(path)).source == path.resolve()
    again = LLM(str(path), dtype="float32", block_size=8).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_gguf_name_maps_cover_the_families():
    # gguf's own maps (what llama.cpp writes) must land on names the engine's models have.
    from engine.checkpoint.gguf_loader import hf_tensor_name

    for arch, model_arch in (("gemma2", gguf.MODEL_ARCH.GEMMA2),
                             ("gemma3", gguf.MODEL_ARCH.GEMMA3), ("phi3", gguf.MODEL_ARCH.PHI3)):
        names = gguf.get_tensor_name_map(model_arch, 1)
        for hf in ("model.layers.0.post_attention_layernorm", "model.layers.0.mlp.down_proj",
                   "model.layers.0.input_layernorm"):
            gguf_name = names.get_name(hf)
            if gguf_name is not None:
                assert hf_tensor_name(f"{gguf_name}.weight", arch) == f"{hf}.weight"
