"""A helper rank's process, and the driver's handle on it.

The driver starts each helper with ``spawn`` (a fresh interpreter: CUDA cannot be forked) and a
pipe. The helper joins the ranks' group through the driver's ``TCPStore``, builds its share of
the model, answers ``ready`` (or the traceback that stopped it) and then runs the steps the pipe
brings. The pipe's end is the driver's: a helper whose driver is gone exits.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.distributed.group import RankFailure

if TYPE_CHECKING:
    from engine.checkpoint.loader import Checkpoint
    from engine.distributed.group import TPGroup
    from engine.distributed.sharding import ShardPlan

# How long a helper may take to load its share before the driver gives up on it.
READY_TIMEOUT_SECONDS = 1800.0
STORE_TIMEOUT = timedelta(seconds=READY_TIMEOUT_SECONDS)


@dataclass
class HelperHandle:
    rank: int
    process: BaseProcess
    conn: Connection

    def describe_exit(self) -> str:
        code = self.process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code}"
        return (f"tensor-parallel rank {self.rank} (pid {self.process.pid}) {how}; "
                "the engine cannot step without it")

    def wait_ready(self) -> int:
        """The helper's KV block count once it has built its share; raises if it failed."""
        waited = 0.0
        while not self.conn.poll(1.0):
            waited += 1.0
            if self.process.exitcode is not None:
                raise RankFailure(self.describe_exit())
            if waited > READY_TIMEOUT_SECONDS:
                raise RankFailure(f"tensor-parallel rank {self.rank} did not load its share "
                                  f"in {READY_TIMEOUT_SECONDS:.0f} s")
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as error:
            raise RankFailure(self.describe_exit()) from error
        if kind == "error":
            raise RankFailure(f"tensor-parallel rank {self.rank} failed to start:\n{value}")
        return int(value)


def wait_joined(store, helpers: list[HelperHandle]) -> None:
    """Wait until every helper has reached the rendezvous (imports done), so that building the
    group, which waits at most the collective timeout, does not wait on a start-up; a helper
    that dies on the way fails this at once."""
    waited = 0.0
    for helper in helpers:
        while not store.check([f"joined/{helper.rank}"]):
            if helper.process.exitcode is not None:
                raise RankFailure(helper.describe_exit())
            if waited > READY_TIMEOUT_SECONDS:
                raise RankFailure(f"tensor-parallel rank {helper.rank} did not start in "
                                  f"{READY_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.05)
            waited += 0.05


class HelperRunner(Protocol):
    """What a helper rank builds and serves: the driver's runner class passes itself in
    (``start_helpers``), so this module never imports the runner that imports it."""

    num_kv_blocks: int

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int,
                 group: TPGroup, plan: ShardPlan, helpers: list[HelperHandle]) -> None: ...

    def serve(self, conn: Connection) -> None: ...


@contextmanager
def _main_script_hidden() -> Iterator[None]:
    """Start processes without the caller's main script.

    ``multiprocessing``'s spawn imports the parent's main script again in each child (as
    ``__mp_main__``), so a script that builds a tensor-parallel engine at its top level, without
    ``if __name__ == "__main__":``, would build it again in every helper, which dies trying to
    spawn while it starts (exit code 1). A helper needs nothing of that script (its target and
    arguments are the engine's), so the spawn sees an empty ``__main__`` instead.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = ModuleType("__main__")  # no __file__, no __spec__: nothing to run
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def start_helpers(config: EngineConfig, world_size: int, port: int, max_position: int,
                  runner_class: type[HelperRunner]) -> list[HelperHandle]:
    context = multiprocessing.get_context("spawn")
    helpers = []
    for rank in range(1, world_size):
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=helper_main,
            args=(config, rank, world_size, port, max_position, runner_class, child_end),
            name=f"boxcar-tp-rank{rank}", daemon=True)
        with _main_script_hidden():
            process.start()
        child_end.close()
        helpers.append(HelperHandle(rank, process, parent_end))
    return helpers


def stop_helpers(helpers: list[HelperHandle], *, kill: bool = False) -> None:
    """Ask each helper to stop, then make sure: terminate what is still there after a moment.
    ``kill``: after a failure, no asking (a helper may be stuck in a collective)."""
    for helper in helpers:
        if kill and helper.process.exitcode is None:
            helper.process.kill()
            continue
        try:
            helper.conn.send(None)
        except (OSError, ValueError):
            pass  # already gone
    for helper in helpers:
        helper.process.join(timeout=5)
        if helper.process.is_alive():
            helper.process.terminate()
            helper.process.join(timeout=5)
        if helper.process.is_alive():
            helper.process.kill()
            helper.process.join()
        helper.conn.close()


def helper_main(config: EngineConfig, rank: int, world_size: int, port: int,
                max_position: int, runner_class: type[HelperRunner], conn: Connection) -> None:
    """The helper process: join, build this rank's share, serve the driver's steps."""
    try:
        import torch
        import torch.distributed as dist

        from engine.checkpoint.loader import load_checkpoint
        from engine.distributed.group import TPGroup
        from engine.distributed.sharding import ShardPlan
        from engine.runner.device import resolve_device

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        device = resolve_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=STORE_TIMEOUT)
        store.set(f"joined/{rank}", "1")
        group = TPGroup(store, rank, world_size, device)
        # the driver has converted a GGUF file already: this finds its folder
        checkpoint = load_checkpoint(config.model, config.tokenizer)
        plan = ShardPlan.of(checkpoint.config, rank, world_size,
                            expert_parallel=config.expert_parallel)
        runner = runner_class(config, checkpoint, max_position, group, plan, [])
        conn.send(("ready", runner.num_kv_blocks))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            raise SystemExit(1)  # noqa: B012
    runner.serve(conn)
