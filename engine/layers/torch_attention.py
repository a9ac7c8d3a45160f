"""TorchAttentionBackend: paged attention in plain PyTorch, for the CPU (and as a GPU fallback).

Decodes are batched. On the CPU in fp32 or bf16 they go to a C++ kernel that reads the paged cache
in place (``engine/kernels/cpu_decode_attention.py``); otherwise every decode's blocks are gathered
in one ``index_select`` into a padded ``[num_decodes, max_len]`` view and attended with one
masked SDPA call. Prefill chunks, a few per step, each attend over their own gathered prefix with
a causal mask offset by the prefix length.
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
            )
        elif num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, metadata, scale)
        if metadata.num_prefills:
            self._prefill(q, k, v, k_cache, v_cache, metadata, scale, out)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """The gather path (``forward`` calls the C++ kernel itself where it fits)."""
        if "decode_blocks" not in metadata.extra:
            self._prepare_gather(metadata)
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        blocks = metadata.extra["decode_blocks"]
        mask = metadata.extra["decode_mask"]
        # [num_decodes, padded_len, num_kv_heads, head_dim] -> [num_decodes, kv_heads, len, dim]
        keys = k_cache.index_select(0, blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, blocks).view(num_decodes, -1, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [num_decodes, num_heads, 1, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return out.squeeze(2)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, out: torch.Tensor,
    ) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        block_size = k_cache.shape[1]
        gqa = num_heads != num_kv_heads
        start = metadata.num_decodes
        # Chunks differ in length and prefix; a handful run per step, so one SDPA call each.
        for i, (q_len, ctx_len) in enumerate(
            zip(metadata.prefill_query_lens_list, metadata.prefill_context_lens_list, strict=True)
        ):
            end = start + q_len
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
            if ctx_len == q_len:  # no cached prefix: the fresh k/v are the whole context
                ki, vi = k[start:end], v[start:end]
                mask = None
                causal = True
            else:
                num_blocks = -(-ctx_len // block_size)
                table = metadata.prefill_block_tables[i, :num_blocks].to(torch.int64)
                ki = k_cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[:ctx_len]
                vi = v_cache.index_select(0, table).view(-1, num_kv_heads, head_dim)[:ctx_len]
                # Query j sits at position ctx_len - q_len + j and sees positions up to it.
                q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
                causal = False
            oi = F.scaled_dot_product_attention(
                qi,
                ki.transpose(0, 1).unsqueeze(0),  # [1, num_kv_heads, ctx_len, head_dim]
                vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[start:end] = oi.squeeze(0).transpose(0, 1)
            start = end
