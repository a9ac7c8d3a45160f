"""Load a checkpoint's tokenizer and chat template: HF tokenizer files or a GGUF vocabulary."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored at ``path``: a folder with HF tokenizer files, or a ``.gguf`` file.

    A GGUF vocabulary (``tokenizer.ggml.*``) and its ``tokenizer.chat_template`` are converted by
    transformers' own GGUF tokenizer conversion, so encodings match ``AutoTokenizer`` exactly.
    """
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        source, kwargs = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                "pass a tokenizer folder or .gguf file separately"
            )
        source, kwargs = path, {}
    else:
        raise ValueError(
            f"tokenizer path {path} is neither a folder with tokenizer files nor a .gguf file"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(
            f"cannot load a tokenizer from {path}: {error}. A folder needs tokenizer.json or "
            "tokenizer_config.json (as written by save_pretrained); a .gguf file needs "
            "tokenizer.ggml.* metadata"
        ) from error
    return tokenizer
