"""LoRA bad input: every broken adapter is a clear error naming it, at start or for its own
request, and nothing else is lost; the scheduler's adapter count and the adapter-keyed block
hash, without a model."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import LoRAError
from engine.outputs import ModelRunnerOutput
from tests.conftest import make_checkpoint
from tests.engine.test_lora import save_adapter
from tests.engine.test_scheduler import make_request, make_scheduler

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-input")
    path = make_checkpoint(root / "base", "llama")
    adapter = save_adapter(path, root / "good", 0, r=4, lora_alpha=8,
                           target_modules=["q_proj", "down_proj"])
    return root, path, adapter


def broken_copy(root, adapter, name: str):
    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(adapter, folder)
    return folder


def edit_config(folder, **changes) -> None:
    file = folder / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


def start(path, **modules) -> LLM:
    return LLM(str(path), dtype="float32",
               lora_modules=[f"{n}={p}" for n, p in modules.items()])


def test_bad_adapters_fail_the_start_naming_them(base_and_adapter, tmp_path):
    root, path, adapter = base_and_adapter
    cases = {}
    cases["missing"] = (tmp_path / "nowhere", "is not a folder")
    folder = broken_copy(root, adapter, "no-config")
    (folder / "adapter_config.json").unlink()
    cases["no-config"] = (folder, "adapter_config.json is missing")
    folder = broken_copy(root, adapter, "bad-json")
    (folder / "adapter_config.json").write_text("{not json")
    cases["bad-json"] = (folder, "not valid JSON")
    folder = broken_copy(root, adapter, "no-weights")
    (folder / "adapter_model.safetensors").unlink()
    cases["no-weights"] = (folder, "adapter_model.safetensors is missing")
    folder = broken_copy(root, adapter, "corrupt")
    (folder / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    cases["corrupt"] = (folder, "not a readable safetensors file")
    folder = broken_copy(root, adapter, "rank")
    edit_config(folder, r=128)
    cases["rank"] = (folder, "above max_lora_rank=64")
    folder = broken_copy(root, adapter, "other-base")
    edit_config(folder, base_model_name_or_path="meta-llama/Llama-3.1-70B")
    cases["other-base"] = (folder, "trained on 'meta-llama/Llama-3.1-70B'")
    folder = broken_copy(root, adapter, "lacking")
    edit_config(folder, target_modules=["q_proj", "c_attn"])
    cases["lacking"] = (folder, r"target modules \['c_attn'\] are not in the served model")
    folder = broken_copy(root, adapter, "lacking-tensor")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "query_key_value"): v for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    cases["lacking-tensor"] = (folder, r"\['query_key_value'\] are not in the served model")
    folder = broken_copy(root, adapter, "dora")
    edit_config(folder, use_dora=True)
    cases["dora"] = (folder, "DoRA is not implemented")
    for name, (folder, message) in cases.items():
        with pytest.raises(LoRAError, match=message) as info:
            start(path, **{name: str(folder)})
        assert f"LoRA adapter {name!r}" in str(info.value)
        assert info.value.adapter == name


def test_adapter_of_another_shape_fails_the_start(base_and_adapter):
    root, path, _ = base_and_adapter
    other = make_checkpoint(root / "wider", "llama", hidden_size=96)
    folder = save_adapter(other, root / "wide-adapter", 0, r=4, target_modules=["q_proj"])
    edit_config(root / "wide-adapter", base_model_name_or_path=None)
    with pytest.raises(LoRAError, match="do not fit the served model"):
        start(path, wide=folder)


def test_config_checks_lora_options():
    for kwargs, message in (
        ({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
        ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
        ({"lora_modules": ("a",)}, "NAME=PATH"), ({"lora_modules": ("a=x", "a=y")}, "'a'"),
        ({"lora_modules": "a=x"}, "list of NAME=PATH"),
    ):
        with pytest.raises(ValueError, match=message):
            EngineConfig(model="m", **kwargs)


def test_request_errors_name_the_adapter_and_lose_nothing(base_and_adapter):
    root, path, adapter = base_and_adapter
    second = broken_copy(root, adapter, "second")
    llm = LLM(str(path), dtype="float32", max_loras=1, max_cpu_loras=1,
              lora_modules=[f"good={adapter}", f"second={second}"])
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("base", [5, 6, 7], params)
    engine.add_request("good", [5, 6, 7], params, lora_name="good")
    with pytest.raises(LoRAError, match="'nope': not registered; registered adapters: "
                                        "good, second"):
        engine.add_request("unknown", [5, 6, 7], params, lora_name="nope")
    # 'second' was dropped from the one-adapter LRU when 'good' was read; break it on disk
    (second / "adapter_model.safetensors").write_bytes(b"broken")
    with pytest.raises(LoRAError, match="'second'.*not a readable safetensors"):
        engine.add_request("second", [5, 6, 7], params, lora_name="second")
    with pytest.raises(LoRAError, match="'third'.*is not a folder"):
        engine.add_lora("third", str(root / "nowhere"))
    engine.add_lora("third", adapter)  # registered while the engine runs
    assert engine.lora_names == ["good", "second", "third"]
    engine.add_request("third", [5, 6, 7], params, lora_name="third")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == ["base", "good", "third"]
    assert done["third"].outputs[0].token_ids == done["good"].outputs[0].token_ids
    assert all(len(o.outputs[0].token_ids) == 4 for o in done.values())
    plain = LLM(str(path), dtype="float32")
    with pytest.raises(LoRAError, match="LoRA is off"):
        plain.engine.add_request("x", [5, 6], params, lora_name="good")
    with pytest.raises(LoRAError, match="LoRA is off"):
        plain.engine.add_lora("good", adapter)


def test_scheduler_counts_adapters_a_step_like_seats():
    sched = make_scheduler(max_loras=2)
    loras = ["a", "b", "c", None, "a", "c"]
    for i, lora in enumerate(loras):
        request = make_request(f"r{i}", [1, 2, 3], max_tokens=3)
        request.lora_name = lora
        sched.add_request(request)
    out = sched.schedule()
    # r2 ("c") would be a third adapter: it waits; base and "a" behind it still go
    assert [s.request_id for s in out.scheduled] == ["r0", "r1", "r3", "r4"]
    assert sched.num_lora_holds == 2
    finished: list = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        names = {sched.requests[s.request_id].lora_name for s in out.scheduled}
        assert len(names - {None}) <= 2
        sampled = {s.request_id: 1 for s in out.scheduled if s.sample}
        finished += sched.update_from_output(out, ModelRunnerOutput(sampled))[1]
    assert len(finished) == len(loras)


def test_block_hash_is_keyed_by_adapter():
    sched = make_scheduler()
    hashes = []
    for i, lora in enumerate([None, "a", "b", "a"]):
        request = make_request(f"r{i}", list(range(1, 10)))
        request.lora_name = lora
        sched.kv.get_computed_blocks(request)
        hashes.append(request.block_hashes)
    assert hashes[1] == hashes[3]
    assert len({tuple(h) for h in hashes}) == 3
    assert all(len(h) == 2 for h in hashes)
