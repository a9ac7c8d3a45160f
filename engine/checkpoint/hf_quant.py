"""AWQ, GPTQ and FP8 Hugging Face checkpoints: the config checked, each module's tensors one weight.

A quantized checkpoint names the scheme in ``config.json``'s ``quantization_config`` and stores
each quantized linear as several tensors under the module's name: AWQ ``qweight`` / ``qzeros`` /
``scales``, GPTQ those and ``g_idx``, FP8 an e4m3 ``weight`` and its ``weight_scale_inv``
(Hugging Face's fine-grained FP8) or ``weight_scale`` (compressed-tensors). ``parse_quantization``
checks the config at start and refuses, naming the field, anything whose layout the engine does
not read (8- or 3-bit codes, AWQ's GEMV packing, int8 compressed-tensors, static activation
scales, ...), before a weight is read. ``load_quantized`` then sits in the weight stream like
``engine.models.mxfp4.pair_mxfp4``: it holds a module's tensors until it has them all (a shard may
split them) and yields ``<module>.weight``, either kept packed (``Int4Weight`` / ``Fp8Weight``,
for the quantized linears of ``engine.layers.quantized``) or dequantized to the run's dtype, so
the families load quantized checkpoints through their usual ``load_weights``; ``choose_mode``
decides which (kept on a GPU, where the Triton kernels are; dequantized on the CPU, which has no
kernel for these formats, saying so). Modules the config leaves unquantized
(``modules_to_not_convert``, ``ignore``, an unquantized ``lm_head``) are stored dense and pass
through untouched. A module missing a tensor, or whose tensors do not fit each other, is a
``ValueError`` naming the module and the tensor.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.fp8_weights import Fp8Weight, dequantize_fp8
from engine.kernels.int4_weights import (
    Int4Weight,
    check_awq,
    check_gptq,
    dequantize_awq,
    dequantize_gptq,
)

METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
KERNEL_DEVICES = ("cuda",)  # where Int4Weight and Fp8Weight have kernels (else the reference)
GROUP_SIZES = (32, 64, 128)
SUPPORTED = ("awq (bits 4, version gemm, zero_point true, group_size 32/64/128); gptq (bits 4, "
             "group_size 32/64/128 or -1, desc_act with g_idx, checkpoint_format gptq or "
             "gptq_v2); fp8 (e4m3 weights, weight_scale_inv per tensor or in blocks, dynamic "
             "activations); compressed-tensors (8-bit float weights, strategy tensor, channel "
             "or block, activations dynamic or absent)")
_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class HFQuantization:
    """A checked ``quantization_config``: how its quantized linears are stored."""

    method: str  # one of METHODS
    group_size: int | None = None  # int4: inputs a zero point and scale cover; None: a row
    zero_offset: int = 0  # GPTQ v1 stores each zero point less one
    act_order: bool = False  # GPTQ's desc_act: g_idx is a permutation of the inputs
    block_size: tuple[int, int] | None = None  # FP8 scales per (out, in) block; None: by shape
    scale_name: str = "weight_scale"  # FP8: the scale tensor's name beside ``weight``

    @property
    def is_int4(self) -> bool:
        return self.method in ("awq", "gptq")

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors each quantized module stores."""
        if self.method == "awq":
            return _INT4_PARTS[:3]
        return _INT4_PARTS if self.method == "gptq" else ("weight", self.scale_name)

    def describe(self) -> str:
        if self.is_int4:
            group = f"group {self.group_size}" if self.group_size else "one group a row"
            return f"{self.method.upper()} int4 ({group})"
        blocks = f"{self.block_size[0]}x{self.block_size[1]} blocks" if self.block_size else (
            "per-tensor or per-channel scales")
        return f"FP8 e4m3 ({self.method}, {blocks})"


def parse_quantization(config: Any) -> HFQuantization:
    """``quantization_config`` of a method in ``METHODS``, checked; ``ValueError`` naming the
    field and listing what the engine reads."""
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    parse = {"awq": _parse_awq, "gptq": _parse_gptq, "fp8": _parse_fp8,
             "compressed-tensors": _parse_compressed_tensors}.get(str(method))
    if parse is None:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {SUPPORTED}")
    return parse(config)


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported; supported: {SUPPORTED}")


def _group_size(config: dict[str, Any], method: str, allow_row: bool) -> int | None:
    group = config.get("group_size", config.get("q_group_size"))
    if allow_row and group == -1:
        return None
    if group not in GROUP_SIZES:
        raise _refuse(f"{method} group_size {group!r}")
    return int(group)


