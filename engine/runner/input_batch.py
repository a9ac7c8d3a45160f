"""One step's flat batch: input ids, positions, slot mapping and block tables of every request.

Decodes (one token each) come first, then the prefill chunks back to back (the layout
``AttentionMetadata`` describes). Built from ``StepRow``s, so the engine's steps and one-off
passes such as ``ModelRunner.score_tokens`` go through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.attention_metadata import AttentionMetadata


@dataclass
class StepRow:
    """What a step needs of one request: its tokens, its block tables and its share."""

    token_ids: list[int]
    block_ids: list[int]
    window_block_ids: list[int] | None  # the windowed layers' table, if they have their own
    num_computed_tokens: int
    num_new_tokens: int
    sample: bool


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_indices: list[int]  # the token row each sampling request samples from
    sample_rows: list[int]  # which of the given rows sample, in sample_indices' order


def _block_table(rows: list[list[int]]) -> torch.Tensor:
    """``rows`` padded with block 0 to the longest: one tensor built from one list (a tensor
    a row cost ~4 us each, a millisecond a step at 256 requests)."""
    width = max(max((len(r) for r in rows), default=0), 1)
    if not rows:
        return torch.zeros(0, width, dtype=torch.int32)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def _slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_input_batch(rows: list[StepRow], block_size: int, device: torch.device,
                      with_window: bool = False) -> InputBatch:
    """The flat batch of ``rows`` (decodes are the rows with one new token)."""
    order = ([i for i, r in enumerate(rows) if r.num_new_tokens == 1]
             + [i for i, r in enumerate(rows) if r.num_new_tokens > 1])
    num_decodes = sum(1 for r in rows if r.num_new_tokens == 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    window_slots: list[int] = []
    tables: list[list[int]] = []
    window_tables: list[list[int]] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    sample_indices: list[int] = []
    sample_rows: list[int] = []
    for i in order:
        row = rows[i]
        start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_new_tokens
        input_ids.extend(row.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(_slots(row.block_ids, start, end, block_size))
        tables.append(row.block_ids)
        if with_window:
            window_blocks = row.window_block_ids or []
            window_slots.extend(_slots(window_blocks, start, end, block_size))
            window_tables.append(window_blocks)
        context_lens.append(end)
        query_lens.append(row.num_new_tokens)
        if row.sample:
            sample_indices.append(len(input_ids) - 1)
            sample_rows.append(i)

    def metadata(slot_mapping: list[int], block_tables: list[list[int]]) -> AttentionMetadata:
        query_start = [0]
        for n in query_lens[num_decodes:]:
            query_start.append(query_start[-1] + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_decodes=num_decodes,
            decode_block_tables=_block_table(block_tables[:num_decodes]).to(device),
            decode_context_lens=torch.tensor(context_lens[:num_decodes], dtype=torch.int32,
                                             device=device),
            num_prefills=len(rows) - num_decodes,
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            prefill_block_tables=_block_table(block_tables[num_decodes:]).to(device),
            prefill_context_lens=torch.tensor(context_lens[num_decodes:], dtype=torch.int32,
                                              device=device),
            prefill_query_lens_list=query_lens[num_decodes:],
            prefill_context_lens_list=context_lens[num_decodes:],
            decode_context_lens_list=context_lens[:num_decodes],
        )

    batch_metadata = metadata(slots, tables)
    if with_window:
        batch_metadata.window = metadata(window_slots, window_tables)
    return InputBatch(
        torch.tensor(input_ids, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        batch_metadata, sample_indices, sample_rows,
    )
