"""Runner: what ``LLMEngine`` needs of the side that runs the model, one declared shape.

``ModelRunner`` (one device), ``TPModelRunner`` (the tensor-parallel driver) and
``PoolingModelRunner`` (embedding models: no KV cache, no sampling) satisfy it, and mypy checks
each where it is defined; the engine never asks which one it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.core.request import Request
from engine.lora.manager import LoRAManager
from engine.outputs import ModelRunnerOutput, SchedulerOutput


class Runner(Protocol):
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    num_kv_blocks: int  # 0: the runner keeps no KV cache (a pooling model)
    # (window, blocks) of the sliding-window layers' own pool, where the model has one
    kv_window: tuple[int, int] | None
    kv_cache_seconds: float  # start-up time spent allocating the cache
    lora: LoRAManager | None  # None: LoRA is off

    def execute(self, scheduler_output: SchedulerOutput,
                requests: dict[str, Request]) -> ModelRunnerOutput:
        """Run one scheduled step: sampled tokens for generation rows, vectors for pooling
        rows."""
        ...

