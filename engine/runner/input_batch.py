"""One step's flat batch: input ids, positions, slot mapping and block tables of every request.

Decodes (one token each) come first, then the prefill chunks back to back (the layout
``AttentionMetadata`` describes). ``lay_out`` does it for both ways in: ``build_input_batch``
from ``StepRow``s (one-off passes such as ``ModelRunner.score_tokens``, a tensor-parallel
helper's step) and ``PersistentBatch.prepare`` from the block tables it keeps across the engine's
steps (``persistent_batch.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch

from engine.core.request import Request
from engine.layers.attention_metadata import AttentionMetadata
from engine.outputs import ScheduledRequest
from engine.runner.sampling_columns import SamplingColumns


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

    def to(self, device: torch.device) -> InputBatch:
        """The batch with its tensors on ``device`` (itself when they are on its kind)."""
        if self.input_ids.device.type == device.type:
            return self
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True),
                       positions=self.positions.to(device, non_blocking=True),
                       metadata=_metadata_to(self.metadata, device))


def _metadata_to(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    moved = copy.copy(metadata)
    for f in fields(metadata):
        value = getattr(metadata, f.name)
        if isinstance(value, torch.Tensor):
            setattr(moved, f.name, value.to(device, non_blocking=True))
    moved.extra = {name: t.to(device, non_blocking=True) for name, t in metadata.extra.items()}
    if metadata.window is not None:
        moved.window = _metadata_to(metadata.window, device)
    return moved


@dataclass
class PreparedStep:
    """One step as the host laid it out (``ModelRunner.prepare_step``), ready for the device."""

    scheduled: list[ScheduledRequest]  # in the runner's order (by adapter with LoRA on)
    batch: InputBatch
    sample_requests: list[Request]  # the rows that sample, in the sampled tokens' order
    sampling: SamplingColumns  # their sampling parameters, in that order
    # the flat batch's runs of rows, (adapter or None, rows), in its layout; None: no LoRA
    lora_runs: list[tuple[str | None, int]] | None


def _block_table(rows: list[list[int]]) -> np.ndarray:
    """``rows`` padded with block 0 to the longest, as one ``[len(rows), width]`` int32 array
    filled from one flat array (a tensor a row cost ~4 us each, a millisecond a step at 256
    requests; padded Python lists ~0.4 us a row)."""
    lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = max(int(lens.max()) if len(rows) else 0, 1)
    table = np.zeros((len(rows), width), dtype=np.int32)
    if len(rows):
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=int(lens.sum()))
        table[np.arange(width) < lens[:, None]] = flat
    return table


def batch_order(query_lens: np.ndarray) -> np.ndarray:
    """The rows' indices in the flat batch's order: the decodes (one new token), then the
    prefill chunks, each in the rows' order."""
    return np.concatenate((np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)))


def build_input_batch(rows: list[StepRow], block_size: int, device: torch.device,
                      with_window: bool = False) -> InputBatch:
    """The flat batch of ``rows`` (decodes are the rows with one new token), its block tables
    padded from the rows' lists (``persistent_batch.py`` keeps them across a run's steps)."""
    count = len(rows)
    query_lens = np.fromiter((r.num_new_tokens for r in rows), dtype=np.int64, count=count)
    order = batch_order(query_lens)
    ordered = [rows[i] for i in order.tolist()]
    tables = [_block_table([r.block_ids for r in ordered])]
    if with_window:
        tables.append(_block_table([r.window_block_ids or [] for r in ordered]))
    return lay_out(
        [r.token_ids for r in rows],
        np.fromiter((r.num_computed_tokens for r in rows), dtype=np.int64, count=count),
        query_lens, np.fromiter((r.sample for r in rows), dtype=bool, count=count),
        order, tables, block_size, device)


def lay_out(token_ids: list[list[int]], starts: np.ndarray, query_lens: np.ndarray,
            samples: np.ndarray, order: np.ndarray, tables: list[np.ndarray], block_size: int,
            device: torch.device) -> InputBatch:
    """The flat batch of rows given by their tokens, computed tokens (``starts``), new tokens
    and whether they sample, laid out in ``order`` (``batch_order``). ``tables``: the rows'
    block table, in that order and padded with block 0, then the windowed layers' if they
    have their own.

    Numpy over the batch: positions, slot mapping and context lengths are gathered from the
    padded table, not row by row; only the input ids are read from the rows' token lists."""
    starts = starts[order]
    query_lens = query_lens[order]
    num_decodes = int(np.count_nonzero(query_lens == 1))
    ends = starts + query_lens
    offsets = np.cumsum(query_lens) - query_lens  # each row's first token in the batch
    num_tokens = int(query_lens.sum())
    row_of_token = np.repeat(np.arange(len(order)), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(offsets - starts, query_lens)
    rows = order.tolist()
    input_ids = [token_ids[i][start] for i, start in zip(
        rows[:num_decodes], starts[:num_decodes].tolist(), strict=True)]
    for i, start, end in zip(rows[num_decodes:], starts[num_decodes:].tolist(),
                             ends[num_decodes:].tolist(), strict=True):
        input_ids.extend(token_ids[i][start:end])
    sample_in_order = np.flatnonzero(samples[order])
    sample_indices = (offsets + query_lens - 1)[sample_in_order].tolist()
    sample_rows = order[sample_in_order].tolist()
    context_lens = ends.astype(np.int32)
    num_prefills = len(order) - num_decodes
    query_start = np.zeros(num_prefills + 1, dtype=np.int32)
    np.cumsum(query_lens[num_decodes:], out=query_start[1:])

    def metadata(table: np.ndarray) -> AttentionMetadata:
        slots = (table[row_of_token, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        return AttentionMetadata(
            slot_mapping=_to(slots, device),
            num_decodes=num_decodes,
            decode_block_tables=_to(table[:num_decodes], device),
            decode_context_lens=_to(context_lens[:num_decodes], device),
            num_prefills=num_prefills,
            prefill_query_start_loc=_to(query_start, device),
            prefill_block_tables=_to(table[num_decodes:], device),
            prefill_context_lens=_to(context_lens[num_decodes:], device),
            prefill_query_lens_list=query_lens[num_decodes:].tolist(),
            prefill_context_lens_list=context_lens[num_decodes:].tolist(),
            decode_context_lens_list=context_lens[:num_decodes].tolist(),
        )

    batch_metadata = metadata(tables[0])
    if len(tables) > 1:
        batch_metadata.window = metadata(tables[1])
    return InputBatch(
        _to(np.array(input_ids, dtype=np.int64), device),  # (~2x torch.tensor's speed)
        _to(positions, device),
        batch_metadata, sample_indices, sample_rows,
    )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (shared memory on the CPU: no copy)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
