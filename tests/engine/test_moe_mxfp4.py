"""gpt-oss's MXFP4 expert weights: quantised here as the checkpoints store them, dequantised by
the engine at load, and the model then exact against transformers on the dequantised weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine import LLM
from engine.models.mxfp4 import FP4_VALUES, dequantize_mxfp4, pair_mxfp4
from tests.engine.moe_checkpoints import make_moe_checkpoint
from tests.engine.test_correctness import greedy, hf_greedy, make_prompts

MAGNITUDES = torch.tensor(FP4_VALUES[:8])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., n]`` -> (blocks ``[..., n / 32, 16]`` uint8, scales ``[..., n / 32]`` uint8): per
    group of 32 the smallest power of two that brings the group's largest value under 6, each
    value rounded to the nearest E2M1 code, two codes a byte, the low nibble first."""
    groups = w.float().unflatten(-1, (-1, 32))  # [..., n / 32, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # [..., n / 32]
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)  # [..., 32] 0..7
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., n / 32, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_agrees_with_transformers_and_inverts_quantize():
    w = torch.randn(3, 8, 64) * torch.logspace(-3, 2, 8)[None, :, None]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dense.transpose(1, 2), convert_moe_packed_tensors(blocks, scales,
                                                                         dtype=torch.float32))
    # FP4 keeps a value within a quarter of its group's largest
    groups_max = w.abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
    assert ((dense - w).abs().unflatten(-1, (-1, 32)) <= groups_max / 4 + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(dense), torch.float32), dense)


def test_a_half_pair_is_named():
    blocks, scales = quantize_mxfp4(torch.randn(2, 4, 32))
    weights = [("model.layers.0.mlp.experts.down_proj_blocks", blocks)]
    with pytest.raises(ValueError, match="down_proj_blocks"):
        list(pair_mxfp4(weights, torch.float32))
    with pytest.raises(ValueError, match=r"experts\.down_proj: MXFP4 blocks"):
        list(pair_mxfp4([("model.layers.0.mlp.experts.down_proj_blocks", blocks[..., :8]),
                         ("model.layers.0.mlp.experts.down_proj_scales", scales)],
                        torch.float32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(reference folder with the dequantised experts in fp32, the same model in MXFP4)."""
    return write_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt-oss"), tie_router_rows=True)


def write_mxfp4_gpt_oss(folder: Path, **overrides) -> tuple[Path, Path]:
    """A random gpt-oss under ``folder``: (its experts dequantised, in fp32; the same model in
    MXFP4, as the released checkpoints store it)."""
    random = make_moe_checkpoint(folder / "random", "gpt_oss", **overrides)
    reference, quantized = folder / "reference", folder / "mxfp4"
    reference.mkdir()
    quantized.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(random, dtype=torch.float32)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # stored [experts, out, in]; the module holds [experts, in, out]
                blocks, scales = quantize_mxfp4(param.transpose(1, 2))
                param.copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    model.save_pretrained(reference)
    for file in random.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (reference / file.name).write_bytes(file.read_bytes())
            (quantized / file.name).write_bytes(file.read_bytes())
    weights = load_file(reference / "model.safetensors")
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del weights[name]
    save_file({**weights, **packed}, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((reference / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return reference, quantized


def test_mxfp4_checkpoint_loads_dequantised_and_exact(checkpoints):
    reference, quantized = checkpoints
    vocab = transformers.AutoConfig.from_pretrained(reference).vocab_size
    prompts = make_prompts(vocab)[:4]
    max_tokens = [12, 9, 15, 6]
    expected = hf_greedy(reference, prompts, max_tokens)
    # the torch backend: no packing, so the stacked expert weights stay readable below
    llm = LLM(str(quantized), dtype="float32", block_size=8, max_num_batched_tokens=32,
              attention_backend="torch")
    outs = llm.generate(prompts, [greedy(n) for n in max_tokens])
    assert [o.token_ids for o in outs] == expected
    # the experts in memory are the dequantised values, exactly
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    ours = llm.engine.model_runner.model.model.layers[1].mlp.experts
    hf_experts = hf.model.layers[1].mlp.experts
    gate_up = hf_experts.gate_up_proj.detach().transpose(1, 2)  # [experts, 2 * inter, hidden]
    assert torch.equal(ours.w13, torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1))
    assert torch.equal(ours.w2, hf_experts.down_proj.detach().transpose(1, 2))
