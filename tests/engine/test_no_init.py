"""engine.models.no_init: models built without random init, and without transformers' model code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.models.no_init import no_init_weights

REPO = Path(__file__).resolve().parents[2]


def test_initialisers_leave_tensors_alone_inside_and_work_again_after() -> None:
    ones = torch.ones(4, 4)
    with no_init_weights():
        for init in (nn.init.normal_, nn.init.uniform_, nn.init.zeros_, nn.init.trunc_normal_):
            assert init(ones) is ones
        nn.init.kaiming_uniform_(ones, a=5**0.5)
        assert torch.equal(ones, torch.ones(4, 4))
    nn.init.zeros_(ones)
    assert torch.equal(ones, torch.zeros(4, 4))


def test_originals_come_back_after_an_error() -> None:
    original = nn.init.normal_
    with pytest.raises(RuntimeError), no_init_weights():
        raise RuntimeError("boom")
    assert nn.init.normal_ is original


def test_a_model_built_and_loaded_equals_its_checkpoint_and_imports_no_model_code(
        tiny_model_dir: Path) -> None:
    """The engine's model, built under no_init_weights and loaded, holds the checkpoint's
    weights; transformers' modeling_utils (and torch._dynamo behind it, ~1 s) stay unimported."""
    code = f"""
import sys
import torch
from engine.config import EngineConfig
from engine.runner.model_runner import ModelRunner
from engine.checkpoint.loader import load_checkpoint, read_safetensors
checkpoint = load_checkpoint({str(tiny_model_dir)!r})
runner = ModelRunner(EngineConfig(model={str(tiny_model_dir)!r}, dtype="float32", device="cpu",
                                  num_kv_blocks=8, attention_backend="torch"),
                     checkpoint, max_position=64)
params = dict(runner.model.named_parameters())
for name, tensor in read_safetensors(checkpoint.path / "model.safetensors"):
    if name.endswith(("q_proj.weight", "gate_proj.weight")):
        fused = params[name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")]
        assert torch.equal(fused[: tensor.shape[0]], tensor), name
    elif name in params:
        assert torch.equal(params[name], tensor), name
print("HEAVY", [m for m in ("transformers.modeling_utils", "torch._dynamo") if m in sys.modules])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "HEAVY []" in out
