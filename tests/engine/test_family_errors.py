"""A config the engine cannot run exactly is refused at load, naming the field."""

from __future__ import annotations

import json

import pytest

from engine import LLM
from tests.conftest import make_checkpoint


def _edit(folder, **fields):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", sliding_window=8,
                           num_hidden_layers=2)


def _copy(src, tmp_path):
    import shutil

    return shutil.copytree(src, tmp_path / "model")


@pytest.mark.parametrize(("fields", "match"), [
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
     "FalconForCausalLM, which is not supported"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type 'mrope'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs the field 'factor'"),
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"hidden_act": "relu2"}, "hidden_act='relu2'"),
    ({"mlp_bias": True}, "mlp_bias"),
])
def test_llama_refuses(llama_dir, tmp_path, fields, match):
    folder = _edit(_copy(llama_dir, tmp_path), **fields)
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), dtype="float32")


@pytest.mark.parametrize(("fields", "match"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not part of Gemma 3"),
    ({"sliding_window": 0}, "sliding_window must be"),
    ({"sliding_window": 2.5}, "sliding_window"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ({"hidden_activation": "gelu_new"}, "hidden_activation='gelu_new'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_gemma3_refuses(gemma3_dir, tmp_path, fields, match):
    folder = _edit(_copy(gemma3_dir, tmp_path), **fields)
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), dtype="float32")
