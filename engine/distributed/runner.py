"""The tensor-parallel model runner: the driver's (rank 0, in the engine's process) and the
helpers' (ranks 1..N-1, each in its own process, ``helper.py``).

Each step the driver sends every helper the step's scheduler output once, as deltas of what it
sent before (``StepMessage``: the tokens a helper has not seen yet, the block-table changes, the
requests gone), vLLM's design: the scheduler output, never tensors a rank can derive. Then every
rank builds the same flat batch and runs the same forward over its share of the model; the
collectives inside (``sharding.py``) keep them in lockstep, and the driver samples from the
gathered logits. A rank that dies makes a collective fail: the driver's step raises
``RankFailure`` and the helpers left are stopped.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.core.request import Request
from engine.distributed.group import RankFailure, TPGroup
from engine.distributed.helper import (
    STORE_TIMEOUT,
    HelperHandle,
    start_helpers,
    stop_helpers,
    wait_joined,
)
from engine.distributed.sharding import (
    RowParallelLinear,
    ShardPlan,
    reduce_after_lora,
    shard_model,
)
from engine.distributed.step_message import (
    HeldRequests,
    ScoreMessage,
    StepMessage,
    StepMessages,
)
from engine.distributed.weights import iter_shard_weights
from engine.layers.linear import (
    pack_linear_weights,
    packing_gemm,
)
from engine.layers.moe import held_experts
from engine.lora.adapter import ShardLoRA
from engine.lora.layers import lora_batch
from engine.models.causal_lm import CausalLM
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.no_init import no_init_weights
from engine.models.olmoe import OlmoeForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.models.registry import get_model_class
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.runner.base import Runner
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.device import resolve_device
from engine.runner.input_batch import InputBatch, build_input_batch
from engine.runner.model_runner import ModelRunner

# The families whose layers shard_model splits (SelfAttention, GatedMLP, a plain embedding and
# output layer): soft-caps, sandwich norms and windowed layers act on a rank's own heads or on
# the gathered logits.
TP_FAMILIES = (LlamaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM,
               MixtralForCausalLM, OlmoeForCausalLM, GptOssForCausalLM)

# How long the driver waits for a dead helper's exit code after a failed collective.
_REAP_SECONDS = 2.0


class TPModelRunner(ModelRunner):
    """A ``ModelRunner`` over this rank's share of the model (``sharding.py``)."""

    head_is_split = True

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int,
                 group: TPGroup, plan: ShardPlan, helpers: list[HelperHandle]) -> None:
        self.group = group
        self.plan = plan
        self.helpers = helpers
        self._messages = StepMessages()
        self._failed: BaseException | None = None
        self._store: dist.Store | None = None  # the driver's: the ranks' rendezvous
        self._held = HeldRequests()  # a helper's copy of the requests, from the messages
        super().__init__(config, checkpoint, max_position)
        if helpers:
            self._finalizer = weakref.finalize(self, stop_helpers, helpers)

    # ---- building ---------------------------------------------------------------------------

    @classmethod
    def start_driver(cls, config: EngineConfig, checkpoint: Checkpoint,
                     max_position: int) -> TPModelRunner:
        """Rank 0: start the helper ranks, build this rank's share, wait until they have
        theirs."""
        world_size = config.tensor_parallel_size
        plan = ShardPlan.of(checkpoint.config, 0, world_size,  # bad sizes fail before a spawn
                            expert_parallel=config.expert_parallel)
        _check_family(checkpoint)
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)
        helpers = start_helpers(config, world_size, store.port, max_position, cls)
        try:
            wait_joined(store, helpers)
            group = TPGroup(store, 0, world_size, device)
            runner = cls(config, checkpoint, max_position, group, plan, helpers)
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

    def _build_model(self, checkpoint: Checkpoint, max_position: int) -> CausalLM:
        """This rank's share: the family class at the local sizes, its row-parallel and
        vocabulary layers joined by collectives, its slices read from the checkpoint."""
        model_cls = _check_family(checkpoint)
        local_config = self.plan.local_config(checkpoint.config)
        held = self.plan.held_experts
        with (torch.device(self.device), no_init_weights(),
              held_experts(*held) if held is not None else nullcontext()):
            model = model_cls(local_config, max_position)
        model.to(dtype=self.dtype)
        model.keep_fp32()
        shard_model(model, self.plan, self.group)
        model.load_weights(iter_shard_weights(checkpoint, self.plan, self.dtype))
        return model

    def _lora_shard(self) -> ShardLoRA:
        """An adapter's share on this rank, split as its module's base weight is: B's rows
        for a column-parallel projection (q/k/v, gate/up: A whole), A's columns for a
        row-parallel one (o, down: B whole, the delta a partial sum like the product)."""
        plan = self.plan

        def shard(module: str, a: torch.Tensor, b: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
            rows = plan.row_slices(f"{module}.weight")
            if rows is not None:
                b = torch.cat([b[start:start + length] for start, length in rows])
            columns = plan.column_slice(f"{module}.weight")
            if columns is not None:
                a = a[:, columns[0]:columns[0] + columns[1]]
            return a, b

        return shard

    def _enable_lora(self, checkpoint: Checkpoint) -> None:
        """As one device's, then: a row-parallel projection's LoRA delta joins its product
        before the all-reduce (``RowParallelLoRALinear``), and adapters are fixed at start
        (every rank reads its share of each)."""
        super()._enable_lora(checkpoint)
        assert self.lora is not None
        for linear in self.lora.linears:
            if isinstance(linear.base, RowParallelLinear):
                reduce_after_lora(linear, self.group)
        self.lora.fixed_reason = ("tensor_parallel_size > 1 serves the adapters registered at "
                                  "start (every rank reads its share): restart with it in "
                                  "lora_modules")

    def _pack_weights(self) -> None:
        """Pack the shares' linear weights; no greedy screen (it wants the whole output
        layer: the gathered logits give the argmax instead)."""
        gemm = packing_gemm(self.dtype, self.config.cpu_gemm)
        if gemm is None:
            return
        head = self.model.lm_head.weight
        pack_linear_weights(self.model,
                            shared={id(head)} if self.model.tie_word_embeddings else set(),
                            gemm=gemm)
        self.packed_weights = True

    def capture_decode_graphs(self, runner_cls: type[CUDAGraphRunner] = CUDAGraphRunner
                              ) -> None:
        """Eager: the step's collectives are not captured."""

    # ---- the driver ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput,
                requests: dict[str, Request]) -> ModelRunnerOutput:
        self._check_alive()
        message = self._messages.step(self._ordered(scheduler_output, requests), requests)
        try:
            self._send(message)
            return super().execute(scheduler_output, requests)
        except BaseException as error:
            raise self._fail(error) from error

    def score_tokens(self, token_ids: list[int]) -> torch.Tensor:
        self._check_alive()
        try:
            self._send(ScoreMessage(list(token_ids)))
            return super().score_tokens(token_ids)
        except ValueError:
            raise  # bad input, refused on every rank before any collective
        except BaseException as error:
            raise self._fail(error) from error

    def close(self) -> None:
        """Stop the helper ranks (their shards go with their processes)."""
        stop_helpers(self.helpers)

    def _send(self, message: StepMessage | ScoreMessage) -> None:
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
        """A helper's loop: run each step the driver sends until it says stop or is gone."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return  # the driver is gone
            if message is None:
                return
            with torch.inference_mode():
                if isinstance(message, StepMessage):
                    self._helper_step(message)
                else:
                    try:
                        ModelRunner.score_tokens(self, message.token_ids)
                    except ValueError:
                        pass  # the driver refused it too, before any collective

    def _helper_step(self, message: StepMessage) -> None:
        rows = self._held.apply(message)
        batch = build_input_batch(rows, self.block_size, self.device,
                                  with_window=self.kv_window is not None)
        lora = None
        if self.lora is not None:  # the driver's segments: its rows, decodes first
            flat = ([d for d in message.rows if d.num_new_tokens == 1]
                    + [d for d in message.rows if d.num_new_tokens > 1])
            lora = self.lora.step_batch([(d.lora_name, d.num_new_tokens) for d in flat])
        with lora_batch(lora):
            hidden = self._forward(batch)
        if batch.sample_indices:  # the driver samples; the gather needs every rank
            index = torch.tensor(batch.sample_indices, dtype=torch.int64, device=self.device)
            self.model.compute_logits(hidden.index_select(0, index))

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        metadata = batch.metadata
        self.attn.prepare(metadata)
        if metadata.window is not None:
            self.attn.prepare(metadata.window)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, self.attn, metadata)


def _check_family(checkpoint: Checkpoint) -> type[CausalLM]:
    model_cls = get_model_class(checkpoint.config)
    if not issubclass(model_cls, TP_FAMILIES):
        raise ValueError(f"tensor_parallel_size > 1 is implemented for the Llama family "
                         f"(Llama, Mistral, Qwen2, Qwen3, Phi-3), Gemma 2 and 3 and the "
                         f"mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and "
                         f"gpt-oss, not {model_cls.__name__}")
    return model_cls


if TYPE_CHECKING:
    def _is_a_runner(runner: TPModelRunner) -> Runner:
        return runner  # mypy: TPModelRunner satisfies the Protocol
