"""CUDAGraphRunner: replay captured CUDA graphs for decode-only steps, one graph per batch bucket.

A decode step launches a few kernels per layer on tiny tensors, so at small batch sizes the CPU's
launch overhead, not the GPU, sets the pace. Each bucket size gets one graph, captured over static
input buffers; a step of ``B`` decodes is padded to the next bucket (padding rows: slot -1, so
nothing is written to the cache, and context length 0, so attention yields zeros), copied into the
buffers, replayed, and the first ``B`` output rows are returned.

All buckets share one set of buffers sized for the largest bucket (bucket ``b`` uses rows ``[:b]``)
and one memory pool, captured largest first. The padding and bucketing are plain functions that run
on any device; only ``CUDAGraphRunner._capture_one`` touches the CUDA graph API.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.layers.attention_metadata import AttentionMetadata

# forward(input_ids [B], positions [B], metadata) -> hidden states or logits [B, ...]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Replay = Callable[[], None]

PAD_SLOT = -1


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size``, which is always included."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def select_bucket(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``batch_size`` rows (``buckets`` sorted), else ``None``."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


@dataclass
class DecodeInputs:
    """The per-step tensors of a decode batch, one row per sequence."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def allocate(
        cls, max_batch_size: int, max_num_blocks: int, device: torch.device | str
    ) -> DecodeInputs:
        """Static buffers, every row padding, so a warmup run over them writes nothing."""
        return cls(
            input_ids=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch_size, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_batch_size,), PAD_SLOT, dtype=torch.int64, device=device),
            block_tables=torch.zeros(
                max_batch_size, max_num_blocks, dtype=torch.int32, device=device
            ),
            context_lens=torch.zeros(max_batch_size, dtype=torch.int32, device=device),
        )

    def rows(self, n: int) -> DecodeInputs:
        """The first ``n`` rows, as views (what a graph of bucket ``n`` was captured over)."""
        return DecodeInputs(
            self.input_ids[:n],
            self.positions[:n],
            self.slot_mapping[:n],
            self.block_tables[:n],
            self.context_lens[:n],
        )

    def fill(self, src: DecodeInputs, bucket: int) -> None:
        """Copy ``src`` into rows ``[:B]`` of these buffers and make rows ``[B:bucket]`` padding."""
        batch_size, width = src.batch_size, src.block_tables.shape[1]
        if batch_size > bucket or bucket > self.batch_size:
            raise ValueError(
                f"cannot fit {batch_size} rows into bucket {bucket} of buffers with "
                f"{self.batch_size} rows"
            )
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block_tables has {width} columns, the static buffer only "
                f"{self.block_tables.shape[1]}; raise max_num_blocks"
            )
        self.input_ids[:batch_size].copy_(src.input_ids, non_blocking=True)
        self.positions[:batch_size].copy_(src.positions, non_blocking=True)
        self.slot_mapping[:batch_size].copy_(src.slot_mapping, non_blocking=True)
        self.context_lens[:batch_size].copy_(src.context_lens, non_blocking=True)
        # Columns past ``width`` keep stale block ids: the kernel reads only the blocks that
        # context_len covers, which all lie in the first ``width`` columns.
        self.block_tables[:batch_size, :width].copy_(src.block_tables, non_blocking=True)
        if bucket > batch_size:
            self.input_ids[batch_size:bucket].zero_()
            self.positions[batch_size:bucket].zero_()
            self.slot_mapping[batch_size:bucket].fill_(PAD_SLOT)
            self.context_lens[batch_size:bucket].zero_()
            self.block_tables[batch_size:bucket].zero_()


def decode_metadata(inputs: DecodeInputs) -> AttentionMetadata:
    """Decode-only AttentionMetadata over ``inputs`` (no host-side copies: they would go stale
    between graph replays)."""
    device = inputs.input_ids.device
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        num_decodes=inputs.batch_size,
        decode_block_tables=inputs.block_tables,
        decode_context_lens=inputs.context_lens,
        num_prefills=0,
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_block_tables=inputs.block_tables[:0],
        prefill_context_lens=inputs.context_lens[:0],
    )


class CUDAGraphRunner:
    """Runs decode steps through captured graphs; falls back to eager for larger batches.

    ``run`` returns a view into the graph's static output, overwritten by the next replay: use it
    (e.g. sample from it) before the next call.
    """

    def __init__(
        self,
        forward: ForwardFn,
        batch_sizes: Sequence[int],
        max_num_blocks: int,
        device: torch.device | str,
        *,
        enforce_eager: bool = False,
        num_warmups: int = 2,
        pool: Any = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be non-empty and >= 1, got {list(batch_sizes)}")
        if max_num_blocks < 1:
            raise ValueError(f"max_num_blocks must be >= 1, got {max_num_blocks}")
        self.forward = forward
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = torch.device(device)
        self.enforce_eager = enforce_eager
        self.num_warmups = num_warmups
        self.static = DecodeInputs.allocate(self.batch_sizes[-1], max_num_blocks, self.device)
        self._replays: dict[int, Replay] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # torch.cuda.graph_pool_handle(), made at the first capture unless given: runners whose
        # graphs never replay at once may share one (the base and LoRA decode graphs do)
        self._pool: Any = pool

    @property
    def pool(self) -> Any:
        return self._pool

    @property
    def captured(self) -> list[int]:
        return sorted(self._replays)

    def capture(self) -> None:
        """Capture one graph per bucket, largest first so the smaller ones reuse its memory."""
        if self.enforce_eager:
            return
        with torch.no_grad():
            for bucket in reversed(self.batch_sizes):
                self._replays[bucket], self._outputs[bucket] = self._capture_one(bucket)

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        context_lens: torch.Tensor,  # [B] int32
        slot_mapping: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:  # [B, ...]
        inputs = DecodeInputs(input_ids, positions, slot_mapping, block_tables, context_lens)
        bucket = select_bucket(inputs.batch_size, self.captured)
        if self.enforce_eager or bucket is None:
            return self.forward(input_ids, positions, decode_metadata(inputs))
        self.static.fill(inputs, bucket)
        self._replays[bucket]()
        return self._outputs[bucket][: inputs.batch_size]

    def _capture_one(self, bucket: int) -> tuple[Replay, torch.Tensor]:
        """Warm up on a side stream (compiles the Triton kernels), then capture ``forward`` over
        the first ``bucket`` rows of the static buffers."""
        inputs = self.static.rows(bucket)
        metadata = decode_metadata(inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.num_warmups):
                self.forward(inputs.input_ids, inputs.positions, metadata)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.forward(inputs.input_ids, inputs.positions, metadata)
        torch.cuda.synchronize(self.device)
        return graph.replay, output
