"""TPPoolingRunner: an embedding model over several devices (a 7B decoder embedder).

The decoder embedders are the generating families' own decoders without their output layer
(``engine.models.decoder_embedding``), so a rank's share is split exactly as theirs is
(``sharding.py``): its heads and MLP columns, one all-reduce after each row-parallel projection
and after the vocabulary-parallel embedding. Every rank ends a step with the whole final hidden
state, so the driver pools it alone; the helpers run the same packed forward and drop it. A step's
message is its sequences' token ids (no KV cache: nothing else to keep in step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.loader import Checkpoint
from engine.config import EngineConfig
from engine.distributed.group import TPGroup
from engine.distributed.helper import HelperHandle
from engine.distributed.ranks import Ranks
from engine.distributed.runner import TP_FAMILIES
from engine.distributed.sharding import ShardPlan, shard_encoder, shard_model
from engine.distributed.weights import iter_shard_weights
from engine.layers.pooling import PoolingType
from engine.models.decoder_embedding import DecoderEmbeddingModel
from engine.models.no_init import no_init_weights
from engine.models.pooling_registry import (
    CROSS_ENCODER_ARCHITECTURES,
    DECODER_BASE_ARCHITECTURES,
    ENCODER_ARCHITECTURES,
    EmbeddingModel,
    build_embedding_model,
)
from engine.models.registry import MODEL_REGISTRY
from engine.pooling.runner import PoolingModelRunner

if TYPE_CHECKING:
    from engine.runner.base import Runner


@dataclass
class EmbedMessage:
    token_ids: list[list[int]]  # the step's sequences, packed in this order
    token_type_starts: list[int | None] | None


class TPPoolingRunner(Ranks, PoolingModelRunner):
    """A ``PoolingModelRunner`` over this rank's share of a decoder embedder."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_position: int,
                 group: TPGroup, plan: ShardPlan, helpers: list[HelperHandle]) -> None:
        self.join_ranks(group, plan, helpers)
        PoolingModelRunner.__init__(self, config, checkpoint, max_position)

    @staticmethod
    def check_checkpoint(checkpoint: Checkpoint) -> None:
        architecture = (list(getattr(checkpoint.config, "architectures", None) or [])
                        or [""])[0]
        causal_lm = MODEL_REGISTRY.get(DECODER_BASE_ARCHITECTURES.get(architecture,
                                                                      architecture))
        if architecture in ENCODER_ARCHITECTURES or architecture in CROSS_ENCODER_ARCHITECTURES:
            return
        if causal_lm is None or not issubclass(causal_lm, TP_FAMILIES):
            raise ValueError(f"tensor_parallel_size > 1 splits BERT encoders and decoder "
                             f"embedders of the generating families; "
                             f"{architecture or 'this model'} is neither")

    def _build_model(self, checkpoint: Checkpoint,
                     max_position: int) -> tuple[EmbeddingModel, PoolingType]:
        """This rank's share: the decoder at the local sizes, its collectives added, its
        slices read from the checkpoint."""
        local_config = self.plan.local_config(checkpoint.config)
        with torch.device(self.device), no_init_weights():
            model, default_pooling = build_embedding_model(local_config, max_position)
        model.to(dtype=self.dtype)
        if isinstance(model, DecoderEmbeddingModel):
            model.keep_fp32()
            shard_model(model.lm, self.plan, self.group)
        else:  # a BERT encoder (a cross-encoder's head whole on every rank)
            shard_encoder(model, self.plan, self.group)
        model.load_weights(iter_shard_weights(checkpoint, self.plan, self.dtype))
        return model, default_pooling

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]],
              token_type_starts: list[int | None] | None = None) -> torch.Tensor:
        self._check_alive()
        try:
            self._send(EmbedMessage(token_ids, token_type_starts))
            return PoolingModelRunner.embed(self, token_ids, token_type_starts)
        except BaseException as error:
            raise self._fail(error) from error

    def serve_one(self, message: object) -> None:
        if isinstance(message, EmbedMessage):  # the driver pools
            PoolingModelRunner.embed(self, message.token_ids, message.token_type_starts)


if TYPE_CHECKING:
    def _is_a_runner(runner: TPPoolingRunner) -> Runner:
        return runner  # mypy: TPPoolingRunner satisfies the Protocol