def _parse_awq(config: dict[str, Any]) -> HFQuantization:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _refuse(f"awq with bits={bits!r}")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"awq version {version!r} (its packing differs from gemm's)")
    if config.get("zero_point", True) is not True:
        raise _refuse("awq with zero_point false")
    return HFQuantization("awq", group_size=_group_size(config, "awq", allow_row=False))


def _parse_gptq(config: dict[str, Any]) -> HFQuantization:
    if config.get("bits") != 4:
        raise _refuse(f"gptq with bits={config.get('bits')!r}")
    form = config.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {form!r}")
    return HFQuantization("gptq", group_size=_group_size(config, "gptq", allow_row=True),
                          zero_offset=1 if form == "gptq" else 0,
                          act_order=bool(config.get("desc_act")))


def _parse_fp8(config: dict[str, Any]) -> HFQuantization:
    if config.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"fp8 fmt {config.get('fmt')!r}")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"fp8 activation_scheme {config.get('activation_scheme')!r} (static "
                      "input scales)")
    block = config.get("weight_block_size")
    return HFQuantization("fp8", block_size=_block(block, "fp8 weight_block_size"),
                          scale_name="weight_scale_inv")


def _block(value: Any, what: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(f"{what} {value!r} (two positive integers, like [128, 128])")
    return int(value[0]), int(value[1])


def _parse_compressed_tensors(config: dict[str, Any]) -> HFQuantization:
    if config.get("kv_cache_scheme") is not None:
        raise _refuse("compressed-tensors kv_cache_scheme (a quantized KV cache)")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(f"compressed-tensors config_groups {groups!r}")
    blocks = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"compressed-tensors config_groups.{name} {group!r}")
        form = group.get("format") or config.get("format")
        if form not in ("float-quantized", "naive-quantized"):
            raise _refuse(f"compressed-tensors format {form!r} (config_groups.{name})")
        weights: dict[str, Any] = group.get("weights") or {}
        if not isinstance(weights, dict):
            raise _refuse(f"compressed-tensors config_groups.{name}.weights {weights!r}")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(f"compressed-tensors config_groups.{name}.weights "
                          f"{weights.get('num_bits')}-bit {weights.get('type')}")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block") or weights.get("dynamic"):
            raise _refuse(f"compressed-tensors config_groups.{name}.weights strategy "
                          f"{strategy!r}{' (dynamic)' if weights.get('dynamic') else ''}")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), "compressed-tensors "
                              f"config_groups.{name}.weights.block_structure"))
        activations = group.get("input_activations")
        if activations is not None and not (isinstance(activations, dict)
                                            and activations.get("dynamic")):
            raise _refuse(f"compressed-tensors config_groups.{name}.input_activations with "
                          "static scales")
        if group.get("output_activations") is not None:
            raise _refuse(f"compressed-tensors config_groups.{name}.output_activations")
    if len(blocks) > 1:
        raise _refuse(f"compressed-tensors groups with different block structures {blocks}")
    return HFQuantization("compressed-tensors", block_size=blocks.pop() if blocks else None)


def choose_mode(quant: HFQuantization, requested: str | None, device_type: str, *,
                dense_only: str | None = None) -> str:
    """"keep" or "dequantize" for a checkpoint quantized by ``quant``. The weights multiply
    themselves with Triton kernels on CUDA (``KERNEL_DEVICES``), so there ``requested`` None
    keeps them; elsewhere, or where the engine loads dense weights only (``dense_only`` says
    why: tensor parallelism, an embedding model, a mixture of experts), None dequantizes at
    load, saying so on one line, and "keep" is a ``ValueError`` naming the way out."""
    if requested == "dequantize":
        return "dequantize"
    reason = dense_reason(quant, device_type, dense_only)
    if requested == "keep":
        if reason is not None:
            raise ValueError(f"quantization='keep': {reason}; use --quantization dequantize "
                             "(quantization='dequantize') or a GPU")
        return "keep"
    if reason is not None:
        print(f"[boxcar] dequantizing the {quant.describe()} weights at load: {reason}",
              file=sys.stderr, flush=True)
        return "dequantize"
    return "keep"


def dense_reason(quant: HFQuantization, device_type: str,
                 dense_only: str | None = None) -> str | None:
    """Why the weights cannot stay packed here (``choose_mode``), or None."""
    if dense_only is not None or device_type in KERNEL_DEVICES:
        return dense_only
    return (f"there is no {device_type.upper()} kernel for {quant.describe()} weights (their "
            f"kernels run on {', '.join(KERNEL_DEVICES)})")


