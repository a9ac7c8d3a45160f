"""``bench.lora``: (a) base, (b) adapters mixed and (c) one at a time with merged weights, on a
tiny checkpoint; in fp32 (c)'s merged weights give (b)'s tokens."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from bench import lora
from tests.conftest import make_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bench-lora") / "base", "llama")


def test_a_side_by_side_run_reports_every_variant(base, capsys):
    result = lora.measure(str(base), lines=8, adapters=4, max_rank=16, prompt_tokens=12,
                          max_tokens=5, dtype="float32", threads=1)
    assert min(result.a_tps, result.b_tps, result.c_tps) > 0
    assert result.lora_share is not None and 0 < result.lora_share < 1
    assert result.agree == result.lines == 8  # merged fp32 weights decode as base + delta
    text = "\n".join(result.report(4))
    assert "(b)/(a) = " in text and "(b)/(c) = " in text and "agree on 8/8" in text


def test_merging_reaches_every_shard_and_refuses_a_missing_weight(base, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    adapter = tmp_path / "adapter"
    lora.write_adapter(adapter, config, "base", rank=4, seed=0)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weights = load_file(str(base / "model.safetensors"))
    names = sorted(weights)
    from safetensors.torch import save_file

    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({k: weights[k] for k in part}, str(sharded / f"model-{i}.safetensors"))
    (sharded / "config.json").write_text((base / "config.json").read_text())
    lora.write_merged(tmp_path / "merged", sharded, adapter)
    merged = {**load_file(str(tmp_path / "merged" / "model-0.safetensors")),
              **load_file(str(tmp_path / "merged" / "model-1.safetensors"))}
    changed = [k for k in names if not merged[k].equal(weights[k])]
    assert len(changed) == 7 * config.num_hidden_layers  # every projection of every layer

    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert meta["r"] == 4
    (sharded / "model-1.safetensors").unlink()
    with pytest.raises(ValueError, match="has no weights for"):
        lora.write_merged(tmp_path / "merged-again", sharded, adapter)
