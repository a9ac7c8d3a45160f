"""The plumbing a tensor-parallel runner shares, whatever it runs: the driver starts the helper
ranks and sends each of them every step's message; a failed step names the rank that died (or
says every rank was alive) and stops the others, loudly; a helper serves the messages until the
driver says stop or is gone. ``TPModelRunner`` (generation) and ``TPPoolingRunner``
(embeddings) mix it in over their one-device runners."""

from __future__ import annotations

import time
import weakref
from multiprocessing.connection import Connection
from typing import Any, Self

import torch
import torch.distributed as dist

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.distributed.group import RankFailure, TPGroup
from engine.distributed.helper import (
    STORE_TIMEOUT,
    HelperHandle,
    start_helpers,
    stop_helpers,
    wait_joined,
)
from engine.distributed.sharding import ShardPlan
from engine.runner.device import resolve_device

# How long the driver waits for a dead helper's exit code after a failed collective.
_REAP_SECONDS = 2.0


class Ranks:
    """Mixed into a runner whose ``__init__(config, checkpoint, max_position, group, plan,
    helpers)`` calls ``join_ranks`` first, then builds its share."""

    group: TPGroup
    plan: ShardPlan
    helpers: list[HelperHandle]
    num_kv_blocks: int

    def join_ranks(self, group: TPGroup, plan: ShardPlan, helpers: list[HelperHandle]) -> None:
        self.group = group
        self.plan = plan
        self.helpers = helpers
        self._failed: BaseException | None = None
        self._store: dist.Store | None = None  # the driver's: the ranks' rendezvous
        if helpers:
            self._finalizer = weakref.finalize(self, stop_helpers, helpers)

    @staticmethod
    def check_checkpoint(checkpoint: Checkpoint) -> None:
        """ValueError for a checkpoint this runner cannot split (before any spawn)."""

    def serve_one(self, message: Any) -> None:
        """A helper's part of one message from the driver."""
        raise NotImplementedError

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def start_driver(cls, config: EngineConfig, checkpoint: Checkpoint,
                     max_position: int) -> Self:
        """Rank 0: start the helper ranks, build this rank's share, wait until they have
        theirs."""
        world_size = config.tensor_parallel_size
        cls.check_checkpoint(checkpoint)
        plan = ShardPlan.of(checkpoint.config, 0, world_size,  # bad sizes fail before a spawn
                            expert_parallel=config.expert_parallel)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)
        helpers = start_helpers(config, world_size, store.port, max_position,
                                cls)  # type: ignore[arg-type]
        try:
            wait_joined(store, helpers)
            group = TPGroup(store, 0, world_size, device)
            runner = cls(config, checkpoint, max_position, group, plan,  # type: ignore[call-arg]
                         helpers)
            for helper in helpers:
                num_blocks = helper.wait_ready()
                if num_blocks != runner.num_kv_blocks:
                    raise RankFailure(f"rank {helper.rank} sized its KV cache at {num_blocks} "
                                      f"blocks, the driver at {runner.num_kv_blocks}")
        except BaseException:
            stop_helpers(helpers)
            raise
        runner._store = store  # kept as long as the group
        return runner

    # ---- the driver ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the helper ranks (their shards go with their processes)."""
        stop_helpers(self.helpers)

    def _send(self, message: object) -> None:
        for helper in self.helpers:
            helper.conn.send(message)

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise RankFailure("the tensor-parallel ranks stopped after a failed step") \
                from self._failed
        for helper in self.helpers:
            if helper.process.exitcode is not None:
                raise self._fail(RankFailure(helper.describe_exit()))

    def _fail(self, error: BaseException) -> BaseException:
        """After a failed step: name the dead rank if one died, and kill the others (a step
        half done leaves the ranks out of step: the engine cannot go on)."""
        self._failed = error
        collective = isinstance(error, RankFailure | RuntimeError | OSError)
        deadline = time.monotonic() + (_REAP_SECONDS if collective else 0.0)
        dead = None
        while True:
            dead = next((h for h in self.helpers if h.process.exitcode is not None), None)
            if dead is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        stop_helpers(self.helpers, kill=True)
        if isinstance(error, RankFailure):
            return error
        if dead is not None:
            return RankFailure(dead.describe_exit())
        if collective:
            return RankFailure(f"a tensor-parallel step failed with every rank alive (one "
                               f"stopped answering, or the driver broke): "
                               f"{type(error).__name__}: {error}")
        return error

    # ---- a helper -----------------------------------------------------------------------------

    def serve(self, conn: Connection) -> None:
        """A helper's loop: run each message the driver sends until it says stop or is gone."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the driver is gone
            if message is None:
                return
            with torch.inference_mode():
                self.serve_one(message)
