"""MXFP4 expert weights (gpt-oss's checkpoints) dequantised at load.

The OCP microscaling format: a weight row is cut into groups of 32 values; each group stores 16
bytes of FP4 (E2M1) codes, two per byte, the low nibble first, and one uint8 power-of-two scale
with a bias of 127. gpt-oss stores an expert projection ``W [num_experts, out, in]`` as
``<name>_blocks [num_experts, out, in / 32, 16]`` and ``<name>_scales [num_experts, out, in / 32]``
(``quantization_config.quant_method == "mxfp4"``). Every FP4 value times a power of two is exact
in bf16 and fp32, so dequantising loses nothing; the engine keeps the experts in the run's dtype
(a kernel that multiplies packed MXFP4 directly is a later step).

``pair_mxfp4`` sits in the weight stream: it holds a ``_blocks`` tensor until its ``_scales``
arrives (or the other way round) and yields the dequantised tensor under the plain name, in
transformers' in-memory layout (``gate_up_proj [num_experts, in, out]``), so a model loads
quantised and unquantised checkpoints through the same code.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# E2M1 codes 0..15: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP_SIZE = 32
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., groups, 16]`` uint8 and ``scales [..., groups]`` uint8 -> ``[...,
    groups * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != GROUP_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         f"do not fit: blocks must be [..., groups, {GROUP_SIZE // 2}] and "
                         "scales [..., groups]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def pair_mxfp4(weights: Iterable[tuple[str, torch.Tensor]],
               dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream with each ``<name>_blocks`` / ``<name>_scales`` pair replaced by
    ``<name>``: dequantised, ``[num_experts, in, out]``. A half left without its partner at
    the end is a ``ValueError`` naming it."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for suffix, partner in (("_blocks", "_scales"), ("_scales", "_blocks")):
            if name.endswith(suffix):
                base = name.removesuffix(suffix)
                other = pending.pop(base + partner, None)
                if other is None:
                    pending[name] = (name, tensor)
                    break
                blocks, scales = (tensor, other[1]) if suffix == "_blocks" else (other[1], tensor)
                try:
                    dense = dequantize_mxfp4(blocks, scales, dtype)  # [experts, out, in]
                except ValueError as error:
                    raise ValueError(f"{base}: {error}") from error
                yield base, dense.transpose(1, 2)
                break
        else:
            yield name, tensor
    if pending:
        halves = sorted(pending)
        raise ValueError(f"MXFP4 checkpoint tensors without their partner: {halves[:3]} (each "
                         "<name>_blocks needs its <name>_scales)")
