"""Tiny AWQ, GPTQ and FP8 checkpoints for the tests, written as the quantizers write them.

Each scheme quantizes a random checkpoint's decoder linears (attention and MLP projections; the
embeddings, norms and ``lm_head`` stay dense, as the released checkpoints keep them) and writes
two folders: the quantized checkpoint, with its ``quantization_config``, and a reference with the
same weights dequantized to fp32, so a model built from the reference is the quantized model's
exact twin. The packing here is written from the formats' descriptions, one nibble at a time,
independently of the engine's vectorized unpacking, so a layout mistake on either side shows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output 8c + this[i]
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, out]`` codes -> ``[rows, out / 8]`` int32 in AWQ's interleaved nibble order."""
    rows, cols = codes.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i, j in enumerate(AWQ_PACK_ORDER):
            words[:, c] |= codes[:, 8 * c + j].to(torch.int64) << (4 * i)
    return _to_int32(words)


def pack_sequential(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Codes packed eight to an int32 along ``dim`` in order (GPTQ's qweight along the inputs,
    its qzeros along the outputs): nibble ``j`` of word ``r`` is element ``8r + j``."""
    codes = codes.to(torch.int64).movedim(dim, 0)
    words = torch.zeros(codes.shape[0] // 8, *codes.shape[1:], dtype=torch.int64)
    for j in range(8):
        words |= codes[j::8] << (4 * j)
    return _to_int32(words).movedim(0, dim).contiguous()


def _min_max(w: torch.Tensor, dim: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16, as the checkpoints store it) and integer zero point over ``dim``."""
    if sym:
        scale = (2 * w.abs().amax(dim) / 15).clamp(min=1e-5).half()
        return scale, torch.full_like(scale, 8, dtype=torch.int64)
    lo, hi = w.amin(dim).clamp(max=0), w.amax(dim).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()
    return scale, (-lo / scale.float()).round().clamp(0, 15).long()


def quantize_awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]:
    """``w [out, in]`` -> (AWQ's qweight / qzeros / scales, the dequantized ``[out, in]``)."""
    out_features, in_features = w.shape
    groups = w.t().reshape(in_features // group_size, group_size, out_features)
    scale, zero = _min_max(groups, 1, sym=False)  # [groups, out]
    codes = (groups / scale.float()[:, None]).round() + zero[:, None]
    codes = codes.clamp(0, 15).long()  # [groups, group, out]
    dense = (codes - zero[:, None]).float() * scale.float()[:, None]
    tensors = {
        "qweight": pack_awq_columns(codes.reshape(in_features, out_features)),
        "qzeros": pack_awq_columns(zero),
        "scales": scale,
    }
    return tensors, dense.reshape(in_features, out_features).t().contiguous()


def quantize_gptq(w: torch.Tensor, group_size: int | None, *, act_order: bool, sym: bool,
                  v2: bool, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [out, in]`` -> (GPTQ's qweight / qzeros / scales / g_idx, the dequantized weight).
    With ``act_order`` the inputs are grouped in a random order (GPTQ's descending Hessian
    diagonal); v1 (``v2`` False) stores each zero point less one."""
    out_features, in_features = w.shape
    size = group_size or in_features
    order = (torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
             if act_order else torch.arange(in_features))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // size).int()
    num_groups = in_features // size
    scales = torch.empty(num_groups, out_features, dtype=torch.float16)
    zeros = torch.empty(num_groups, out_features, dtype=torch.int64)
    codes = torch.empty(in_features, out_features, dtype=torch.int64)
    dense = torch.empty(in_features, out_features)
    for g in range(num_groups):
        inputs = order[g * size:(g + 1) * size]
        rows = w.t()[inputs]  # [size, out]
        scale, zero = _min_max(rows, 0, sym)
        q = ((rows / scale.float()).round() + zero).clamp(0, 15).long()
        scales[g], zeros[g], codes[inputs] = scale, zero, q
        dense[inputs] = (q - zero).float() * scale.float()
    stored_zeros = zeros if v2 else (zeros - 1) & 0xF
    tensors = {
        "qweight": pack_sequential(codes, 0),
        "qzeros": pack_sequential(stored_zeros, 1),
        "scales": scales,
        "g_idx": g_idx,
    }
    return tensors, dense.t().contiguous()


def quantize_fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] | None = None,
                 scale_dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (e4m3 weight, its scale, the dequantized weight). ``strategy``
    "tensor" (scale ``[1]``), "channel" (``[out, 1]``) or "block" (``[ceil(out / bn),
    ceil(in / bk)]``)."""
    out_features, in_features = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale.expand(out_features, in_features)
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX
        full = scale.expand(out_features, in_features)
    else:
        assert block is not None
        bn, bk = block
        grid = (-(-out_features // bn), -(-in_features // bk))
        scale = torch.empty(grid)
        for i in range(grid[0]):
            for j in range(grid[1]):
                scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax() / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:out_features].repeat_interleave(bk, 1)
        full = full[:, :in_features]
    scale = scale.clamp(min=1e-8).to(scale_dtype)
    full = full.clamp(min=1e-8).to(scale_dtype).float()
    weight = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return weight, scale, weight.float() * full


@dataclass(frozen=True)
class Scheme:
    """How to quantize a checkpoint's linears and what its config says."""

    method: str  # awq | gptq | fp8 | ct-fp8
    group_size: int | None = 32
    act_order: bool = False
    sym: bool = True
    v2: bool = False
    strategy: str = "tensor"  # FP8: tensor | channel | block
    block: tuple[int, int] | None = None
    scale_dtype: torch.dtype = torch.float32
    extra: dict[str, Any] = field(default_factory=dict)  # config fields to add

    def config(self) -> dict[str, Any]:
        if self.method == "awq":
            config: dict[str, Any] = {"quant_method": "awq", "bits": 4, "version": "gemm",
                                      "group_size": self.group_size, "zero_point": True,
                                      "modules_to_not_convert": None}
        elif self.method == "gptq":
            config = {"quant_method": "gptq", "bits": 4, "group_size": self.group_size or -1,
                      "desc_act": self.act_order, "sym": self.sym, "true_sequential": True,
                      "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}
        elif self.method == "fp8":
            config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": list(self.block) if self.block else None,
                      "modules_to_not_convert": ["lm_head"]}
        else:
            weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True,
                                       "strategy": self.strategy, "dynamic": False,
                                       "group_size": None, "block_structure": None}
            if self.block:
                weights["block_structure"] = list(self.block)
            config = {"quant_method": "compressed-tensors", "format": "float-quantized",
                      "quantization_status": "compressed", "ignore": ["lm_head"],
                      "kv_cache_scheme": None, "config_groups": {"group_0": {
                          "targets": ["Linear"], "weights": weights,
                          "input_activations": {"num_bits": 8, "type": "float",
                                                "strategy": "token", "dynamic": True,
                                                "symmetric": True},
                          "output_activations": None}}}
        return {**config, **self.extra}

    def quantize(self, w: torch.Tensor, seed: int) -> tuple[dict[str, torch.Tensor],
                                                            torch.Tensor]:
        """One linear's weight -> (its tensors by suffix, the dequantized weight)."""
        if self.method == "awq":
            assert self.group_size is not None
            return quantize_awq(w, self.group_size)
        if self.method == "gptq":
            return quantize_gptq(w, self.group_size, act_order=self.act_order, sym=self.sym,
                                 v2=self.v2, seed=seed)
        strategy = "block" if self.method == "fp8" and self.block else self.strategy
        weight, scale, dense = quantize_fp8(w, strategy, self.block, self.scale_dtype)
        name = "weight_scale_inv" if self.method == "fp8" else "weight_scale"
        return {"weight": weight, name: scale}, dense


SCHEMES = {
    "awq-g32": Scheme("awq", 32),
    "awq-g64": Scheme("awq", 64),
    "gptq-g32-v1": Scheme("gptq", 32),
    "gptq-g64-act-order-v1": Scheme("gptq", 64, act_order=True),
    "gptq-g32-act-order-asym-v2": Scheme("gptq", 32, act_order=True, sym=False, v2=True),
    "gptq-row-asym-v2": Scheme("gptq", None, sym=False, v2=True),
    "fp8-block": Scheme("fp8", block=(48, 32)),
    "fp8-tensor": Scheme("fp8"),
    "ct-fp8-tensor": Scheme("ct-fp8", strategy="tensor"),
    "ct-fp8-channel": Scheme("ct-fp8", strategy="channel", scale_dtype=torch.bfloat16),
}


def write_quantized(dense: Path, folder: Path, scheme: Scheme) -> tuple[Path, Path]:
    """Quantize the checkpoint in ``dense``: (the reference folder, dequantized in fp32; the
    quantized folder)."""
    reference, quantized = folder / "reference", folder / "quantized"
    for out in (reference, quantized):
        out.mkdir(parents=True)
        for file in dense.iterdir():
            if file.suffix != ".safetensors" and file.name != "config.json":
                shutil.copy(file, out / file.name)
    weights = load_file(dense / "model.safetensors")
    reference_weights: dict[str, torch.Tensor] = {}
    quantized_weights: dict[str, torch.Tensor] = {}
    for seed, (name, tensor) in enumerate(sorted(weights.items())):
        module, _, part = name.rpartition(".")
        if part == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            tensors, tensor = scheme.quantize(tensor.float(), seed)
            quantized_weights.update({f"{module}.{k}": v for k, v in tensors.items()})
        else:
            quantized_weights[name] = tensor
        reference_weights[name] = tensor
    save_file(reference_weights, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(quantized_weights, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = scheme.config()
    (quantized / "config.json").write_text(json.dumps(config))
    return reference, quantized
