"""Packed (varlen) attention on the CPU: the C++ kernel's launcher (``csrc/packed_attention.cpp``,
built into the CPU kernel library by ``cpu_decode_attention``). Its torch reference is
``engine.kernels.packed_attention.packed_attention_ref``; ``check_packed`` checks the inputs of
both kernels (this module needs no Triton).

Why a kernel: a pooling step is dozens of short sequences, and one SDPA call per sequence and
layer is hundreds of small OpenMP regions a step; with the cores shared, each region waits for
its slowest thread (measured: 540 calls of 22 tokens took 2.3 s at 2 threads on the loaded
machine against 0.2 s at 1). The kernel is one region a layer, a (sequence, head) per item.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_decode_attention


def check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> None:
    """Shapes, dtypes, strides and devices the kernel and its reference both need."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be [num_tokens, heads, head_dim], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k and v must be [{q.shape[0]}, num_kv_heads, {q.shape[2]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads "
                         f"{k.shape[1]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [num_seqs + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got {t.stride()}")
    devices = {t.device for t in (q, k, v, cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def available(q: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and cpu_decode_attention.load() is not None)


def cpu_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor, scale: float, *,
                         causal: bool) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each packed sequence over itself (q: [num_tokens, num_heads, head_dim],
    k/v: [num_tokens, num_kv_heads, head_dim], cu_seqlens: int32 [num_seqs + 1])."""
    check_packed(q, k, v, cu_seqlens)
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the CPU kernel takes float32 or bfloat16 CPU tensors, got {q.dtype} "
                         f"on {q.device}")
    if int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens[-1] ({int(cu_seqlens[-1])}) != num_tokens ({q.shape[0]})")
    module = cpu_decode_attention.load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available")
    out = torch.empty_like(q)
    module.packed_attention(q, k, v, cu_seqlens.contiguous(), out, scale, causal)
    return out
