"""Load a checkpoint's tokenizer and chat template: HF tokenizer files or a GGUF vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Model types whose folders ``AutoTokenizer`` loads with the tokenizer_config.json's own class when
# that is the plain tokenizers backend: transformers maps no special tokenizer class to them
# (``TOKENIZER_MAPPING_NAMES``; tests/engine/test_tokenizer_load.py checks that it still does).
PLAIN_BACKEND_MODEL_TYPES = ("llama", "mistral")
PLAIN_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def plain_backend_folder(path: Path) -> bool:
    """True when ``AutoTokenizer`` would load the folder ``path`` as the plain tokenizers backend
    (``PreTrainedTokenizerFast``, which transformers 5 calls ``TokenizersBackend``), so loading
    it with that class directly gives the same tokenizer without ``AutoTokenizer``'s imports
    (~0.4 s: it scans every model folder of transformers): a tokenizer.json, a
    tokenizer_config.json naming that class and no ``auto_map``, and a config.json of a model
    type transformers gives no tokenizer class of its own. What ``boxcar`` converts a Llama
    GGUF file to (``engine.checkpoint.gguf_cache``) is such a folder."""
    if not (path / "tokenizer.json").is_file():
        return False
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(tokenizer_config, dict) and isinstance(model_config, dict)
        and tokenizer_config.get("tokenizer_class") in PLAIN_BACKEND_CLASSES
        and "auto_map" not in tokenizer_config
        and model_config.get("model_type") in PLAIN_BACKEND_MODEL_TYPES
    )


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored at ``path``: a folder with HF tokenizer files, or a ``.gguf`` file.

    A GGUF vocabulary (``tokenizer.ggml.*``) and its ``tokenizer.chat_template`` are converted by
    transformers' own GGUF tokenizer conversion, so encodings match ``AutoTokenizer`` exactly.
    """
    path = Path(path).expanduser()
    kwargs: dict[str, Any] = {}
    if path.is_file() and path.suffix == ".gguf":
        source, kwargs = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                "pass a tokenizer folder or .gguf file separately"
            )
        source = path
    else:
        raise ValueError(
            f"tokenizer path {path} is neither a folder with tokenizer files nor a .gguf file"
        )
    if not kwargs and plain_backend_folder(source):
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class  # type: ignore[assignment]
    try:
        tokenizer = tokenizer_class.from_pretrained(str(source), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(
            f"cannot load a tokenizer from {path}: {error}. A folder needs tokenizer.json or "
            "tokenizer_config.json (as written by save_pretrained); a .gguf file needs "
            "tokenizer.ggml.* metadata"
        ) from error
    return tokenizer


def special_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of the special token ``token`` (``<|channel|>``) in the vocabulary, else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    # an unknown token comes back as None or as the unknown token's id
    if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
        return None
    return token_id


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str,
             max_length: int | None = None) -> list[int]:
    """``text``'s token ids with the tokenizer's own special tokens; ``max_length``: cut there."""
    if max_length is None:
        return list(tokenizer(text).input_ids)
    return list(tokenizer(text, truncation=True, max_length=max_length).input_ids)
