"""The engine's options on the command line, generated from ``EngineConfig``'s fields, so a
field added to the engine is an option of ``boxcar run``, ``serve`` and ``worker`` at once.

A field ``max_num_seqs`` is ``--max-num-seqs``; a boolean that defaults to True,
``enable_prefix_caching``, is ``--no-prefix-caching``; one that defaults to False is a plain
switch. An option not given leaves the field at EngineConfig's default (or, for the service,
at ``BOXCAR_ENGINE_OPTIONS``). The service's settings keep the same fields as a JSON object
(``BOXCAR_ENGINE_OPTIONS``), checked when the worker builds its EngineConfig.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields
from typing import Any

from engine.checkpoint.model_cache import DEFAULT_MODEL
from engine.config import EngineConfig, parse_lora_module

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"`` (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    number, unit = match.groups()
    size = int(float(number) * _SIZE_UNITS[unit.lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def parse_lora_module_arg(text: str) -> str:
    """One ``--lora-modules`` item as ``NAME=PATH``, from that form or vLLM's JSON object
    ``{"name", "path", "base_model_name"}``. ``base_model_name`` is accepted and not used: an
    adapter always runs on the engine's one model, and the engine checks it was trained on it."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"bad item {text!r}: not valid JSON ({exc})") from exc
        unknown = sorted(set(item) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(
                f"bad item {text!r}: unknown keys {unknown} (name, path, base_model_name)")
        name, path = item.get("name"), item.get("path")
        if (not isinstance(name, str) or not isinstance(path, str) or "=" in name
                or not name.strip() or not path.strip()):
            raise argparse.ArgumentTypeError(
                f"bad item {text!r}: needs \"name\" and \"path\", non-empty strings, and a "
                "name without '='")
        return f"{name.strip()}={path.strip()}"
    try:
        name, path = parse_lora_module(text)
    except ValueError:
        # The list runs to the next option: a positional typed after it lands here.
        hint = "" if "=" in text else " (a file argument goes before --lora-modules)"
        raise argparse.ArgumentTypeError(
            f"bad item {text!r}: an adapter is NAME=PATH, both non-empty{hint}") from None
    return f"{name}={path}"


class _LoRAModulesAction(argparse.Action):
    """Adds one flag's adapters to the earlier flags': ``--lora-modules a=P b=Q`` (vLLM's form)
    and ``--lora-modules a=P --lora-modules b=Q`` give the same list. A name twice is an error
    here, at the flag, rather than when the engine starts."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        modules: list[str] = list(getattr(namespace, self.dest) or [])
        names = {parse_lora_module(m)[0] for m in modules}
        for item in values:
            name = parse_lora_module(item)[0]
            if name in names:
                raise argparse.ArgumentError(self, f"bad item {item!r}: adapter name {name!r} "
                                                   "is given twice")
            names.add(name)
            modules.append(item)
        setattr(namespace, self.dest, modules)


# What the command line adds to a field: its help, and where it differs from the rule above, its
# flag, parser or choices. Types, defaults and the set of options come from EngineConfig.
_HELP: dict[str, dict[str, Any]] = {
    "model": {"help": "a model folder, a .gguf file or a cached model name "
                      f"(default: {DEFAULT_MODEL})"},
    "tokenizer": {"help": "a tokenizer folder (default: the model's)"},
    "dtype": {"choices": ("auto", "float32", "bfloat16", "float16"),
              "help": "auto: bfloat16 on a GPU and on a CPU with bf16 units (AMX or "
                      "AVX512-BF16, with oneDNN's bf16 weight packing), float32 on other CPUs; "
                      "float32 is the exact mode"},
    "device": {"choices": ("auto", "cpu", "cuda")},
    "max_model_len": {"help": "context length (default: the model's)"},
    "block_size": {"help": "tokens per KV block"},
    "num_kv_blocks": {"help": "KV blocks (default: sized by --kv-cache-memory)"},
    "kv_cache_memory": {"type": parse_size, "help": "KV cache size, e.g. 512MiB or 2GiB"},
    "max_kv_blocks": {"help": "at most this many KV blocks whatever --kv-cache-memory buys "
                              "(boxcar run: what its file's requests need)"},
    "max_num_batched_tokens": {"help": "token budget of one step"},
    "max_num_seqs": {"help": "most sequences in one step"},
    "enable_chunked_prefill": {"help": "prefill each prompt in one step"},
    "enable_prefix_caching": {"help": "disable the prefix cache"},
    "watermark": {"help": "share of KV blocks kept free when admitting requests"},
    "seed": {"help": "engine seed"},
    "num_threads": {"flag": "--threads", "help": "CPU threads for torch"},
    "attention_backend": {"choices": ("cpu", "torch", "triton"),
                          "help": "attention kernels (default: chosen by device)"},
    "cpu_gemm": {"choices": ("mkl", "onednn"),
                 "help": "library for fp32 matrix products on a CPU (default: MKL on Intel, "
                         "oneDNN elsewhere)"},
    "enforce_eager": {"help": "no CUDA graphs"},
    "lora_modules": {"action": _LoRAModulesAction, "nargs": "+", "type": parse_lora_module_arg,
                     "metavar": "NAME=PATH",
                     "help": "LoRA adapters (PEFT folders; for serve and worker also "
                             "object-storage keys) lines may name as their model: NAME=PATH or "
                             "vLLM's JSON {\"name\": ..., \"path\": ...}; several after one "
                             "flag (up to the next option), and the flag repeatable"},
    "max_loras": {"help": "most LoRA adapters in one step"},
    "max_lora_rank": {"help": "largest LoRA rank accepted"},
    "max_cpu_loras": {"help": "LoRA adapters kept loaded (default: --max-loras)"},
    "tensor_parallel_size": {"help": "split the model over this many devices (one process "
                                     "each; GPUs, or CPU processes for tests)"},
    "task": {"choices": ("auto", "generate", "embed"),
             "help": "embed: serve a decoder checkpoint as an embedding model (auto: by the "
                     "model's architecture and sentence-transformers files)"},
    "pooling": {"choices": ("cls", "mean", "last"),
                "help": "embedding pooling (default: the model's sentence-transformers files)"},
    "normalize": {"help": "true/false: L2-normalize embeddings (default: the model's files)"},
    "truncate_embedding_inputs": {"help": "cut embedding inputs longer than the model's "
                                          "limit instead of failing their line"},
    "async_scheduling": {"help": "true/false: schedule step N+1 while step N runs (default: on "
                                 "for CUDA, off on a CPU, where it measured slower)"},
    "quantization": {"choices": ("keep", "dequantize"),
                     "help": "a GGUF's quantized weights: keep them in their blocks (about the "
                             "file's memory) or dequantize them at load (default: keep where "
                             "every quantized type has a CPU kernel, else dequantize, saying "
                             "why)"},
}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r} (true or false)")


_TYPES = {"int": int, "float": float, "str": str, "bool": _parse_bool}


def _flag(name: str, default: Any) -> str:
    if default is True:
        return "--no-" + name.removeprefix("enable_").replace("_", "-")
    return "--" + name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as options (``boxcar run`` and the service's ``serve``/``worker``)."""
    group = parser.add_argument_group("engine")
    for field in fields(EngineConfig):
        extra = dict(_HELP.get(field.name, {}))
        if field.name == "model":
            group.add_argument("--model", default=DEFAULT_MODEL, help=extra["help"])
            continue
        flag = extra.pop("flag", None) or _flag(field.name, field.default)
        if field.type == "bool":
            group.add_argument(flag, dest=field.name, action="store_true", default=None, **extra)
            continue
        if "type" not in extra:
            extra["type"] = _TYPES[field.type.split("|")[0].strip()]
        group.add_argument(flag, dest=field.name, default=None, **extra)


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from parsed options; options not given keep EngineConfig's defaults."""
    kwargs: dict[str, Any] = {}
    for field in fields(EngineConfig):
        value = getattr(args, field.name, None)
        if value is None:
            continue
        if field.type == "bool" and field.default is True:
            value = not value  # --no-prefix-caching given: enable_prefix_caching=False
        kwargs[field.name] = value
    return kwargs