def resident_bytes(quant: HFQuantization, name: str, entry: dict[str, Any], element: int, *,
                   keep: bool) -> int | None:
    """The memory a quantized module's stored tensor ends up taking (``entry``: its safetensors
    header entry; ``element``: the run's dtype's size), kept packed or dequantized; None for a
    tensor that is not part of a quantized module (it is loaded as it is)."""
    part = name.rpartition(".")[2]
    shape = entry["shape"]
    stored = entry["data_offsets"][1] - entry["data_offsets"][0]
    if quant.is_int4:
        if part not in quant.parts:
            return None
        if part == "qweight":  # 8 codes an int32 whichever way they are packed
            return stored if keep else shape[0] * shape[1] * 8 * element
        if part == "qzeros":  # kept unpacked: a byte a zero point
            return shape[0] * shape[1] * 8 if keep else 0
        if part == "g_idx":  # kept as an int64 permutation where it is not the identity
            return 2 * stored if keep and quant.act_order else 0
        return stored if keep else 0  # the scales, as stored
    if part == "weight" and entry["dtype"] == "F8_E4M3":
        return stored if keep else shape[0] * shape[1] * element
    if part == quant.scale_name:
        return math.prod(shape) * 4 if keep else 0  # kept in fp32
    return None


def load_quantized(
    weights: Iterable[tuple[str, torch.Tensor]], quant: HFQuantization, dtype: torch.dtype,
    *, keep: bool,
) -> Iterator[tuple[str, Any]]:
    """The weight stream with each quantized module's tensors replaced by ``<module>.weight``:
    an ``Int4Weight`` / ``Fp8Weight`` with ``keep``, else the dense ``[out, in]`` in ``dtype``.
    Every other tensor passes through as it came."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if not _is_part(quant, name, tensor, module in pending):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if all(p in parts for p in quant.parts):
            del pending[module]
            try:
                yield f"{module}.weight", _build(quant, parts, dtype, keep)
            except ValueError as error:
                raise ValueError(f"{module}: {error}") from error
    if pending:
        module, parts = next(iter(pending.items()))
        missing = [p for p in quant.parts if p not in parts]
        raise ValueError(f"{module}: {quant.describe()} tensor(s) {missing} missing from the "
                         f"checkpoint (a quantized module stores {list(quant.parts)}; "
                         f"{len(pending)} module(s) incomplete)")


def _is_part(quant: HFQuantization, name: str, tensor: torch.Tensor, started: bool) -> bool:
    part = name.rpartition(".")[2]
    if quant.is_int4:
        return part in quant.parts
    if part == "input_scale":
        raise ValueError(f"{name}: static activation scales are not supported (the engine "
                         "reads FP8 checkpoints with dynamic or no activation quantization)")
    if part == "weight":  # an FP8 weight, or the dense weight of a module left unquantized
        if tensor.dtype == torch.float8_e5m2:
            raise ValueError(f"{name}: float8_e5m2 weights are not supported (e4m3 only)")
        return tensor.dtype == torch.float8_e4m3fn or started
    return part == quant.scale_name


def _build(quant: HFQuantization, parts: dict[str, torch.Tensor], dtype: torch.dtype,
           keep: bool) -> Any:
    if quant.method == "awq":
        group = quant.group_size or 0
        if keep:
            return Int4Weight.from_awq(parts["qweight"], parts["qzeros"], parts["scales"], group)
        check_awq(parts["qweight"], parts["qzeros"], parts["scales"], group)
        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"],
                              group).to(dtype)
    if quant.method == "gptq":
        args = (parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"])
        if keep:
            return Int4Weight.from_gptq(*args, quant.group_size, quant.zero_offset)
        check_gptq(*args, quant.group_size)
        return dequantize_gptq(*args, quant.zero_offset).to(dtype)
    if parts["weight"].dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight is {parts['weight'].dtype} beside a {quant.scale_name}, not "
                         "float8_e4m3fn")
    try:
        weight = Fp8Weight.from_checkpoint(parts["weight"], parts[quant.scale_name],
                                           quant.block_size)
    except ValueError as error:  # the message says "the scale": name the tensor
        raise ValueError(f"{quant.scale_name}: {error}") from error
    return weight if keep else dequantize_fp8(weight.weight, weight.scale,
                                              weight.block).to(dtype)
