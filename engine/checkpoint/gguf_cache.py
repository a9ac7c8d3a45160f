"""A GGUF file converted once to an HF folder (config.json, tokenizer files, model.safetensors).

Parsing a GGUF file's metadata and building its tokenizer with transformers cost seconds at every
start; the converted folder loads in a fraction of that. The weights are stored as the GGUF
loader yields them, before any cast: a quantized 2-D weight as its ggml rows (uint8
``[out_features, row_bytes]``, its format, shape and GGUF name in the file's metadata under
``QUANTIZED_KEY``), the rest dense, as gguf dequantizes them. So the folder is about the GGUF's
size (Gemma 3 270M Q4_K_M: 253 MB, where fp32 copies took 1.1 GB), the engine keeps the rows
quantized without converting anything, and dequantizing them gives bit-identical tensors to the
GGUF path (both go through ``ggml_rows.materialize``).

Where: beside the model (``<dir>/.<file>.boxcar/``), or, when that folder is read-only, under
``$BOXCAR_CONVERTED_CACHE`` (default ``~/.cache/boxcar/converted/<hash of the GGUF's path>/``).
Validity: ``boxcar-key.json`` records the GGUF's resolved path, size and mtime and the versions of
the converting code and libraries; any difference means the folder is stale and is rebuilt. A
folder is built under a temporary name and renamed into place, and its key is written last, so a
reader sees a whole conversion or none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# 2: tokenizer_config.json lists the added tokens (``_write_added_tokens``)
# 3: quantized weights stored as their ggml rows (``QUANTIZED_KEY``)
FORMAT_VERSION = 3
KEY_FILE = "boxcar-key.json"
WEIGHTS_FILE = "model.safetensors"
# The weights file's metadata key: JSON {hf_name: [format, out_features, in_features, gguf_name]}
QUANTIZED_KEY = "boxcar.ggml_rows"


@dataclass(frozen=True)
class QuantizedEntry:
    """A stored tensor that is ggml rows: uint8 ``[out_features, row_bytes]`` in ``fmt``."""

    fmt: str
    out_features: int
    in_features: int
    gguf_name: str


def quantized_entries(metadata: dict[str, str]) -> dict[str, QuantizedEntry]:
    """The ggml-row tensors a weights file's metadata lists ({} for any other file)."""
    listed = metadata.get(QUANTIZED_KEY)
    if listed is None:
        return {}
    try:
        return {name: QuantizedEntry(str(fmt), int(out), int(inp), str(gguf_name))
                for name, (fmt, out, inp, gguf_name) in json.loads(listed).items()}
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(f"the weights' {QUANTIZED_KEY} metadata is corrupt: {error}") from error


def fallback_root() -> Path:
    """``$BOXCAR_CONVERTED_CACHE``, else ``~/.cache/boxcar/converted``."""
    configured = os.environ.get("BOXCAR_CONVERTED_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache/boxcar/converted"


def candidate_dirs(gguf: Path) -> list[Path]:
    """Where the conversion of ``gguf`` may live, in order of preference.

    The names carry the format version, so releases of two formats side by side (a rolling
    upgrade) each keep their own folder instead of reconverting each other's at every start."""
    gguf = gguf.resolve()
    path_hash = hashlib.sha256(str(gguf).encode()).hexdigest()[:16]
    suffix = f"boxcar-v{FORMAT_VERSION}"
    return [gguf.parent / f".{gguf.name}.{suffix}",
            fallback_root() / f"{gguf.stem}-{path_hash}-v{FORMAT_VERSION}"]


def cache_key(gguf: Path) -> dict[str, Any]:
    """What the conversion depends on; a stored key equal to this one means the folder is fresh."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    return {
        "format": FORMAT_VERSION,
        "gguf": str(gguf),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "libraries": {name: _version(name) for name in ("gguf", "transformers", "tokenizers")},
    }


def find(gguf: Path) -> Path | None:
    """The fresh converted folder of ``gguf``, or None."""
    try:
        key = cache_key(gguf)
    except OSError:
        return None
    for folder in candidate_dirs(gguf):
        if _stored_key(folder) == key and (folder / WEIGHTS_FILE).is_file():
            return folder
    return None


def _stored_key(folder: Path) -> Any:
    try:
        return json.loads((folder / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None


def convert(gguf: Path, *, quiet: bool = False) -> Path | None:
    """Convert ``gguf`` into the first writable candidate folder and return it.

    None when no candidate can be written (the caller reads the GGUF file directly). Errors in the
    file itself (unsupported architecture, unknown tensors) raise ValueError as the GGUF path does.
    """
    from engine.checkpoint.ggml_rows import GGMLRows
    from engine.checkpoint.gguf_loader import iter_gguf_tensors, load_gguf_config
    from engine.checkpoint.tokenizer import load_tokenizer

    start = time.monotonic()
    key = cache_key(gguf)
    if not quiet:
        print(f"[boxcar] converting {gguf.name} to a cached folder (once; later starts skip "
              "the GGUF parse)...", file=sys.stderr, flush=True)
    config = load_gguf_config(gguf)
    tokenizer = load_tokenizer(gguf)
    weights, quantized = {}, {}
    for name, tensor in iter_gguf_tensors(gguf, config):
        if isinstance(tensor, GGMLRows):
            quantized[name] = [tensor.fmt, tensor.out_features, tensor.in_features, tensor.name]
            tensor = tensor.data
        weights[name] = tensor
    metadata = {"format": "pt", QUANTIZED_KEY: json.dumps(quantized)}
    for folder in candidate_dirs(gguf):
        try:
            _write(folder, key, config, tokenizer, weights, metadata)
        except OSError as exc:
            log.info("cannot cache the conversion of %s in %s: %s", gguf, folder, exc)
            continue
        if not quiet:
            print(f"[boxcar] converted {gguf.name} to {folder} in "
                  f"{time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        return folder
    log.warning("no writable place to cache the conversion of %s; it is re-read at each start",
                gguf)
    return None


def _write(
    folder: Path, key: dict[str, Any], config: PretrainedConfig, tokenizer: Any,
    weights: dict[str, Any], metadata: dict[str, str],
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.part-"))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _write_added_tokens(staging / "tokenizer_config.json", tokenizer)
        save_file(weights, str(staging / WEIGHTS_FILE), metadata=metadata)
        (staging / KEY_FILE).write_text(json.dumps(key, indent=1))
        for file in staging.iterdir():
            file.chmod(0o644)  # some writers make private files; the cache is shared
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like the model
        if folder.exists():  # stale: move it aside first, since rename does not replace a folder
            stale = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.stale-"))
            os.replace(folder, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(staging, folder)
        except OSError:
            if _stored_key(folder) != key:  # not another process's identical conversion
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_added_tokens(tokenizer_config: Path, tokenizer: Any) -> None:
    """Record the added (special) tokens in tokenizer_config.json as ``added_tokens_decoder``.

    transformers 5 leaves them out of the file (they are in tokenizer.json), and loading a folder
    without them parses the whole tokenizer.json in Python to find them again: ~0.3 s of every
    start for the default model's 3.5 MB file. With them, loading reads tokenizer.json once, in
    Rust. The entries are the tokens' own fields, what transformers 4 wrote and 5 still reads."""
    config = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(index): {
            "content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special,
        }
        for index, token in sorted(tokenizer.added_tokens_decoder.items())
    }
    tokenizer_config.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                encoding="utf-8")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
