"""PersistentBatch: the running requests' block tables kept across steps, changed by the diff.

vLLM v1's persistent batch in this engine's terms. Each running request holds a slot: a row of
``block_table`` (and of ``window_table`` where the windowed layers have their own,
``engine/core/window_kv.py``) and its block counts. A step applies only what changed since the
slot was last written, then gathers its tables (and its sampled rows' sampling parameters,
``sampling_columns.py``) with one numpy index over its slots; positions,
slot mapping, context lengths and sample indices come from ``input_batch.lay_out``, the code
``build_input_batch`` lays a batch out with, so both give the same batch.

How each change to a request's tables (``engine/core/kv_cache_manager.py``) is seen here:

* ``allocate_slots`` only appends to ``block_ids`` (the prefix-cache hit at admission, then new
  blocks as the request grows): the slot appends the tail past its count.
* ``free`` (finished, aborted, preempted) gives the request a new, empty ``block_ids`` list: a
  slot holding another list than the request's is rewritten (a preempted request back with
  new blocks), and a slot holding another request than the one under its id (an id reused
  after a finish) is freed and the request gets a new one.
* ``WindowBlocks.release_behind`` sets the windowed table's blocks behind the window to the
  null block in place, always a prefix of the table: the slot follows its leading null blocks.

A slot whose request is not scheduled in a step and no longer running (finished, aborted,
preempted) is freed in that step; one that skips a step while running keeps its blocks. The
step's arrays are copies (numpy fancy indexing), so a step in flight (async scheduling) never
reads a row the next step's diff writes.

The input ids are read from the requests' token lists, one index a decode: the host's copy of
the sampled tokens, which crosses once a step for the outputs anyway. With async scheduling a
decode whose token the step in flight samples is overwritten on the device from that step's
sampled-token tensor, which never comes back from the host (``step_pipeline.py``, issue 46,
item 3).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.core.request import Request, RequestStatus
from engine.core.window_kv import NULL_BLOCK
from engine.outputs import ScheduledRequest
from engine.runner.input_batch import InputBatch, batch_order, lay_out
from engine.runner.sampling_columns import NUM_FIELDS, SamplingColumns, row_of


class PersistentBatch:
    """The runner's slots: one a running request, its block tables a numpy row each
    (``num_slots`` and ``max_num_blocks`` are where they start; both grow as needed)."""

    def __init__(self, block_size: int, with_window: bool, num_slots: int = 64,
                 max_num_blocks: int = 16) -> None:
        self.block_size = block_size
        self.with_window = with_window
        num_slots = max(num_slots, 1)
        # [num_slots, max_num_blocks] int32 each; entries past a slot's count are block 0
        self.block_table = np.zeros((num_slots, max(max_num_blocks, 1)), dtype=np.int32)
        self.window_table = np.zeros_like(self.block_table) if with_window else None
        # [num_slots] int64: the blocks each slot's table holds (0 for a free slot)
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)
        self.num_window_blocks = np.zeros(num_slots, dtype=np.int64)
        self.occupied = np.zeros(num_slots, dtype=bool)
        # [num_slots, NUM_FIELDS] float64: each slot's request's sampling parameters, written
        # when it takes the slot (``sampling_columns.py``)
        self.sampling = np.zeros((num_slots, NUM_FIELDS))
        # Per slot, read one at a time (a Python list is ~5x faster than numpy at that): its
        # request, the block lists it was written from, the counts, the window's null prefix.
        self._requests: list[Request | None] = [None] * num_slots
        self._block_lists: list[list[int] | None] = [None] * num_slots
        self._window_lists: list[list[int] | None] = [None] * num_slots
        self._num_blocks = [0] * num_slots
        self._num_window_blocks = [0] * num_slots
        self._num_nulled = [0] * num_slots
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped lowest first

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    def prepare(self, scheduled: list[ScheduledRequest], requests: dict[str, Request],
                device: torch.device) -> tuple[InputBatch, list[Request], SamplingColumns]:
        """The step's flat batch of ``scheduled`` on ``device`` (what ``build_input_batch``
        gives for the same rows), the requests that sample, in its sample order, and their
        sampling columns (what ``SamplingColumns.of`` gives for them)."""
        count = len(scheduled)
        reqs = [requests[s.request_id] for s in scheduled]
        slots = np.fromiter(map(self._update, reqs), dtype=np.int64, count=count)
        self._free_unscheduled(slots)
        for i in np.flatnonzero(slots < 0).tolist():
            slots[i] = self._add(reqs[i])
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64,
                                 count=count)
        order = batch_order(query_lens)
        ordered_slots = slots[order]
        tables = [_gather(self.block_table, self.num_blocks, ordered_slots)]
        if self.window_table is not None:
            tables.append(_gather(self.window_table, self.num_window_blocks, ordered_slots))
        batch = lay_out(
            [r.token_ids for r in reqs],
            np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=count),
            query_lens, np.fromiter((s.sample for s in scheduled), dtype=bool, count=count),
            order, tables, self.block_size, device)
        columns = SamplingColumns(self.sampling[slots[batch.sample_rows]])
        return batch, [reqs[i] for i in batch.sample_rows], columns

    # ---- the diff -----------------------------------------------------------------------------

    def _update(self, request: Request) -> int:
        """The slot of a request seen before, brought up to date; -1 for one to add."""
        slot = self._slot_of.get(request.request_id)
        if slot is None:
            return -1
        if self._requests[slot] is not request:  # the id's earlier request finished
            self._free(slot)
            return -1
        blocks = request.block_ids
        num_blocks = len(blocks)
        if self._block_lists[slot] is not blocks or num_blocks < self._num_blocks[slot]:
            self._write(slot, request)  # freed (preempted) and allocated again
            return slot
        if num_blocks > self._num_blocks[slot]:
            self._append(slot, blocks)
        if self.with_window:
            window = request.window_block_ids
            if (self._window_lists[slot] is not window
                    or len(window) < self._num_window_blocks[slot]):
                self._write(slot, request)
                return slot
            self._append_window(slot, window)
        return slot

    def _free_unscheduled(self, slots: np.ndarray) -> None:
        """Free the slots of the requests not in the step that are no longer running."""
        unscheduled = self.occupied.copy()
        unscheduled[slots[slots >= 0]] = False
        for slot in np.flatnonzero(unscheduled).tolist():
            request = self._requests[slot]
            assert request is not None  # (an occupied slot)
            if request.status is not RequestStatus.RUNNING:
                self._free(slot)

    def _add(self, request: Request) -> int:
        if not self._free_slots:
            self._grow_slots()
        slot = self._free_slots.pop()
        self._slot_of[request.request_id] = slot
        self.occupied[slot] = True
        self.sampling[slot] = row_of(request)
        self._write(slot, request)
        return slot

    def _free(self, slot: int) -> None:
        request = self._requests[slot]
        assert request is not None
        del self._slot_of[request.request_id]
        self._requests[slot] = self._block_lists[slot] = self._window_lists[slot] = None
        self._clear(slot)
        self.occupied[slot] = False
        self._free_slots.append(slot)

    def _clear(self, slot: int) -> None:
        """Back to block 0 and counts of 0, so a gather pads the slot's row with block 0."""
        self.block_table[slot, : self._num_blocks[slot]] = 0
        self._num_blocks[slot] = 0
        self.num_blocks[slot] = 0
        if self.window_table is not None:
            self.window_table[slot, : self._num_window_blocks[slot]] = 0
            self._num_window_blocks[slot] = 0
            self.num_window_blocks[slot] = 0
            self._num_nulled[slot] = 0

    def _write(self, slot: int, request: Request) -> None:
        """The slot written whole from the request's tables."""
        self._clear(slot)
        self._requests[slot] = request
        self._block_lists[slot] = request.block_ids
        self._append(slot, request.block_ids)
        if self.with_window:
            self._window_lists[slot] = request.window_block_ids
            self._append_window(slot, request.window_block_ids)

    def _append(self, slot: int, blocks: list[int]) -> None:
        start, end = self._num_blocks[slot], len(blocks)
        self._fit(end)
        self.block_table[slot, start:end] = blocks[start:]
        self._num_blocks[slot] = end
        self.num_blocks[slot] = end

    def _append_window(self, slot: int, window: list[int]) -> None:
        """The windowed table's new blocks, then the blocks behind the window set to the null
        block since (a prefix of the table, so the scan stops at its first real block)."""
        start, end = self._num_window_blocks[slot], len(window)
        self._fit(end)
        table = self.window_table
        assert table is not None
        if end > start:
            table[slot, start:end] = window[start:]
            self._num_window_blocks[slot] = end
            self.num_window_blocks[slot] = end
        nulled = first = self._num_nulled[slot]
        while nulled < end and window[nulled] == NULL_BLOCK:
            nulled += 1
        if nulled > first:
            table[slot, first:nulled] = NULL_BLOCK
            self._num_nulled[slot] = nulled

    # ---- capacity -----------------------------------------------------------------------------

    def _fit(self, num_blocks: int) -> None:
        """Widen the tables to hold ``num_blocks`` blocks a row (doubling)."""
        width = self.block_table.shape[1]
        if num_blocks <= width:
            return
        width = max(2 * width, num_blocks)
        self.block_table = _resized(self.block_table, self.block_table.shape[0], width)
        if self.window_table is not None:
            self.window_table = _resized(self.window_table, self.window_table.shape[0], width)

    def _grow_slots(self) -> None:
        old = self.block_table.shape[0]
        new = 2 * old
        width = self.block_table.shape[1]
        self.block_table = _resized(self.block_table, new, width)
        if self.window_table is not None:
            self.window_table = _resized(self.window_table, new, width)
        self.num_blocks = np.concatenate((self.num_blocks, np.zeros(old, dtype=np.int64)))
        self.num_window_blocks = np.concatenate((self.num_window_blocks,
                                                 np.zeros(old, dtype=np.int64)))
        self.occupied = np.concatenate((self.occupied, np.zeros(old, dtype=bool)))
        self.sampling = np.concatenate((self.sampling, np.zeros((old, NUM_FIELDS))))
        for per_slot in (self._requests, self._block_lists, self._window_lists):
            per_slot.extend([None] * old)
        for counts in (self._num_blocks, self._num_window_blocks, self._num_nulled):
            counts.extend([0] * old)
        self._free_slots.extend(range(new - 1, old - 1, -1))


def _resized(table: np.ndarray, num_rows: int, width: int) -> np.ndarray:
    grown = np.zeros((num_rows, width), dtype=table.dtype)
    grown[: table.shape[0], : table.shape[1]] = table
    return grown


def _gather(table: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The slots' rows, as wide as the longest (at least 1): a copy."""
    width = max(int(counts[slots].max()) if len(slots) else 0, 1)
    return table[slots, :width]
