"""A bf16 decoder layer's elementwise ops fused on the CPU: thin launchers and torch references.

At decode a bf16 layer's elementwise work (the residual adds, RMSNorm with its fp32 round trip,
SiLU times up, rotary) is a few dozen rows of hidden size: as torch ops, a dozen dispatches,
allocations and bf16 <-> fp32 conversions each, which a profile put at ~25% of a bf16 step's CPU
time on an AMX CPU. The C++ kernels (``csrc/cpu_fused_ops.cpp``, built into the decode
attention's library by ``cpu_decode_attention``) do each in one pass, in fp32, rounding to bf16
once (the norm, SiLU times up, rotary). Only bf16 on the CPU takes them: fp32 stays on the torch
ops, whose bits the correctness tests pin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_decode_attention


def available(x: torch.Tensor) -> bool:
    """Whether ``x``'s ops can run here: a CPU bf16 tensor and the kernel library loaded."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and cpu_decode_attention.load() is not None)


def _module():
    module = cpu_decode_attention.load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available")
    return module


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D CPU bfloat16 tensor with a contiguous last dim, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}")


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``; returns
    ``(x, residual)``. ``x``: [num_tokens, hidden_size] bf16; ``residual``: the same shape in
    fp32 (the residual stream, ``engine/layers/norm.py``); ``weight``: [hidden_size] bf16."""
    _check_rows("x", x)
    if (residual.dim() != 2 or residual.dtype != torch.float32 or residual.device.type != "cpu"
            or residual.stride(1) != 1):
        raise ValueError(f"residual must be a 2-D CPU float32 tensor with a contiguous last dim, "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}, "
                         f"strides {residual.stride()}")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if (weight.shape != (x.shape[1],) or weight.dtype != torch.bfloat16
            or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous bfloat16 [{x.shape[1]}], got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    _module().fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops the kernel replaces, out of place: an fp32 add, then the norm in fp32,
    rounded once (``RMSNorm``)."""
    residual = residual + x
    normed = F.rms_norm(residual, (residual.shape[-1],), weight.float(), eps)
    return normed.to(weight.dtype), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``: [num_tokens, 2 * intermediate_size]
    -> [num_tokens, intermediate_size]."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up needs an even last dim, got {gate_up.shape[1]}")
    out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    _module().silu_and_mul(gate_up, out)
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """In fp32, rounded once (the torch ops round after SiLU and after the product)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, num_heads, head_dim] in place (its halves, the Llama/NeoX
    layout) by the fp32 tables' rows at ``positions``; only the tables' first half is read.
    Returns ``x``."""
    if (x.dim() != 3 or x.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.stride(2) != 1 or x.shape[2] % 2):
        raise ValueError(f"x must be a CPU bfloat16 [num_tokens, num_heads, head_dim] with an "
                         f"even, contiguous head_dim, got {tuple(x.shape)} {x.dtype} on "
                         f"{x.device}, strides {x.stride()}")
    if positions.shape != (x.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{x.shape[0]}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if (table.dim() != 2 or table.dtype != torch.float32 or table.stride(1) != 1
                or table.shape[1] < x.shape[2] // 2 or table.stride(0) != cos_cache.stride(0)):
            raise ValueError(f"{name} must be a float32 [max_position, >= head_dim / 2] table "
                             f"with contiguous rows like cos_cache's")
    # The kernel checks each position against the tables' length (no reduction op here).
    _module().rotary_neox(x, positions.contiguous(), cos_cache, sin_cache)
    return x


def rotary_neox_ref(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor) -> torch.Tensor:
    """Out of place, in fp32, rounded once."""
    half = x.shape[-1] // 2
    cos = cos_cache[positions, :half].unsqueeze(1)  # [num_tokens, 1, half]
    sin = sin_cache[positions, :half].unsqueeze(1)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def screen_candidates(approx: torch.Tensor, row_bounds: torch.Tensor, weight_norms: torch.Tensor,
                      output_rounding: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy screen's candidates (``engine/runner/greedy_screen.py``): ``(row_ids,
    token_ids)``, int64, by row then token, where ``approx + bound`` reaches the row's best
    ``approx - bound``, ``bound = row_bounds[:, None] * weight_norms + |approx| *
    output_rounding``. ``approx``: [rows, vocab] bf16; ``row_bounds``: [rows] float32;
    ``weight_norms``: [vocab] float32."""
    _check_rows("approx", approx)
    rows, vocab = approx.shape
    for name, t, size in (("row_bounds", row_bounds, rows), ("weight_norms", weight_norms, vocab)):
        if t.shape != (size,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [{size}], got "
                             f"{tuple(t.shape)} {t.dtype}")
    return _module().screen_candidates(approx, row_bounds, weight_norms, output_rounding)


def screen_candidates_ref(approx: torch.Tensor, row_bounds: torch.Tensor,
                          weight_norms: torch.Tensor, output_rounding: float
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops the kernel replaces."""
    approx = approx.float()
    bound = row_bounds[:, None] * weight_norms
    bound += approx.abs() * output_rounding
    best_lower = (approx - bound).amax(dim=1, keepdim=True)
    row_ids, token_ids = torch.nonzero(approx + bound >= best_lower, as_tuple=True)
    return row_ids, token_ids


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """``k``, ``v`` [num_tokens, num_kv_heads, head_dim] (each token's heads one contiguous run,
    like views of a fused qkv row) into the bf16 caches [num_blocks, block_size, num_kv_heads,
    head_dim] at ``slot_mapping`` [num_tokens] int64."""
    for name, t in (("k", k), ("v", v)):
        if (t.dim() != 3 or t.dtype != torch.bfloat16 or t.shape[1:] != k_cache.shape[2:]
                or t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.shape[0] != k.shape[0]):
            raise ValueError(f"{name} must be bfloat16 [num_tokens, {k_cache.shape[2]}, "
                             f"{k_cache.shape[3]}] with each token's heads contiguous, got "
                             f"{tuple(t.shape)} {t.dtype}, strides {t.stride()}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (cache.dtype != torch.bfloat16 or cache.shape != k_cache.shape
                or not cache.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous bfloat16 cache like k_cache")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}]")
    _module().store_kvcache(k, v, k_cache, v_cache, slot_mapping.contiguous())
