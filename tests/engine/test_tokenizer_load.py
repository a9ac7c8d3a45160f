"""Loading a converted folder's tokenizer without AutoTokenizer and without parsing tokenizer.json
in Python: the same tokenizer AutoTokenizer gives, for the folders where that holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers.tokenization_utils_base as tokenization_base
from gguf import GGMLQuantizationType as Q
from transformers import AutoTokenizer
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.tokenizer import (
    PLAIN_BACKEND_CLASSES,
    PLAIN_BACKEND_MODEL_TYPES,
    load_tokenizer,
    plain_backend_folder,
)
from tests.engine.test_gguf import make_gguf
from tests.engine.test_loader import SAMPLE_TEXTS


@pytest.fixture(autouse=True)
def fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_CONVERTED_CACHE", str(tmp_path / "fallback"))


def converted_folder(tmp_path: Path, kind: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path, _ = make_gguf(tmp_path, kind, Q.F16)
    return load_checkpoint(str(path), convert_gguf=True).path


def assert_same_tokenizer(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    assert ours.added_tokens_decoder == theirs.added_tokens_decoder
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.chat_template == theirs.chat_template
    for text in (*SAMPLE_TEXTS, "<|im_start|>user\nhi<|im_end|>"):
        ids = theirs(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_plain_backend_model_types_have_no_tokenizer_class_of_their_own() -> None:
    # What plain_backend_folder relies on; a transformers upgrade that maps one fails here.
    for model_type in PLAIN_BACKEND_MODEL_TYPES:
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, *PLAIN_BACKEND_CLASSES)


def test_converted_llama_folder_loads_as_autotokenizer_does_without_parsing_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = converted_folder(tmp_path, "llama")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]  # written by the conversion (format 2)
    assert plain_backend_folder(folder)

    parsed: list[str] = []
    json_load = tokenization_base.json.load

    def recording_load(handle: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(handle.name).name)
        return json_load(handle, *args, **kwargs)

    monkeypatch.setattr(tokenization_base.json, "load", recording_load)
    ours = load_tokenizer(folder)
    assert "tokenizer.json" not in parsed  # read once, by the Rust library
    monkeypatch.undo()
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(str(folder)))
    # and the tokenizer of the GGUF file it came from
    gguf = next(tmp_path.glob("*.gguf"))
    assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name))


def test_folders_autotokenizer_treats_otherwise_still_go_through_it(tmp_path: Path) -> None:
    # Qwen2: AutoTokenizer picks Qwen2Tokenizer whatever the folder's tokenizer_config says.
    qwen = converted_folder(tmp_path / "q", "qwen2")
    assert not plain_backend_folder(qwen)
    assert_same_tokenizer(load_tokenizer(qwen), AutoTokenizer.from_pretrained(str(qwen)))
    # A Llama folder whose tokenizer_config names a class of its own, or an auto_map.
    llama = converted_folder(tmp_path / "l", "llama")
    config_file = llama / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for change in ({"tokenizer_class": "LlamaTokenizer"}, {"auto_map": {"AutoTokenizer": "x.Y"}}):
        config_file.write_text(json.dumps({**config, **change}))
        assert not plain_backend_folder(llama)
    config_file.write_text(json.dumps(config))
    (llama / "config.json").unlink()
    assert not plain_backend_folder(llama)
