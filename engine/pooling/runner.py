"""PoolingModelRunner: the model runner of an embedding engine (a ``Runner``, as the generating
runners are).

A step's sequences go in whole and back to back, as one flat token batch with per-sequence
offsets and no padding (``engine/layers/packed_attention.py``); no KV cache exists, since a
pooling request keeps nothing after its step. Out comes one pooled fp32 vector per sequence
(``engine/layers/pooling.py``), normalized where the model's sentence-transformers files (or
the engine's ``pooling`` / ``normalize`` options) say so. A cross-encoder's sequences are
pairs of texts, with their token types (``PoolingParams.token_type_starts``); out comes one
score per pair, its logit through the model's activation, as a one-value vector.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.core.request import Request
from engine.layers.attention_metadata import AttentionMetadata
from engine.layers.linear import (
    pack_linear_weights,
    packing_gemm,
)
from engine.layers.packed_attention import PackedAttentionBackend
from engine.layers.pooling import (
    PoolerConfig,
    PoolingType,
    ScoreActivation,
    pool,
    read_pooler_config,
    read_score_activation,
)
from engine.lora.manager import LoRAManager
from engine.models.bert_classifier import BertForSequenceClassification
from engine.models.decoder_embedding import DecoderEmbeddingModel
from engine.models.no_init import no_init_weights
from engine.models.pooling_registry import EmbeddingModel, build_embedding_model
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.runner.base import Runner
from engine.runner.device import resolve_device, resolve_dtype


class PoolingModelRunner:
    # No KV cache: the scheduler is built with none, and pooling requests ask for none.
    num_kv_blocks = 0
    kv_cache_seconds = 0.0
    kv_window: tuple[int, int] | None = None  # no sliding-window pool either
    lora: LoRAManager | None = None  # no LoRA adapters on a pooling model

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int,
                 dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = dtype or resolve_dtype(config.dtype, self.device)
        hf_config = checkpoint.config
        model, default_pooling = self._build_model(checkpoint, max_position)
        self.model = model.eval()
        self.vocab_size: int = hf_config.vocab_size
        self.hidden_size: int = model.hidden_size
        folder = checkpoint.path if isinstance(checkpoint.path, Path) else None
        self.pooler = _with_options(read_pooler_config(folder, default_pooling, hf_config),
                                    config)
        # A cross-encoder scores pairs: its activation; None for an embedding model.
        self.score_activation: ScoreActivation | None = None
        if isinstance(model, BertForSequenceClassification):
            self.score_activation = read_score_activation(folder, hf_config)
            self.pooler = PoolerConfig(PoolingType.CLS, False, self.pooler.max_seq_len)
            self.hidden_size = 1  # its vector: one score
        max_len = min(max_position, getattr(model, "max_position", max_position))
        if self.pooler.max_seq_len is not None and config.max_model_len is None:
            max_len = min(max_len, self.pooler.max_seq_len)
        self.max_len = max_len
        use_triton = (config.attention_backend == "triton"
                      or (config.attention_backend is None and self.device.type == "cuda"))
        native_cpu = (self.device.type == "cpu" and config.attention_backend in (None, "cpu")
                      and not os.environ.get("BOXCAR_NO_CPU_KERNELS"))
        self.attn = PackedAttentionBackend(causal=model.causal, use_triton=use_triton,
                                           use_cpu_kernel=native_cpu)
        self.packed_weights = False
        if native_cpu:
            gemm = packing_gemm(self.dtype, config.cpu_gemm)
            if gemm is not None:
                pack_linear_weights(model, gemm=gemm)
                self.packed_weights = True

    def _build_model(self, checkpoint: Checkpoint,
                     max_position: int) -> tuple[EmbeddingModel, PoolingType]:
        """The model with the checkpoint's weights, and the pooling its kind defaults to
        (``engine.distributed.pooling_runner`` builds a rank's share instead)."""
        with torch.device(self.device), no_init_weights():
            model, default_pooling = build_embedding_model(checkpoint.config, max_position)
        model.to(dtype=self.dtype)
        if isinstance(model, DecoderEmbeddingModel):
            model.keep_fp32()  # the rotary tables stay fp32 whatever the weights are
        model.load_weights(checkpoint.iter_weights(self.dtype))
        return model, default_pooling

    @property
    def cross_encoder(self) -> bool:
        return self.score_activation is not None

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]],
              token_type_starts: list[int | None] | None = None) -> torch.Tensor:
        """``[len(token_ids), hidden_size]`` fp32 pooled (and normalized) vectors of sequences
        packed into one pass: the step's computation, without a scheduler. A cross-encoder's:
        ``[len(token_ids), 1]`` scores, each sequence's tokens from its ``token_type_starts``
        entry on of type 1 (None: all type 0)."""
        device = self.device
        lens = [len(ids) for ids in token_ids]
        flat = [t for ids in token_ids for t in ids]
        positions = [p for n in lens for p in range(n)]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        empty_table = torch.zeros((0, 1), dtype=torch.int32, device=device)
        no_lens = torch.zeros(0, dtype=torch.int32, device=device)
        metadata = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
            num_decodes=0,
            decode_block_tables=empty_table,
            decode_context_lens=no_lens,
            num_prefills=len(lens),
            prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            prefill_block_tables=empty_table,
            prefill_context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            prefill_query_lens_list=lens,
            prefill_context_lens_list=lens,
        )
        input_ids = torch.tensor(flat, dtype=torch.int64, device=device)
        position_ids = torch.tensor(positions, dtype=torch.int64, device=device)
        model = self.model
        if isinstance(model, BertForSequenceClassification):
            segment_starts = token_type_starts or [None] * len(lens)
            token_types = [int(start is not None and p >= start)
                           for n, start in zip(lens, segment_starts, strict=True) for p in range(n)]
            hidden = model(input_ids, position_ids, self.attn, metadata,
                           torch.tensor(token_types, dtype=torch.int64, device=device))
            cls_states = pool(hidden, lens, PoolingType.CLS).to(self.dtype)
            activation = self.score_activation or ScoreActivation.IDENTITY
            # [num_seqs, 1] fp32
            return activation.apply(model.score(cls_states).float())[:, None].cpu()
        hidden = model(input_ids, position_ids, self.attn, metadata)  # [num_tokens, hidden_size]
        pooled = pool(hidden, lens, self.pooler.pooling_type)  # [num_seqs, hidden_size] fp32
        if self.pooler.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.cpu()

    def execute(self, scheduler_output: SchedulerOutput,
                requests: dict[str, Request]) -> ModelRunnerOutput:
        """Every scheduled request is a whole pooling input (the scheduler schedules them so)."""
        scheduled = scheduler_output.scheduled
        rows = [requests[s.request_id] for s in scheduled]
        token_ids = [r.prompt_token_ids for r in rows]
        starts = [_token_type_start(r) for r in rows] if self.cross_encoder else None
        pooled = self.embed(token_ids, starts)
        return ModelRunnerOutput({}, pooled={s.request_id: pooled[i]
                                             for i, s in enumerate(scheduled)})


def _token_type_start(request: Request) -> int | None:
    """Where a cross-encoder input's second text begins (None: one segment)."""
    params = request.pooling_params
    starts = None if params is None else params.token_type_starts
    if starts is None or request.index >= len(starts):
        return None
    return starts[request.index]


def _with_options(pooler: PoolerConfig, config: EngineConfig) -> PoolerConfig:
    """The model's pooling with the engine's ``pooling`` / ``normalize`` options on top."""
    pooling_type = pooler.pooling_type
    if config.pooling is not None:
        pooling_type = PoolingType(config.pooling)
    normalize = pooler.normalize if config.normalize is None else config.normalize
    return PoolerConfig(pooling_type, normalize, pooler.max_seq_len,
                        pooler.matryoshka_dimensions)


if TYPE_CHECKING:
    def _is_a_runner(runner: PoolingModelRunner) -> Runner:
        return runner  # mypy: PoolingModelRunner satisfies the Protocol
