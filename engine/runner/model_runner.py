"""ModelRunner: a generating engine's device side, one step from scheduler output to tokens.

It builds the model and loads its weights, owns the paged KV cache (``kv_cache.py``), turns a
SchedulerOutput into one flat batch (``input_batch.py``), runs the forward pass (eager, or a
captured CUDA graph for decode-only steps, ``cuda_graphs.py``) and samples
(``greedy_dispatch.py``). The math itself lives in the model, its layers and the kernels; an
embedding engine's step runs in ``engine/pooling/runner.py`` instead, and a tensor-parallel one
in ``engine/distributed/runner.py``, which subclasses this one.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.core.request import Request
from engine.kernels import cpu_decode_attention
from engine.kernels.quant_gemm import QuantWeight, int8_screen_available
from engine.layers.attention_metadata import AttentionBackend
from engine.layers.linear import Linear, pack_linear_weights, packing_gemm
from engine.layers.moe import pack_experts
from engine.layers.quantized import QuantizedLinear
from engine.layers.torch_attention import TorchAttentionBackend
from engine.lora.adapter import ShardLoRA
from engine.lora.layers import lora_batch, wrap_lora_linears
from engine.lora.manager import LoRAManager
from engine.models.causal_lm import CausalLM
from engine.models.no_init import cast_unloaded, no_init_weights
from engine.models.registry import get_model_class
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.base import Runner
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.device import bf16_is_native, resolve_device, resolve_dtype
from engine.runner.greedy_dispatch import sample_tokens
from engine.runner.greedy_screen import GreedyScreen, Int8GreedyScreen, Screen
from engine.runner.input_batch import InputBatch, PreparedStep, StepRow, build_input_batch
from engine.runner.kv_cache import KVCache, plan_kv_cache
from engine.runner.persistent_batch import PersistentBatch
from engine.runner.sampler import Sampler
from engine.runner.sampling_columns import SamplingColumns


class ModelRunner:
    # The output layer holds a share of the vocabulary (tensor parallel): logits come only from
    # ``compute_logits``, which gathers the shares.
    head_is_split = False

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int) -> None:
        self.max_position = max_position
        self.config = config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        hf_config = checkpoint.config
        self.model: CausalLM = self._build_model(checkpoint, max_position).eval()
        self.vocab_size = hf_config.vocab_size
        self.sampler = Sampler(self.vocab_size, config.seed)
        self.attn = self._make_attention_backend()
        self.packed_weights = False
        self.greedy_screen: Screen | None = None
        self.lora: LoRAManager | None = None
        if config.lora_modules:
            self._enable_lora(checkpoint)
        if self._native_cpu_path():
            self._pack_weights()
        self._allocate_kv_cache(hf_config)
        # The running requests' block tables across steps (prepare_inputs).
        self.persistent_batch = PersistentBatch(self.block_size, self.kv_window is not None,
                                                num_slots=config.max_num_seqs)
        self.graphs: CUDAGraphRunner | None = None
        self.lora_graphs: CUDAGraphRunner | None = None  # decode steps with adapter rows
        # The captured graphs read one block table: a model with a windowed group runs eager;
        # so does the torch backend, which sizes its gather from host-side lengths.
        if (self.device.type == "cuda" and not config.enforce_eager
                and self.kv_window is None and self.attn.name == "triton"):
            self.capture_decode_graphs()

    def _enable_lora(self, checkpoint: Checkpoint) -> None:
        """Wrap the projections in ``LoRALinear`` (before packing: packing finds the base
        linears inside) and read every registered adapter, so a bad one fails the start."""
        linears, targets = wrap_lora_linears(self.model)
        stacked = self.device.type == "cuda" or self.config.attention_backend == "triton"
        # The CPU path's short segments loop in C++ (``csrc/lora_segments.cpp``) where the
        # native kernels run; elsewhere (or where they could not be built) in Python.
        kernel = cpu_decode_attention.load() if self._native_cpu_path() and not stacked else None
        self.lora = LoRAManager(self.config, linears, targets, dtype=self.dtype,
                                device=self.device, base_names=base_model_names(
                                    self.config.model, checkpoint), stacked=stacked,
                                kernel=kernel, shard=self._lora_shard())

    def _lora_shard(self) -> ShardLoRA | None:
        """Each adapter's share on this device: all of it (a tensor-parallel rank slices)."""
        return None

    def _build_model(self, checkpoint: Checkpoint, max_position: int) -> CausalLM:
        """The family's model with the checkpoint's weights (``engine.distributed.runner``
        builds a rank's share instead)."""
        hf_config = checkpoint.config
        model_cls: type[CausalLM] = get_model_class(hf_config)
        # No random init: load_weights fills every parameter (and raises if one is missing).
        with torch.device(self.device), no_init_weights():
            model = model_cls(hf_config, max_position)
        cast_unloaded(model, self.dtype)  # (no copy of uninitialised memory)
        model.keep_fp32()  # the rotary tables stay fp32 whatever the weights are
        # Weights stored in the run's dtype are read straight into the parameters (no copy).
        destination = model.weight_destination()
        if self.config.quantization == "keep":  # (start-up resolves None: engine/startup.py)
            # a GGUF's quantized weights stay in their blocks, their modules swapped for
            # quantized ones (engine/layers/quantized.py)
            model.load_packed_weights(checkpoint.iter_weights(self.dtype, destination,
                                                              quantized=True))
        else:
            model.load_weights(checkpoint.iter_weights(self.dtype, destination))
        return model

    def capture_decode_graphs(self, runner_cls: type[CUDAGraphRunner] = CUDAGraphRunner
                              ) -> None:
        """Decode-only steps replay CUDA graphs captured at bucketed batch sizes (a test's
        ``runner_cls`` stands in for capture on the CPU)."""
        from engine.runner.cuda_graphs import bucket_sizes

        def forward(input_ids, positions, metadata):
            return self.model(input_ids, positions, self.kv_caches, self.attn, metadata)

        buckets = bucket_sizes(min(self.config.max_num_seqs, 256))
        max_num_blocks = -(-self.max_position // self.block_size)
        self.graphs = runner_cls(forward, buckets, max_num_blocks, self.device)
        self.graphs.capture()
        lora = self.lora
        if lora is None or not lora.stacked:
            return

        # A second set for decode steps with adapter rows: the LoRA kernels read the step's
        # segments from a table written before each replay (``LoRAManager.graph_batch``).
        def lora_forward(input_ids, positions, metadata):
            with lora_batch(lora.graph_batch(input_ids.shape[0])):
                return forward(input_ids, positions, metadata)

        self.lora_graphs = runner_cls(lora_forward, buckets, max_num_blocks, self.device,
                                      pool=self.graphs.pool)
        self.lora_graphs.capture()

    def _native_cpu_path(self) -> bool:
        """CPU, fp32 or bf16, and the native kernels on (the ``torch`` backend keeps stock
        torch)."""
        return (
            self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
            and self.config.attention_backend in (None, "cpu")
            and not os.environ.get("BOXCAR_NO_CPU_KERNELS")
        )

    def _pack_weights(self) -> None:
        """Prepack the linear weights (``engine/layers/linear.py``: MKL or oneDNN by CPU for
        fp32, oneDNN for bf16 where the CPU has bf16 units) and screen greedy rows' output
        projection (``greedy_screen.py``): in fp32 where the CPU has bf16 units; in bf16
        always, since the screen's token is the fp32 argmax and the plain bf16 projection's
        is not. The output layer keeps its weight when the embedding or the screen reads
        it. An output layer kept in ggml blocks has no dense weight to screen or pack: in bf16
        it gives fp32 logits instead (``QuantizedLinear.out_dtype``), so its argmax too is of
        the fp32 sums; one kept in Q8_0 is screened in int8 where the CPU has AVX512-VNNI
        (``Int8GreedyScreen``, fp32 and bf16 models alike: its token is the fp32 argmax of the
        exact weight's products)."""
        lm_head = self.model.lm_head
        head = lm_head.weight if isinstance(lm_head, Linear) else None
        fp32 = self.dtype == torch.float32
        if (isinstance(lm_head, QuantizedLinear) and not fp32
                and all(isinstance(p, QuantWeight) for p in lm_head.pieces)):
            lm_head.out_dtype = torch.float32
        q8_head = _int8_screen_weight(lm_head)
        if head is not None and (not fp32 or bf16_is_native()):
            self.greedy_screen = GreedyScreen(head.detach()[: self.vocab_size])
        elif q8_head is not None:
            self.greedy_screen = Int8GreedyScreen(q8_head, self.vocab_size)
        gemm = packing_gemm(self.dtype, self.config.cpu_gemm)
        if gemm is None:
            return
        keep = self.model.tie_word_embeddings or self.greedy_screen is not None
        pack_linear_weights(self.model, shared={id(head)} if keep and head is not None
                            else set(), gemm=gemm)
        if gemm == "onednn":  # MoE experts too (engine/layers/moe.py)
            pack_experts(self.model)
        self.packed_weights = True

    def _make_attention_backend(self) -> AttentionBackend:
        name = self.config.attention_backend
        if name is None:
            name = "triton" if self.device.type == "cuda" else "cpu"
        if name == "triton":
            from engine.layers.triton_attention import TritonAttentionBackend

            return TritonAttentionBackend()
        return TorchAttentionBackend(self.block_size, use_cpu_kernel=name == "cpu")

    def _allocate_kv_cache(self, hf_config) -> None:
        start = time.perf_counter()
        model = self.model
        layout = plan_kv_cache(self.config, model.sliding_windows, self.max_position,
                               model.num_kv_heads, model.head_dim, self.dtype)
        self.kv_layout = layout
        self.num_kv_blocks = layout.num_blocks
        # The windowed layers' own group (window, blocks incl. the null one), or None.
        self.kv_window: tuple[int, int] | None = (
            (layout.window, layout.num_window_blocks) if layout.window is not None else None)
        self.kv = KVCache(layout, self.block_size, model.num_kv_heads, model.head_dim,
                          self.dtype, self.device)
        # The full group's tensor (every layer's with one group), for tools that read it.
        self.kv_cache = self.kv.tensors[0]
        self.kv_caches = self.kv.layers
        self.kv_cache_seconds = time.perf_counter() - start

    def prepare_inputs(
        self, scheduled: list[ScheduledRequest], requests: dict[str, Request],
        device: torch.device | None = None,
    ) -> tuple[InputBatch, list[Request], SamplingColumns]:
        """The step's flat batch of ``scheduled`` (``_ordered``) on ``device`` (None: the
        runner's), the requests that sample, in its sample order, and their sampling columns:
        from the running requests' tables kept across steps (``persistent_batch.py``)."""
        return self.persistent_batch.prepare(scheduled, requests, device or self.device)

    def _ordered(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
                 ) -> tuple[list[ScheduledRequest], list[tuple[str | None, int]] | None]:
        """The step's requests, and with LoRA on its runs of rows (``group_by_adapter``)."""
        if self.lora is None:
            return list(scheduler_output.scheduled), None
        return group_by_adapter(scheduler_output.scheduled, requests)

    def _will_run(self, scheduled: list[ScheduledRequest], requests: dict[str, Request]) -> None:
        """Called with the step's layout before it runs (a tensor-parallel driver sends it)."""

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, requests: dict[str, Request]
    ) -> ModelRunnerOutput:
        return self.run_step(self.prepare_step(scheduler_output, requests))

    def prepare_step(self, scheduler_output: SchedulerOutput, requests: dict[str, Request],
                     on_host: bool = False) -> PreparedStep:
        """The host's half of a step: everything read from the requests (their tokens, block
        tables, adapters, in the batch's layout). With async scheduling it runs while the
        previous step is still on the device, and the requests change after it returns;
        ``on_host`` leaves the batch's tensors on the CPU for ``run_step`` to copy (a copy
        from pageable memory would wait here for the step on the device)."""
        scheduled, lora_runs = self._ordered(scheduler_output, requests)
        self._will_run(scheduled, requests)
        batch, sample_requests, sampling = self.prepare_inputs(
            scheduled, requests, torch.device("cpu") if on_host else None)
        return PreparedStep(scheduled, batch, sample_requests, sampling, lora_runs)

    @torch.inference_mode()
    def run_step(self, step: PreparedStep) -> ModelRunnerOutput:
        """The device's half: the forward pass and the sampled tokens. Reads no request state
        the host changes between steps (``engine/runner/step_pipeline.py``)."""
        batch = step.batch = step.batch.to(self.device)
        metadata = batch.metadata
        lora = None
        if step.lora_runs is not None:
            assert self.lora is not None
            lora = self.lora.step_batch(step.lora_runs)
        graphs = self.graphs if lora is None else self.lora_graphs
        if graphs is not None and metadata.num_prefills == 0:
            if lora is not None:
                assert self.lora is not None
                self.lora.write_graph_segments(lora)
            hidden = graphs.run(
                batch.input_ids, batch.positions, metadata.decode_block_tables,
                metadata.decode_context_lens, metadata.slot_mapping,
            )
        else:
            self.attn.prepare(metadata)
            if metadata.window is not None:
                self.attn.prepare(metadata.window)
            with lora_batch(lora):
                hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, self.attn,
                                    metadata)
        if not batch.sample_indices:
            return ModelRunnerOutput({})
        # Only the rows we sample from go through the (large) output projection; plain greedy
        # rows take the screened argmax instead where there is one.
        index = torch.tensor(batch.sample_indices, dtype=torch.int64, device=self.device)
        sample_requests = step.sample_requests
        tokens, token_ids, logprobs = sample_tokens(
            self.model, self.greedy_screen, self.sampler, hidden.index_select(0, index),
            sample_requests, step.sampling)
        return ModelRunnerOutput(
            {r.request_id: t for r, t in zip(sample_requests, token_ids, strict=True)},
            logprobs, device_token_ids=tokens,
        )

    @torch.inference_mode()
    def score_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher forcing: ``[len(token_ids) - 1, vocab]`` fp32 log-probabilities of each next
        token of one sequence, from one prefill pass.

        The logits are the fp32 products of the final hidden rows and the output weight (the
        values the greedy screen takes its argmax of). K/V go to a scratch cache, so the
        engine's cache and its prefix cache are untouched and requests may be in flight.
        """
        num_tokens = len(token_ids)
        if num_tokens < 2:
            raise ValueError("token_ids needs at least 2 tokens to score")
        if num_tokens > self.max_position:
            raise ValueError(f"token_ids has {num_tokens} tokens; the model takes "
                             f"{self.max_position}")
        num_blocks = -(-num_tokens // self.block_size)
        k_cache = self.kv_caches[0][0]
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], blocks 0..n-1 in order
        scratch = torch.zeros((len(self.kv_caches), 2, num_blocks, *k_cache.shape[1:]),
                              dtype=k_cache.dtype, device=self.device)
        blocks = list(range(num_blocks))
        # One table for every layer here: the scratch cache has no windowed group.
        batch = build_input_batch([StepRow(token_ids, blocks, None, 0, num_tokens, True)],
                                  self.block_size, self.device)
        self.attn.prepare(batch.metadata)
        hidden = self.model(
            batch.input_ids, batch.positions,
            [(scratch[i, 0], scratch[i, 1]) for i in range(len(self.kv_caches))],
            self.attn, batch.metadata,
        )[:-1]
        if self.greedy_screen is not None:  # the output layer's weight may be packed away
            logits = self.greedy_screen.logits(hidden)
        else:
            lm_head = self.model.lm_head
            if self.packed_weights or self.head_is_split or not isinstance(lm_head, Linear):
                return torch.log_softmax(
                    self.model.compute_logits(hidden)[:, : self.vocab_size].float(), dim=-1
                ).cpu()
            logits = hidden.float() @ lm_head.weight[: self.vocab_size].float().T
        logits = self.model.cap_logits(logits)  # [num_tokens - 1, vocab]
        return torch.log_softmax(logits, dim=-1).cpu()


def group_by_adapter(scheduled: list[ScheduledRequest], requests: dict[str, Request]
                     ) -> tuple[list[ScheduledRequest], list[tuple[str | None, int]]]:
    """``scheduled`` ordered by adapter (the base model's rows first, then each adapter's by
    name; stable), so that the flat batch (its one-token rows, then the others, each in this
    order) holds an adapter's rows contiguously (``lora/layers.py``); and the batch's runs of
    rows in that layout, (adapter or None, rows), what ``LoRAManager.step_batch`` takes: each
    adapter's decodes, in adapter order, then each one's longer rows. One pass over the rows
    (a sort with a key and a tuple a row cost ~1 us a row with LoRA on, issue 46)."""
    groups: dict[str | None, tuple[list[ScheduledRequest], list[int]]] = {}
    for s in scheduled:
        name = requests[s.request_id].lora_name
        group = groups.get(name)
        if group is None:
            group = groups[name] = ([], [0, 0])
        group[0].append(s)
        if s.num_new_tokens == 1:
            group[1][0] += 1
        else:
            group[1][1] += s.num_new_tokens
    names = sorted(groups, key=lambda name: (name is not None, name or ""))
    ordered = [s for name in names for s in groups[name][0]]
    runs = [(name, groups[name][1][part]) for part in (0, 1) for name in names
            if groups[name][1][part]]
    return ordered, runs


def _int8_screen_weight(lm_head: torch.nn.Module) -> QuantWeight | None:
    """The output layer's weight when the int8 screen can take it: one Q8_0 ``QuantWeight`` in
    the kernel's tiles, no bias, and a library built with AVX512-VNNI; else None."""
    if not isinstance(lm_head, QuantizedLinear) or lm_head.bias is not None:
        return None
    if len(lm_head.pieces) != 1 or not isinstance(lm_head.pieces[0], QuantWeight):
        return None
    weight = lm_head.pieces[0]
    if weight.fmt != "Q8_0" or not weight.kernel or weight.device.type != "cpu":
        return None
    return weight if int8_screen_available() else None


def base_model_names(model: str, checkpoint: Checkpoint) -> set[str]:
    """The names an adapter's ``base_model_name_or_path`` may give for this model: the setting,
    its last part, the checkpoint folder's name and the name its config was saved under."""
    names = {model, os.path.basename(model.rstrip("/"))}
    for path in (checkpoint.path, checkpoint.source):
        if path is not None:
            names |= {str(path), path.name, path.stem}
    saved = getattr(checkpoint.config, "_name_or_path", None) or ""
    if saved:
        names |= {saved, os.path.basename(saved.rstrip("/"))}
    return {n for n in names if n}


if TYPE_CHECKING:
    def _is_a_runner(runner: ModelRunner) -> Runner:
        return runner  # mypy: ModelRunner satisfies the Protocol
