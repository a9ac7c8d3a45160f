"""Turn a model reference (HF folder, .gguf file or cached name) into config, weights and tokenizer.

Weights come out under the Hugging Face parameter names (``model.layers.3.self_attn.q_proj.weight``)
whatever the source, so a model only has to know one naming. ``lm_head.weight`` is left out when
the embeddings are tied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, overload

import torch

from engine.checkpoint import gguf_cache, hf_quant, model_cache
from engine.checkpoint.ggml_rows import ggml_rows, materialize
from engine.checkpoint.model_config import read_model_config
from engine.checkpoint.tokenizer import TOKENIZER_FILES, load_tokenizer
from engine.models.registry import ARCHITECTURE_OF_MODEL_TYPE, MODEL_REGISTRY

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.layers.quantized import PackedWeight

# transformers (its config classes) and gguf are imported only where a start needs them: a GGUF
# file without a converted folder, or a config.json ``read_model_config`` leaves to transformers.

# SmolLM and SmolLM2 are LlamaForCausalLM; Gemma 3's text-only checkpoints Gemma3ForCausalLM.
SUPPORTED_ARCHITECTURES = (
    *MODEL_REGISTRY,
    # embedding models (engine/models/pooling_registry.py)
    "BertModel",
    "LlamaModel",
    "MistralModel",
    "Qwen2Model",
    "Qwen3Model",
    "BertForSequenceClassification",  # a cross-encoder (/v1/score, /v1/rerank)
)
_ARCHITECTURE_OF_MODEL_TYPE = {**ARCHITECTURE_OF_MODEL_TYPE, "bert": "BertModel"}


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,  # FP8 checkpoints
}


@dataclass(frozen=True)
class Checkpoint:
    """A model on disk: its HF config, where it lives, and where its tokenizer lives.

    ``config`` has the Hugging Face field names: an ``engine.checkpoint.model_config.ModelConfig``
    for a folder of a known family, else a transformers config (a GGUF file read directly, or a
    config.json ``read_model_config`` leaves to transformers)."""

    config: Any
    path: Path  # an HF folder or a .gguf file
    tokenizer_path: Path | None = None  # None: the tokenizer stored with the model
    source: Path | None = None  # the .gguf file that ``path``, its converted folder, came from

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf" and self.path.is_file()

    @property
    def hf_quantization(self) -> hf_quant.HFQuantization | None:
        """An HF folder's AWQ / GPTQ / FP8 scheme (``engine.checkpoint.hf_quant``; checked when
        the checkpoint was opened), None for any other checkpoint."""
        config = None if self.is_gguf else getattr(self.config, "quantization_config", None)
        if not isinstance(config, dict) or config.get("quant_method") not in hf_quant.METHODS:
            return None
        return hf_quant.parse_quantization(config)

    @overload
    def iter_weights(
        self, dtype: torch.dtype, destination: Destination | None = None, *,
        quantized: Literal[False] = False,
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    @overload
    def iter_weights(
        self, dtype: torch.dtype, destination: Destination | None = None, *, quantized: bool,
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]: ...

    def iter_weights(
        self, dtype: torch.dtype, destination: Destination | None = None, *,
        quantized: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield ``(hf_name, tensor)`` for every weight, as CPU tensors cast to ``dtype``.

        ``destination``: see ``read_safetensors``; a tensor stored in ``dtype`` already is read
        straight into the memory it names (the model's own parameter), and yielded as that.
        ``quantized``: a GGUF's quantized weights (``quantized_types``) come as ``PackedWeight``
        (``QuantWeight``), kept in their blocks; without it they are dequantized. An AWQ / GPTQ
        / FP8 folder's quantized modules (``hf_quantization``) come as one ``<module>.weight``
        each, packed (``Int4Weight`` / ``Fp8Weight``) or dequantized the same way."""
        if self.is_gguf:
            from engine.checkpoint.gguf_loader import iter_gguf_weights

            yield from iter_gguf_weights(self.path, self.config, dtype, quantized=quantized)
            return
        tied = bool(getattr(self.config, "tie_word_embeddings", False))

        def same_dtype_destination(name: str, shape: tuple[int, ...],
                                   stored: torch.dtype) -> torch.Tensor | None:
            return destination(name, shape, stored) if stored == dtype and destination else None

        quant = self.hf_quantization
        if quant is not None:  # AWQ / GPTQ / FP8: each module's stored tensors become a weight
            for name, weight in hf_quant.load_quantized(self._stored_weights(
                    same_dtype_destination, tied), quant, dtype, keep=quantized):
                cast = isinstance(weight, torch.Tensor) and weight.is_floating_point()
                yield name, weight.to(dtype) if cast else weight
            return
        for file in safetensors_files(self.path):
            rows = gguf_cache.quantized_entries(safetensors_metadata(file))
            for name, tensor in read_safetensors(file, same_dtype_destination):
                if _skipped(name, tied):
                    continue
                if name in rows:  # a GGUF's quantized weight, in the converted cache
                    entry = rows[name]
                    yield name, materialize(ggml_rows(entry.gguf_name, entry.fmt, tensor, (
                        entry.out_features, entry.in_features)), dtype, quantized)
                    continue
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    def _stored_weights(self, destination: Destination,
                        tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """An HF folder's tensors as stored (not cast), less the ones ``iter_weights`` skips."""
        for file in safetensors_files(self.path):
            for name, tensor in read_safetensors(file, destination):
                if not _skipped(name, tied):
                    yield name, tensor

    def quantized_types(self) -> dict[str, list[str]]:
        """The block types (``"Q4_K"``) of the weights ``iter_weights(quantized=True)`` keeps
        packed -> those tensors' GGUF names; {} for a checkpoint without any."""
        if self.is_gguf:
            from engine.checkpoint.gguf_loader import quantized_types

            return quantized_types(self.path)
        types: dict[str, list[str]] = {}
        for file in safetensors_files(self.path):
            for entry in gguf_cache.quantized_entries(safetensors_metadata(file)).values():
                types.setdefault(entry.fmt, []).append(entry.gguf_name)
        return types

    def weight_bytes(self, dtype: torch.dtype, *, quantized: bool) -> int:
        """The bytes the weights take in memory, loaded in ``dtype`` and, with ``quantized``,
        the quantized ones kept in their blocks (a tied output layer is the embedding: counted
        once), read from the files' headers."""
        element = torch.empty((), dtype=dtype).element_size()
        if self.is_gguf:
            from engine.checkpoint.gguf_loader import open_gguf, quantized_types

            kept = {n for names in quantized_types(self.path).values() for n in names}
            return sum(int(t.n_bytes) if quantized and t.name in kept
                       else int(t.n_elements) * element for t in open_gguf(self.path).tensors)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        quant = self.hf_quantization
        total = 0
        for file in safetensors_files(self.path):
            rows = gguf_cache.quantized_entries(safetensors_metadata(file))
            for name, entry in safetensors_header(file).items():
                if tied and name == "lm_head.weight":
                    continue
                start, end = entry["data_offsets"]
                resident = None if quant is None else hf_quant.resident_bytes(
                    quant, name, entry, element, keep=quantized)
                if resident is not None:  # a part of an AWQ / GPTQ / FP8 module
                    total += resident
                elif name in rows and not quantized:
                    total += rows[name].out_features * rows[name].in_features * element
                elif name in rows or entry["dtype"] not in _FLOAT_DTYPES:
                    total += end - start
                else:
                    total += math.prod(entry["shape"]) * element
        return total

    def generation_eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids ``generation_config.json`` adds (gpt-oss stops at
        ``<|return|>`` and ``<|call|>``; Llama 3 instruct at ``<|eot_id|>``), as transformers'
        ``generate`` stops at them; [] without the file or the field."""
        file = self.path / "generation_config.json" if self.path.is_dir() else None
        if file is None or not file.is_file():
            return []
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            return []
        values = value if isinstance(value, list) else [value]
        return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, with ``chat_template`` set when the checkpoint has one."""
        return load_tokenizer(self.tokenizer_path or self.path)


def load_checkpoint(
    model: str, tokenizer: str | None = None, *, convert_gguf: bool = False
) -> Checkpoint:
    """Open ``model``: an HF folder, a .gguf file, a folder with one .gguf, or a cached model name.

    ``tokenizer`` optionally names a different tokenizer the same ways. Problems that can be found
    without reading the weights (missing files, no config, unsupported architecture) raise here.
    A GGUF file with a fresh converted folder (``engine.checkpoint.gguf_cache``) is read from that
    folder; with ``convert_gguf`` one without is converted first (it reads all the weights), so
    the next start is fast.
    """
    path = _locate(model, "model")
    source = None
    if path.is_file():
        converted = gguf_cache.find(path)
        if converted is None and convert_gguf:
            converted = gguf_cache.convert(path)
        if converted is not None:
            path, source = converted, path
    if path.is_file():
        from engine.checkpoint.gguf_loader import load_gguf_config

        config = load_gguf_config(path)
    else:
        config = _load_hf_config(path)
        safetensors_files(path)  # fail now, not at the first weight
    tokenizer_path = _locate_tokenizer(tokenizer) if tokenizer else None
    if tokenizer_path is not None and tokenizer_path.is_file():
        tokenizer_path = gguf_cache.find(tokenizer_path) or tokenizer_path
    return Checkpoint(config=config, path=path, tokenizer_path=tokenizer_path, source=source)


def prepare_model(model: str) -> Path:
    """Make the next start of ``model`` fast: pull it if it is a known model and convert a GGUF
    file to its cached HF folder. Returns the folder the engine will read (``boxcar model pull``
    calls this; the engine does the same on a first start otherwise)."""
    return load_checkpoint(model, convert_gguf=True).path


def _skipped(name: str, tied: bool) -> bool:
    """Old checkpoints saved rope buffers; tied ones sometimes still carry lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


# (name, shape, dtype) of a stored tensor -> the CPU tensor to read it into, or None
Destination = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None]


def read_safetensors(
    file: Path, destination: Destination | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a .safetensors file, each read into its own memory.

    ``destination(name, shape, dtype)`` may name where a tensor goes instead: a contiguous CPU
    tensor of that shape and dtype (a model's parameter), which the bytes are read into and which
    is yielded. Loading a model that way skips a copy of every weight (~0.3 s and a transient
    tensor's memory for the default model); any other answer (None, a mismatch) reads the tensor
    into fresh memory as usual.

    Plain reads rather than safetensors' memory map: the mapped pages of a file count in the
    process's RSS until the whole file is closed, so loading through the map peaks at the model
    twice over; read one tensor at a time, the peak is the model plus one tensor (and it is faster
    than faulting the map in page by page). Files with dtypes this does not know go through
    ``safe_open``.
    """
    with open(file, "rb") as handle:
        header = _read_header(handle, file)
        header_size = handle.tell() - 8
        header.pop("__metadata__", None)
        if any(entry.get("dtype") not in _SAFETENSORS_DTYPES for entry in header.values()):
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():
                    yield name, weights.get_tensor(name)
            return
        base = 8 + header_size
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            start, end = entry["data_offsets"]
            shape, dtype = tuple(entry["shape"]), _SAFETENSORS_DTYPES[entry["dtype"]]
            given = destination(name, shape, dtype) if destination is not None else None
            tensor = given if _can_read_into(given, shape, dtype) else torch.empty(shape,
                                                                                  dtype=dtype)
            buffer = tensor.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes
            if buffer.nbytes != end - start:
                raise ValueError(f"{file}: tensor {name!r} has {end - start} bytes, "
                                 f"its shape and dtype need {buffer.nbytes}")
            handle.seek(base + start)
            if buffer.nbytes and handle.readinto(buffer) != buffer.nbytes:  # type: ignore[arg-type]
                raise ValueError(f"{file} is truncated (tensor {name!r})")
            yield name, tensor


def safetensors_header(file: Path) -> dict[str, Any]:
    """A .safetensors file's tensor entries (name -> dtype, shape, data_offsets)."""
    with open(file, "rb") as handle:
        header = _read_header(handle, file)
    header.pop("__metadata__", None)
    return header


def safetensors_metadata(file: Path) -> dict[str, str]:
    """A .safetensors file's ``__metadata__`` ({} without one)."""
    with open(file, "rb") as handle:
        metadata = _read_header(handle, file).get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _read_header(handle: Any, file: Path) -> dict[str, Any]:
    header_size = int.from_bytes(handle.read(8), "little")
    try:
        header = json.loads(handle.read(header_size))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not a safetensors file: {error}") from error
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file: its header is not an object")
    return header


def _can_read_into(tensor: torch.Tensor | None, shape: tuple[int, ...],
                   dtype: torch.dtype) -> TypeGuard[torch.Tensor]:
    return (
        tensor is not None and tuple(tensor.shape) == shape and tensor.dtype == dtype
        and tensor.device.type == "cpu" and tensor.is_contiguous()
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: the shards its index lists, else its *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index: {error}") from error
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise ValueError(f"{folder} is missing shards listed in {index.name}: {missing}")
        return files
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no weights: expected model.safetensors, or shards listed in "
            "model.safetensors.index.json (PyTorch .bin checkpoints are not supported; re-save "
            "them with save_pretrained, which writes safetensors)"
        )
    return files


def _locate(reference: str, what: str) -> Path:
    """The .gguf file or HF folder ``reference`` points at, pulling known models if needed."""
    path = _existing_path(reference, what)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{what} file {path} is not a .gguf file; pass a .gguf or a folder")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = [gguf.name for gguf in ggufs]
        raise ValueError(f"{path} holds several .gguf files {names}; pass the path of one")
    raise ValueError(
        f"{what} folder {path} has neither config.json (an HF checkpoint) nor a .gguf file"
    )


def _locate_tokenizer(reference: str) -> Path:
    path = _existing_path(reference, "tokenizer")
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return path


def _existing_path(reference: str, what: str) -> Path:
    path = Path(reference).expanduser()
    if path.exists():
        return path
    cached = model_cache.resolve(reference)
    if cached is None and model_cache.canonical_name(reference) in model_cache.KNOWN_MODELS:
        cached = model_cache.pull(reference)
    if cached is None:
        raise ValueError(
            f"{what} {reference!r} is not an existing folder or .gguf file, nor a model in the "
            f"cache {model_cache.cache_dir()} (pullable: {sorted(model_cache.KNOWN_MODELS)}, "
            "alias 'default')"
        )
    return cached


# quant_method -> the architectures whose checkpoints the engine dequantises at load
SUPPORTED_QUANTIZATION = {"mxfp4": ("GptOssForCausalLM",)}


def _check_quantization(quantization: Any, architecture: str, config_file: Path) -> None:
    """A quantised checkpoint the engine cannot read is refused here, naming the field, rather
    than failing at its first packed tensor (or worse, loading it as something else)."""
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in hf_quant.METHODS:
        try:
            hf_quant.parse_quantization(quantization)
        except ValueError as error:
            raise ValueError(f"{config_file}: {error}") from error
        return
    if method not in SUPPORTED_QUANTIZATION:
        known = ", ".join(f"{m} ({'/'.join(a)})" for m, a in SUPPORTED_QUANTIZATION.items())
        raise ValueError(f"{config_file}: quantization_config.quant_method {method!r} is not "
                         f"supported; the engine reads {hf_quant.SUPPORTED}; {known}")
    if architecture not in SUPPORTED_QUANTIZATION[method]:
        raise ValueError(f"{config_file}: quantization_config.quant_method {method!r} is read "
                         f"for {', '.join(SUPPORTED_QUANTIZATION[method])} only, not "
                         f"{architecture}")


def _load_hf_config(folder: Path) -> Any:
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {config_file}: {error}") from error
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture is None:
        architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(raw.get("model_type", ""))
    if architecture not in SUPPORTED_ARCHITECTURES:
        found = architecture or f"model_type {raw.get('model_type')!r}"
        raise ValueError(
            f"{config_file} describes {found}, which is not supported; supported architectures "
            f"are {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _check_quantization(raw.get("quantization_config"), architecture, config_file)
    config = read_model_config(raw)
    if config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except Exception as error:  # noqa: BLE001 - transformers' field validation raises
            # huggingface_hub's StrictDataclassError, no ValueError: the config is what is wrong
            raise ValueError(f"{config_file}: {error}") from error
    config.architectures = [architecture]
    return config
