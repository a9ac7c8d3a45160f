"""The converted-GGUF cache: bit-identical weights, same config and tokenizer, invalidation,
the read-only fallback, and an engine that starts from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.checkpoint import gguf_cache
from engine.checkpoint.loader import load_checkpoint, prepare_model
from engine.checkpoint.model_config import ENGINE_FIELDS, ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_gguf import make_gguf, write_gguf
from tests.engine.test_loader import SAMPLE_TEXTS, random_model, tiny_config


@pytest.fixture(autouse=True)
def fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "fallback"
    monkeypatch.setenv("BOXCAR_CONVERTED_CACHE", str(folder))
    return folder


@pytest.mark.parametrize(
    ("kind", "qtype"), [("llama", Q.Q4_1), ("llama-tied", Q.Q4_0), ("qwen2", Q.F16)]
)
def test_converted_checkpoint_is_bit_identical(tmp_path: Path, kind: str, qtype: Q) -> None:
    path, _ = make_gguf(tmp_path, kind, qtype)
    direct = load_checkpoint(str(path))
    assert direct.path == path and gguf_cache.find(path) is None  # nothing converted yet

    converted = load_checkpoint(str(path), convert_gguf=True)
    folder = tmp_path / f".{path.name}.boxcar-v{gguf_cache.FORMAT_VERSION}"  # beside the model
    assert converted.path == folder and converted.source == path
    assert gguf_cache.find(path) == folder
    assert load_checkpoint(str(path)).path == folder  # later opens use it without asking

    # The folder's config, read by the engine's own reader, has the GGUF config's values for
    # every field the engine reads; rebuilt by transformers it is the same config.
    assert isinstance(converted.config, ModelConfig)
    for field in ENGINE_FIELDS:
        assert getattr(converted.config, field, None) == getattr(direct.config, field, None), field
    ignore = {"transformers_version", "dtype", "torch_dtype", "_name_or_path"}
    ours = {k: v for k, v in converted.config.to_transformers().to_dict().items()
            if k not in ignore}
    theirs = {k: v for k, v in direct.config.to_dict().items() if k not in ignore}
    assert ours == theirs
    for dtype in (torch.float32, torch.bfloat16):
        expected = dict(direct.iter_weights(dtype))
        got = dict(converted.iter_weights(dtype))
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name

    reference, tokenizer = direct.load_tokenizer(), converted.load_tokenizer()
    assert tokenizer.chat_template == reference.chat_template
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference.bos_token, reference.eos_token)
    for text in SAMPLE_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text)
    conversation = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt=True) == (
        reference.apply_chat_template(conversation, add_generation_prompt=True)
    )


def test_changed_gguf_invalidates_the_conversion(tmp_path: Path) -> None:
    path, _ = make_gguf(tmp_path, "llama", Q.F32)
    folder = prepare_model(str(path))
    assert gguf_cache.find(path) == folder
    old_weights = dict(load_checkpoint(str(path)).iter_weights(torch.float32))

    config = load_checkpoint(str(path)).config
    write_gguf(path, random_model(tiny_config("llama", vocab_size=config.vocab_size), seed=1),
               "llama", Q.F32)  # new random weights, same file name
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # whatever the clock did
    assert gguf_cache.find(path) is None
    assert load_checkpoint(str(path)).path == path  # stale: back to the GGUF file
    assert prepare_model(str(path)) == folder  # rebuilt in place
    new_weights = dict(load_checkpoint(str(path)).iter_weights(torch.float32))
    direct = dict(load_checkpoint(str(path)).iter_weights(torch.float32))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(new_weights[name], old_weights[name])
    assert torch.equal(new_weights[name], direct[name])
    assert not [p for p in tmp_path.iterdir() if ".part-" in p.name or ".stale-" in p.name]


def test_key_records_the_file_and_libraries(tmp_path: Path) -> None:
    path, _ = make_gguf(tmp_path, "llama", Q.F32)
    folder = prepare_model(str(path))
    key = json.loads((folder / gguf_cache.KEY_FILE).read_text())
    assert key["gguf"] == str(path.resolve()) and key["size"] == path.stat().st_size
    key["libraries"]["transformers"] = "0.0.0"  # converted by another transformers
    (folder / gguf_cache.KEY_FILE).write_text(json.dumps(key))
    assert gguf_cache.find(path) is None


def test_read_only_model_folder_falls_back_to_the_user_cache(
    tmp_path: Path, fallback: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    path, _ = make_gguf(models, "llama", Q.Q8_0)
    write = gguf_cache._write

    def read_only_beside_model(folder: Path, *args: object) -> None:
        # tests run as root, which chmod cannot stop: fail as a read-only mount would
        if folder.parent == models:
            raise PermissionError(13, "Read-only file system", str(folder))
        write(folder, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_cache, "_write", read_only_beside_model)
    folder = prepare_model(str(path))
    assert folder.parent == fallback and not any(p.name.startswith(".") for p in models.iterdir())
    monkeypatch.setattr(gguf_cache, "_write", write)
    assert gguf_cache.find(path) == folder
    direct = dict(load_checkpoint(str(path), convert_gguf=False).iter_weights(torch.float32))
    assert sorted(direct) == sorted(dict(load_checkpoint(str(path)).iter_weights(torch.float32)))


def test_nowhere_writable_reads_the_gguf_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = make_gguf(tmp_path, "llama", Q.F32)

    def nowhere(folder: Path, *args: object) -> None:
        raise PermissionError(13, "Read-only file system", str(folder))

    monkeypatch.setattr(gguf_cache, "_write", nowhere)
    checkpoint = load_checkpoint(str(path), convert_gguf=True)
    assert checkpoint.path == path and checkpoint.source is None
    assert len(dict(checkpoint.iter_weights(torch.float32))) > 0


def test_engine_starts_from_the_conversion_with_the_same_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = make_gguf(tmp_path, "llama", Q.Q4_1)
    prompt = [1, 5, 9, 3, 7]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def generate() -> tuple[str, list[int]]:
        engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=16, block_size=4))
        engine.add_request("r", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens = output.token_ids
        return engine.model_name, tokens

    write = gguf_cache._write

    def nowhere(folder: Path, *args: object) -> None:
        raise PermissionError(13, "Read-only file system", str(folder))

    monkeypatch.setattr(gguf_cache, "_write", nowhere)
    direct = generate()  # straight from the GGUF file
    assert gguf_cache.find(path) is None
    monkeypatch.setattr(gguf_cache, "_write", write)
    converting = generate()
    assert gguf_cache.find(path) is not None
    cached = generate()
    assert direct == converting == cached
    assert direct[0] == path.stem and len(direct[1]) == 8
