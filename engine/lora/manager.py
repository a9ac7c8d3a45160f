"""LoRAManager: the registered adapters, the loaded ones (an LRU), and each step's LoRA rows.

Adapters are registered by name (``EngineConfig.lora_modules``, or ``add_adapter`` later) and
every one is read and checked when it is registered, so a bad folder fails at start. Up to
``max_cpu_loras`` stay loaded; one used again after it was dropped is read again. On the GPU
path the adapters of a step also sit in one of ``max_loras`` slots of the per-layer stacks that
the Triton kernels read; a slot keeps its adapter until another adapter needs it (least recently
used first), so a step reuses the adapters the last step had without copying.

The scheduler keeps a step's distinct adapters at ``max_loras`` or fewer (``Scheduler``), so
both the LRU and the slots always hold every adapter of the step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType

import torch

from engine.config import EngineConfig
from engine.errors import LoRAError
from engine.lora.adapter import LoRAAdapter, ShardLoRA, load_adapter
from engine.lora.layers import LoRABatch, LoRALinear, LoRASegment, LoRATarget


class LoRAManager:
    def __init__(self, config: EngineConfig, linears: list[LoRALinear],
                 targets: dict[str, LoRATarget], *, dtype: torch.dtype, device: torch.device,
                 base_names: set[str], stacked: bool, kernel: ModuleType | None = None,
                 shard: ShardLoRA | None = None) -> None:
        self.linears = linears
        self.shard = shard  # tensor parallel: each adapter's share on this rank
        # Why an adapter cannot be added while the engine runs (None: it can).
        self.fixed_reason: str | None = None
        self.targets = targets
        self.dtype = dtype
        self.device = device
        self.base_names = base_names
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.stacked = stacked
        self.kernel = kernel  # the CPU kernels' module: short segments loop in C++
        self.paths: dict[str, str] = {}
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, LRU first
        self.num_loads = 0
        self.num_slot_writes = 0
        # The captured decode graphs' segment table: start, length and slot rows, one column a
        # slot (``graph_batch``; written before each replay by ``write_graph_segments``).
        self.graph_table: torch.Tensor | None = None
        if stacked:
            for linear in linears:
                linear.allocate_stacks(self.max_loras, self.max_rank, dtype, device)
        for name, path in config.lora_paths.items():
            self.add_adapter(name, path)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def add_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Register (or re-register) ``name``; its folder is read and checked now."""
        if not name or name in self.base_names:
            raise LoRAError(name, "an adapter needs a name other than the base model's")
        if self.fixed_reason is not None:
            raise LoRAError(name, self.fixed_reason)
        adapter = self._load(name, path)
        self.paths[name] = path
        self.slots.pop(name, None)  # a re-registered adapter's slot holds the old weights
        self._remember(adapter)
        return adapter

    def check(self, name: str) -> None:
        """LoRAError unless ``name`` is registered (``add_request`` calls it)."""
        if name not in self.paths:
            raise LoRAError(name, f"not registered; registered adapters: "
                                  f"{', '.join(self.paths) or '(none)'}")

    def get(self, name: str) -> LoRAAdapter:
        """The loaded adapter, read again if the LRU dropped it."""
        adapter = self.loaded.get(name)
        if adapter is None:
            self.check(name)
            adapter = self._load(name, self.paths[name])
            self._remember(adapter)
        else:
            self.loaded.move_to_end(name)
        return adapter

    def _load(self, name: str, path: str) -> LoRAAdapter:
        self.num_loads += 1
        return load_adapter(name, path, targets=self.targets, linears=self.linears,
                            max_rank=self.max_rank, base_names=self.base_names,
                            dtype=self.dtype, shard=self.shard)

    def _remember(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)

    def step_batch(self, rows: Sequence[tuple[str | None, int]]) -> LoRABatch | None:
        """The step's LoRA segments from its flat rows in order: (adapter or None, row count)
        runs, a scheduled request's or several's (adjacent runs of one adapter make one
        segment). None when no row has an adapter (the base-only step)."""
        segments: list[LoRASegment] = []
        adapters: dict[str, LoRAAdapter] = {}
        start = 0
        for name, num_rows in rows:
            end = start + num_rows
            if name is not None:
                last = segments[-1] if segments else None
                if last is not None and last.end == start and last.adapter == name:
                    last.end = end
                else:
                    adapter = adapters.get(name) or self.get(name)
                    adapters[name] = adapter
                    segments.append(LoRASegment(start, end, name, adapter.modules))
            start = end
        if not segments:
            return None
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step has {len(adapters)} adapters, above max_loras="
                               f"{self.max_loras} (the scheduler must keep it there)")
        batch = LoRABatch(segments, num_rows=sum(s.end - s.start for s in segments),
                          kernel=self.kernel)
        if self.stacked:
            slot_of = self._activate(adapters)
            for segment in segments:
                segment.slot = slot_of[segment.adapter]
            batch.stacked = True
            # one host-to-device copy: start, length and slot rows
            batch.seg_table = torch.tensor([[s.start for s in segments],
                                            [s.end - s.start for s in segments],
                                            [s.slot for s in segments]],
                                           dtype=torch.int32, device=self.device)
            batch.max_seg_len = max(s.end - s.start for s in segments)
        return batch

    def graph_batch(self, num_rows: int) -> LoRABatch:
        """The LoRA rows a captured decode graph of ``num_rows`` rows reads: ``max_loras``
        segments from ``graph_table``, row tiles over every row. A decode step's rows are
        grouped by adapter, so its segments number at most ``max_loras``; unused ones have
        length 0, and their programs return at once."""
        if not self.stacked:
            raise RuntimeError("graph_batch is the stacked (GPU) path's")
        if self.graph_table is None:
            self.graph_table = torch.zeros(3, self.max_loras, dtype=torch.int32,
                                           device=self.device)
        return LoRABatch([], stacked=True, seg_table=self.graph_table, max_seg_len=num_rows,
                         num_rows=num_rows)

    def write_graph_segments(self, batch: LoRABatch) -> None:
        """Put a decode step's segments (``step_batch``'s) into the graphs' table."""
        if self.graph_table is None:
            raise RuntimeError("no graph was captured with LoRA (graph_batch)")
        if len(batch.segments) > self.max_loras:
            raise RuntimeError(f"{len(batch.segments)} segments, above max_loras="
                               f"{self.max_loras}")
        assert batch.seg_table is not None
        num = batch.seg_table.shape[1]
        self.graph_table[:, :num].copy_(batch.seg_table)
        self.graph_table[:, num:].zero_()

    def _activate(self, adapters: dict[str, LoRAAdapter]) -> dict[str, int]:
        """Give each of the step's adapters a slot, writing those not already in one."""
        for name in adapters:
            if name in self.slots:
                self.slots.move_to_end(name)
        for name, adapter in adapters.items():
            if name in self.slots:
                continue
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slots if n not in adapters)
                slot = self.slots.pop(victim)
            for linear in self.linears:
                linear.write_slot(slot, adapter.modules[linear.index])
            self.num_slot_writes += 1
            self.slots[name] = slot
        return {name: self.slots[name] for name in adapters}
