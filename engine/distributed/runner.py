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

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.core.request import Request
from engine.distributed.group import TPGroup
from engine.distributed.helper import (
    HelperHandle,
)
from engine.distributed.ranks import Ranks
from engine.distributed.sharding import (
    RowParallelLinear,
    ShardPlan,
    reduce_after_lora,
    shard_model,
)
from engine.distributed.step_message import (
    HeldRequests,
    RowDelta,
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
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.base import Runner
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.input_batch import InputBatch, build_input_batch
from engine.runner.model_runner import ModelRunner

# The families whose layers shard_model splits (SelfAttention, GatedMLP, a plain embedding and
# output layer): soft-caps, sandwich norms and windowed layers act on a rank's own heads or on
# the gathered logits.
TP_FAMILIES = (LlamaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM,
               MixtralForCausalLM, OlmoeForCausalLM, GptOssForCausalLM)

class TPModelRunner(Ranks, ModelRunner):
    """A ``ModelRunner`` over this rank's share of the model (``sharding.py``)."""

    head_is_split = True

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int,
                 group: TPGroup, plan: ShardPlan, helpers: list[HelperHandle]) -> None:
        self.join_ranks(group, plan, helpers)
        self._messages = StepMessages()
        self._held = HeldRequests()  # a helper's copy of the requests, from the messages
        ModelRunner.__init__(self, config, checkpoint, max_position)

    # ---- building ---------------------------------------------------------------------------

    @staticmethod
    def check_checkpoint(checkpoint: Checkpoint) -> None:
        _check_family(checkpoint)

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
        try:
            return super().execute(scheduler_output, requests)
        except BaseException as error:
            raise self._fail(error) from error

    def _will_run(self, scheduled: list[ScheduledRequest], requests: dict[str, Request]) -> None:
        """Send the helpers the step, in the layout this rank runs it."""
        self._send(self._messages.step(scheduled, requests))

    def score_tokens(self, token_ids: list[int]) -> torch.Tensor:
        self._check_alive()
        try:
            self._send(ScoreMessage(list(token_ids)))
            return super().score_tokens(token_ids)
        except ValueError:
            raise  # bad input, refused on every rank before any collective
        except BaseException as error:
            raise self._fail(error) from error

    # ---- a helper -----------------------------------------------------------------------------

    def serve_one(self, message: object) -> None:
        if isinstance(message, StepMessage):
            self._helper_step(message)
        elif isinstance(message, ScoreMessage):
            try:
                ModelRunner.score_tokens(self, message.token_ids)
            except ValueError:
                pass  # the driver refused it too, before any collective

    def _helper_step(self, message: StepMessage) -> None:
        rows = self._held.apply(message)
        batch = build_input_batch(rows, self.block_size, self.device,
                                  with_window=self.kv_window is not None)
        lora = None if self.lora is None else self.lora.step_batch(_lora_runs(message.rows))
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


def _lora_runs(rows: list[RowDelta]) -> list[tuple[str | None, int]]:
    """A helper's step as (adapter, new tokens) runs in the flat batch's layout, decodes first,
    from the driver's rows in the driver's order (by adapter: ``group_by_adapter``)."""
    runs = [(d.lora_name, d.num_new_tokens) for d in rows]
    return [r for r in runs if r[1] == 1] + [r for r in runs if r[1] > 1]
