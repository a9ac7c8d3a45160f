"""TorchAttentionBackend: paged attention in plain PyTorch, for the CPU (and as a GPU fallback).

Decodes are batched. On the CPU in fp32 or bf16 they go to a C++ kernel that reads the paged cache
in place (``engine/kernels/cpu_decode_attention.py``); otherwise every decode's blocks are gathered
in one ``index_select`` into a padded ``[num_decodes, max_len]`` view and attended with one
masked SDPA call. Prefill chunks, a few per step, each attend over their own gathered prefix with
a causal mask offset by the prefix length.

A layer's options (``engine/layers/attention.py``): a sliding window narrows each mask to the
last ``window`` positions; a soft-cap or sinks take the explicit softmax (``attend_ref``) that
Hugging Face's eager attention computes, since SDPA has neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_decode_attention, cpu_fused_ops
from engine.layers.attention_metadata import AttentionMetadata


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def attend_ref(
    q: torch.Tensor,  # [batch, num_heads, q_len, head_dim]
    k: torch.Tensor,  # [batch, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # broadcastable to [batch, num_heads, q_len, kv_len]; True: seen
    scale: float,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [batch, num_heads, q_len, head_dim]
    """``softmax(cap(q k^T * scale) + mask [, sink]) v`` step by step, in q's dtype with an fp32
    softmax, as Hugging Face's ``eager_attention_forward`` (and gpt-oss's sink variant)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, scale: float, soft_cap: float | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA where it computes the layer's attention, else ``attend_ref``."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    return attend_ref(q, k, v, mask, scale, soft_cap, sinks)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, block_size: int, use_cpu_kernel: bool = True) -> None:
        self.block_size = block_size
        self.cpu_kernel = cpu_decode_attention.load() is not None if use_cpu_kernel else False
        if self.cpu_kernel:
            self.name = "cpu"

    def _kernel_fits(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (self.cpu_kernel and q.device.type == "cpu"
                and q.dtype in (torch.float32, torch.bfloat16)
                and k_cache.dtype in (torch.float32, torch.bfloat16))

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Nothing up front: the gather path builds its state at the first layer that needs it
        (the C++ kernel reads the block tables as they are)."""

    def _prepare_gather(self, metadata: AttentionMetadata) -> None:
        """Padded block list and mask of the decodes, shared by every layer of the step."""
        lens = metadata.decode_context_lens.to(torch.int64)
        num_blocks = -(-max(metadata.decode_context_lens_list) // self.block_size)
        tables = metadata.decode_block_tables[:, :num_blocks].to(torch.int64)
        positions = torch.arange(num_blocks * self.block_size, device=lens.device)
        # [num_decodes, 1, 1, padded_len]: True where the position holds context.
        metadata.extra["decode_mask"] = (positions[None, :] < lens[:, None])[:, None, None, :]
        metadata.extra["decode_blocks"] = tables.reshape(-1)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kernel = self._kernel_fits(q, k_cache)
        if kernel and q.dtype == k_cache.dtype == torch.bfloat16:
            cpu_fused_ops.store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        else:
            store_kvcache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = metadata.num_decodes
        if num_decodes and kernel:
            cpu_decode_attention.paged_decode_attention(
                q[:num_decodes], k_cache, v_cache, metadata.decode_block_tables,
                metadata.decode_context_lens, scale, out=out[:num_decodes],
                window=window, soft_cap=soft_cap, sinks=sinks,
            )
        elif num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, metadata, scale,
                                             window, soft_cap, sinks)
        if metadata.num_prefills:
            self._prefill(q, k, v, k_cache, v_cache, metadata, scale, out,
                          window, soft_cap, sinks)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float, window: int | None = None,
        soft_cap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gather path (``forward`` calls the C++ kernel itself where it fits)."""
        if "decode_blocks" not in metadata.extra:
            self._prepare_gather(metadata)
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        blocks = metadata.extra["decode_blocks"]
        mask = metadata.extra["decode_mask"]
        if window is not None:
            key = f"decode_mask_window_{window}"
            if key not in metadata.extra:
                # The query sits at len - 1 and sees positions len - window .. len - 1.
                lens = metadata.decode_context_lens.to(torch.int64)
                positions = torch.arange(mask.shape[-1], device=lens.device)
                seen = positions[None, :] >= (lens - window)[:, None]
                metadata.extra[key] = mask & seen[:, None, None, :]
            mask = metadata.extra[key]
        # [num_decodes, padded_len, num_kv_heads, head_dim] -> [num_decodes, kv_heads, len, dim]
        keys = k_cache.index_select(0, blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        out = _attend(
            q.unsqueeze(2),  # [num_decodes, num_heads, 1, head_dim]
            keys.transpose(1, 2), values.transpose(1, 2), mask, False, scale, soft_cap, sinks)
        return out.squeeze(2)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
        window: int | None = None, soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        block_size = k_cache.shape[1]
        start = metadata.num_decodes
        # Chunks differ in length and prefix; a handful run per step, so one SDPA call each.
        for i, (q_len, ctx_len) in enumerate(
            zip(metadata.prefill_query_lens_list, metadata.prefill_context_lens_list, strict=True)
        ):
            end = start + q_len
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
            # Keys before ``first`` are outside every query's window: not even gathered.
            first = 0 if window is None else max(0, ctx_len - q_len - window + 1)
            first -= first % block_size
            mask: torch.Tensor | None = None
            causal = False
            if ctx_len == q_len and (window is None or q_len <= window):
                # no cached prefix, nothing outside the window: the fresh k/v, causally
                ki, vi = k[start:end], v[start:end]
                causal = True
            else:
                if ctx_len == q_len:
                    ki, vi = k[start:end], v[start:end]
                else:
                    blocks = metadata.prefill_block_tables[
                        i, first // block_size: -(-ctx_len // block_size)].to(torch.int64)
                    ki = k_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
                    vi = v_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)
                    ki, vi = ki[: ctx_len - first], vi[: ctx_len - first]
                # Query j sits at position ctx_len - q_len + j and sees the positions up to it
                # (and, with a window, the last ``window`` of them).
                q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
                k_pos = torch.arange(first, ctx_len, device=q.device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            oi = _attend(
                qi,
                ki.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, ctx_len, head_dim]
                vi.transpose(0, 1).unsqueeze(0),
                mask, causal, scale, soft_cap, sinks,
            )
            out[start:end] = oi.squeeze(0).transpose(0, 1)
            start = end
