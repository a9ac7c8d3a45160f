"""The ranks' collectives: one all-reduce per row-parallel layer, one all-gather for the logits.

A process group is built straight from a ``TCPStore`` (no ``init_process_group``), so a process
may hold several engines' groups one after another and nothing global is set. Every collective
waits at most ``timeout``: a peer that dies mid-step makes it raise (gloo notices the closed
socket at once; NCCL's watchdog at the timeout) instead of hanging the worker.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

# How long one collective may wait for its peers. A step is seconds at most; a rank that has not
# joined by then is dead or wedged, and the worker should fail rather than wait on it.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def collective_timeout() -> timedelta:
    """``COLLECTIVE_TIMEOUT``, read when a group is built (a test shortens it)."""
    return COLLECTIVE_TIMEOUT


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot step any more."""


class TPGroup:
    """This rank's place among ``world_size`` ranks and their collectives.

    With ``timed`` set, ``reduce_seconds`` / ``num_reduces`` count the time spent in the
    all-reduces (``bench/tp.py`` prints their share of a step); on CUDA timing synchronizes the
    device around each one, so it is off unless asked for."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device,
                 timeout: timedelta | None = None) -> None:
        timeout = timeout or collective_timeout()
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timed = False
        self.reduce_seconds = 0.0
        self.num_reduces = 0
        if device.type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise ValueError("tensor_parallel_size > 1 on CUDA needs a torch built with NCCL")
            options = nccl.Options()
            options._timeout = timeout
            self._group = nccl(store, rank, world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if not self.timed:
            self._group.allreduce([tensor]).wait()
            return tensor
        cuda = tensor.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(tensor.device)
        start = time.perf_counter()
        self._group.allreduce([tensor]).wait()
        if cuda:
            torch.cuda.synchronize(tensor.device)
        self.reduce_seconds += time.perf_counter() - start
        self.num_reduces += 1
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on each), in rank order."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._group.allgather([out], [tensor]).wait()
        return out
