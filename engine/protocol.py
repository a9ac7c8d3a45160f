"""The engine's contract with whatever drives it: ``Engine``.

The request pipeline (``pipeline.engine_adapter``), the worker's drain loop and process, the
metrics wrapper (``metrics.recorder.MeteredEngine``) and ``boxcar run`` see an engine only
through this Protocol. ``LLMEngine``, ``MeteredEngine`` and the one fake
(``engine.testing.fake_engine.FakeEngine``) satisfy it, and mypy checks all three where they cross:
a caller never probes an engine with ``getattr(engine, name, default)`` and never invents a
default its ``EngineConfig`` already declares (STYLE rule 17).

A request goes in through ``add_request`` and comes out of ``step`` (or ``abort_request``) as a
``RequestOutput``; ``get_stats`` and ``progress`` are what the metrics and the forecast read.
An engine either generates or embeds (``is_embedding``): an embedding engine takes
``PoolingParams`` requests, one input or a list of them, and finishes each with one vector per
input (``RequestOutput.embeddings``; a cross-encoder's inputs are pairs of texts and each
vector is its one score, ``embedding.cross_encoder``); ``check_embedding`` checks an embeddings
line before it is added, and ``add_request`` takes what it returns without checking again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.outputs import EngineStats, RequestOutput, RequestProgress
from engine.pooling_params import EmbeddingInputs, EmbeddingSpec, PoolingParams
from engine.sampling_params import SamplingParams

# A chat template as Hugging Face stores it: one Jinja text, or named ones ({"default", ...}).
ChatTemplate = str | dict[str, str]
# What ``add_request`` takes: a generation prompt (a text or token ids), or for an embedding
# request one input of either kind, a list of them, or the inputs ``check_embedding`` returned.
Prompt = str | list[int] | list[str | list[int]] | EmbeddingInputs


class Engine(Protocol):
    """An engine as its callers use it. Call every method from the one thread that steps it."""

    @property
    def config(self) -> EngineConfig:
        """The settings it was built with (limits such as ``max_num_seqs`` are read here)."""
        ...

    @property
    def model_name(self) -> str:
        """The loaded model's own name (a folder's name, a GGUF file's stem)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The context in tokens, prompt and completion together, as the engine resolved it
        (the model's, capped by the config's and by what the KV cache holds)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The tokenizer's chat template (None: the model has none)."""
        ...

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Where start-up time went, by phase (empty when there was nothing to time)."""
        ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def encode(self, prompt: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def special_token_id(self, token: str) -> int | None:
        """The id of a special token the vocabulary has (``<|channel|>``), else None."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's token ids: ``messages`` (and ``tools``) rendered by the chat template;
        raises (anything: jinja's errors are no ValueError) when the template refuses them."""
        ...

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams, *,
                    arrival_time: float | None = None, priority: int = 0,
                    rank: int = 0, lora_name: str | None = None) -> None:
        """Queue one request; raises ``ValueError`` for one the engine cannot run
        (``LoRAError`` for an adapter it cannot serve; ``NotAnEmbeddingModel`` for
        ``PoolingParams`` on a generation engine or ``SamplingParams`` on an embedding one;
        ``EmbeddingInputError`` for an embedding input the model cannot take)."""
        ...

    @property
    def is_embedding(self) -> bool:
        """The engine embeds (``PoolingParams`` requests) instead of generating text."""
        ...

    @property
    def embedding(self) -> EmbeddingSpec | None:
        """An embedding engine's limits and kind (``cross_encoder``: it scores pairs of texts,
        one value each, instead of embedding texts); None for a generation engine."""
        ...

    def check_embedding(self, inputs: Any, params: PoolingParams) -> EmbeddingInputs:
        """An embedding request's inputs (one text or token-id list, or a list of them) as
        token ids checked against the model, with ``params``: ``DimensionsNotSupported`` unless
        the model can return ``params.dimensions`` values, other ``EmbeddingInputError`` kinds
        (empty, too long, out of the vocabulary) naming the input's index;
        ``NotAnEmbeddingModel`` on a generation engine."""
        ...

    @property
    def lora_names(self) -> list[str]:
        """The registered LoRA adapters a request may name (empty: LoRA is off)."""
        ...

    def add_lora(self, name: str, path: str) -> None:
        """Register (or replace) an adapter; raises ``LoRAError`` for one it cannot read."""
        ...

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]: ...

    def step(self) -> list[RequestOutput]:
        """One scheduling step; the requests it finished."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def progress(self) -> list[RequestProgress]:
        """Every unfinished sequence, running ones first, in the order they are served."""
        ...

    def get_stats(self) -> EngineStats: ...
