"""Read a PEFT LoRA adapter folder into per-linear weights the engine's ``LoRALinear`` applies.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``,
``rank_pattern`` / ``alpha_pattern``, ``base_model_name_or_path``) and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight [r, in]`` and
``lora_B.weight [out, r]`` per targeted module. Scaling is ``alpha / r``, or ``alpha / sqrt(r)``
with rsLoRA (Kalajdzievski 2023), per module (its own rank, its own alpha where a pattern
gives one).

Every problem is a ``LoRAError`` naming the adapter: a missing or unreadable file, a rank above
``max_lora_rank``, a base model other than the served one, a module the model lacks, a shape the
model's linears do not have, a PEFT feature the engine does not run (DoRA, LoRA biases, extra
trained modules).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import LoRAError
from engine.lora.layers import LoRALinear, LoRAPiece, LoRATarget, ModuleLoRA

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class LoRAAdapter:
    """One loaded adapter: its weights per ``LoRALinear`` index (None: that linear untouched)."""

    name: str
    path: str
    rank: int  # the largest rank over its modules
    modules: list[ModuleLoRA | None]
    target_modules: tuple[str, ...]  # the Hugging Face module names it trains (q_proj, ...)

    @property
    def num_bytes(self) -> int:
        total = 0
        for module in self.modules:
            if module is not None:
                total += module.lora_a.nbytes + sum(p.lora_b.nbytes for p in module.pieces)
        return total


def read_adapter_config(name: str, path: str | Path) -> dict[str, Any]:
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(name, f"{str(path)!r} is not a folder")
    file = folder / CONFIG_NAME
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoRAError(name, f"{file} is missing (a PEFT adapter folder has {CONFIG_NAME} "
                              f"and {WEIGHTS_NAME})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(name, f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(name, f"{file} must hold a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_rank: int,
                  base_names: set[str]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(name, f"peft_type {peft_type!r} is not LoRA")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if config.get(key):
            raise LoRAError(name, f"{key}: {what} is not implemented")
    if config.get("bias", "none") != "none":
        raise LoRAError(name, f"bias={config.get('bias')!r} is not implemented (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAError(name, f"modules_to_save {config['modules_to_save']} would replace base "
                              "weights per adapter, which is not implemented")
    ranks = [config.get("r", 8), *dict(config.get("rank_pattern") or {}).values()]
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LoRAError(name, f"rank r={rank!r} must be a positive integer")
    if max(ranks) > max_rank:
        raise LoRAError(name, f"rank {max(ranks)} is above max_lora_rank={max_rank}")
    base = config.get("base_model_name_or_path")
    if base and base_names:
        stem = os.path.basename(str(base).rstrip("/"))
        if str(base) not in base_names and stem.lower() not in {n.lower() for n in base_names}:
            raise LoRAError(name, f"it was trained on {base!r}; this engine serves "
                                  f"{', '.join(sorted(base_names))}")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: a key matches a module path ending in it."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


# (module name, A [rank, in], B [out, rank]) -> this rank's share of them (tensor parallel)
ShardLoRA = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(name: str, path: str | Path, *, targets: dict[str, LoRATarget],
                 linears: list[LoRALinear], max_rank: int, base_names: set[str],
                 dtype: torch.dtype, shard: ShardLoRA | None = None) -> LoRAAdapter:
    """Read and check one adapter folder against the model's linears (``wrap_lora_linears``);
    ``shard``: under tensor parallel, the rank's slice of each module's A and B, taken the way
    the module's base weight is split."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(name, path)
    _check_config(name, config, max_rank, base_names)
    file = Path(path) / WEIGHTS_NAME
    if not file.is_file():
        raise LoRAError(name, f"{file} is missing")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise LoRAError(name, f"{file} is not a readable safetensors file: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(_PREFIX))
        if match is None:
            raise LoRAError(name, f"tensor {key!r} is not a LoRA A or B weight of a linear "
                                  "(embedding and other targets are not implemented)")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise LoRAError(name, f"{file} holds no LoRA weights")
    lacking = sorted({m.rsplit(".", 1)[-1] for m in pairs if m not in targets})
    if lacking:
        known = sorted({k.rsplit(".", 1)[-1] for k in targets})
        raise LoRAError(name, f"target modules {lacking} are not in the served model (its "
                              f"LoRA targets: {', '.join(known)})")
    listed = config.get("target_modules")
    if isinstance(listed, list):  # a string is a regex PEFT matched: the tensors tell
        target_names = {k.rsplit(".", 1)[-1] for k in targets}
        missing = sorted(set(listed) - target_names)
        if missing:
            raise LoRAError(name, f"target modules {missing} are not in the served model (its "
                                  f"LoRA targets: {', '.join(sorted(target_names))})")
    alpha = config.get("lora_alpha", 8)
    alphas = dict(config.get("alpha_pattern") or {})
    rslora = bool(config.get("use_rslora", False))
    per_linear: dict[int, list[tuple[LoRATarget, torch.Tensor, torch.Tensor, float]]] = {}
    max_seen = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(name, f"{module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        if shard is not None:
            a, b = shard(module, a, b)
        target = targets[module]
        linear = target.linear
        out = (linear.out_features if target.slice_id is None
               else linear.slice_sizes[target.slice_id])
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features \
                or b.shape != (out, rank):
            raise LoRAError(name, f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do "
                                  f"not fit the served model's [{out}, {linear.in_features}] "
                                  "projection (an adapter for another base model?)")
        if rank > max_rank:
            raise LoRAError(name, f"{module} has rank {rank}, above max_lora_rank={max_rank}")
        max_seen = max(max_seen, rank)
        module_alpha = float(_pattern_value(alphas, module, alpha))
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        per_linear.setdefault(linear.index, []).append((target, a, b, scaling))
    modules: list[ModuleLoRA | None] = [None] * len(linears)
    for index, entries in per_linear.items():
        linear = linears[index]
        pieces, a_rows, rank_offset = [], [], 0
        for target, a, b, scaling in sorted(entries, key=lambda e: e[0].slice_id or 0):
            rank = a.shape[0]
            if target.slice_id is None:
                col_offset, col_size = 0, linear.out_features
                slice_ids = tuple(range(len(linear.slice_sizes)))
            else:
                col_offset = linear.slice_offsets[target.slice_id]
                col_size = linear.slice_sizes[target.slice_id]
                slice_ids = (target.slice_id,)
            pieces.append(LoRAPiece(col_offset, col_size, rank_offset, rank, scaling,
                                    b.to(dtype).contiguous(), slice_ids))
            a_rows.append(a.to(dtype))
            rank_offset += rank
        if len({s for p in pieces for s in p.slice_ids}) < sum(len(p.slice_ids) for p in pieces):
            raise LoRAError(name, f"two of its modules overlap on {linear.slice_names}")
        modules[index] = ModuleLoRA(torch.cat(a_rows).contiguous(), pieces)
    names = tuple(sorted({m.rsplit(".", 1)[-1] for m in pairs}))
    return LoRAAdapter(name, str(path), max_seen, modules, names)
