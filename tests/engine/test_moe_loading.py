"""Bad MoE checkpoints fail at load with an error naming the tensor or the config field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.engine.moe_checkpoints import make_moe_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("qwen3-moe"), "qwen3_moe")


def _copy(source: Path, target: Path, edit_config=None, edit_weights=None) -> Path:
    target.mkdir()
    for file in source.iterdir():
        if file.name == "config.json" and edit_config is not None:
            config = json.loads(file.read_text())
            edit_config(config)
            (target / file.name).write_text(json.dumps(config))
        elif file.name == "model.safetensors" and edit_weights is not None:
            weights = load_file(file)
            edit_weights(weights)
            save_file(weights, target / file.name, metadata={"format": "pt"})
        else:
            (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize(("num_experts", "message"), [
    (4, r"expert [4-7], but the config says num_experts \(num_local_experts\) = 4"),
    (16, r"num_experts \(num_local_experts\)=16"),
])
def test_expert_count_mismatch_names_the_field(checkpoint, tmp_path, num_experts, message):
    bad = _copy(checkpoint, tmp_path / "bad",
                edit_config=lambda c: c.update(num_local_experts=num_experts))
    with pytest.raises(ValueError, match=message):
        LLM(str(bad), dtype="float32")


def test_top_k_above_the_expert_count_names_the_field(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "bad",
                edit_config=lambda c: c.update(num_experts_per_tok=9))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LLM(str(bad), dtype="float32")


def test_missing_expert_tensors_are_named(checkpoint, tmp_path):
    def drop_expert_3(weights):
        for name in [n for n in weights if ".mlp.experts.3." in n and "layers.0" in n]:
            del weights[name]

    bad = _copy(checkpoint, tmp_path / "bad", edit_weights=drop_expert_3)
    with pytest.raises(ValueError, match=r"missing 3 tensors.*layers\.0\.mlp\.experts\.3\."):
        LLM(str(bad), dtype="float32")


def test_unknown_quantisation_is_refused(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "bad", edit_config=lambda c: c.update(
        quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}))
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method 'bitsandbytes'"):
        LLM(str(bad), dtype="float32")


def test_mxfp4_is_refused_outside_gpt_oss(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "bad", edit_config=lambda c: c.update(
        quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ValueError, match=r"'mxfp4' is read for GptOssForCausalLM only"):
        LLM(str(bad), dtype="float32")


def test_stacked_experts_load_like_per_expert_ones(checkpoint, tmp_path):
    """transformers' in-memory layout (``experts.gate_up_proj [E, 2I, H]``, ``down_proj``)."""
    import torch

    def stack(weights):
        for layer in (0,):  # layer 1 is dense (mlp_only_layers)
            prefix = f"model.layers.{layer}.mlp.experts"
            count = len([n for n in weights if n.startswith(prefix) and "down_proj" in n])
            gate_up, down = [], []
            for e in range(count):
                gate_up.append(torch.cat((weights.pop(f"{prefix}.{e}.gate_proj.weight"),
                                          weights.pop(f"{prefix}.{e}.up_proj.weight"))))
                down.append(weights.pop(f"{prefix}.{e}.down_proj.weight"))
            weights[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            weights[f"{prefix}.down_proj"] = torch.stack(down)

    stacked = _copy(checkpoint, tmp_path / "stacked", edit_weights=stack)
    a = LLM(str(checkpoint), dtype="float32").engine.model_runner.model
    b = LLM(str(stacked), dtype="float32").engine.model_runner.model
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name
