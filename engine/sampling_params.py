"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# OpenAI's logit_bias range: -100 bans a token, +100 all but forces it.
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class StructuredOutputParams:
    """Constrain a request's output to a grammar (compiled by xgrammar). Set exactly one of:

    ``json_schema``: a JSON Schema (dict or JSON text); the output is one JSON value valid under
    it. ``strict`` (default True) also forbids object properties and array items that the schema
    does not name (JSON Schema's ``additionalProperties``/``items`` defaults are open); with
    ``strict=False`` the schema's own defaults apply. ``json_object``: any JSON object.
    ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, start rule ``root``).
    ``structural_tag``: an xgrammar structural tag (dict or JSON text), e.g. free text with tool
    calls between trigger tags. ``compact`` (json_schema, json_object): no whitespace between
    JSON tokens, as ``json.dumps(separators=(",", ":"))`` writes; otherwise up to
    ``MAX_JSON_WHITESPACE`` characters between them. A forced tool call is compact: a model
    that pretty-prints spends max_tokens on indentation and its call is cut.

    The request stops ("stop") when the grammar is complete: the mask then allows only EOS.
    ``max_tokens`` can still cut it ("length"); stop strings still apply and can cut it too.
    """

    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    strict: bool = True
    compact: bool = False

    def __post_init__(self) -> None:
        chosen = [
            name for name, value in (
                ("json_schema", self.json_schema), ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            ) if value is not None
        ]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_output.json_object must be a bool, got "
                             f"{self.json_object!r}")
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            raise ValueError(
                "structured_output needs exactly one of json_schema, json_object, grammar, "
                f"structural_tag; got {chosen or 'none'}"
            )
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | dict):
                raise ValueError(f"structured_output.{name} must be a dict or JSON text, got "
                                 f"{type(value).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError("structured_output.grammar must be non-empty EBNF text")
        if not isinstance(self.strict, bool):
            raise ValueError(f"structured_output.strict must be a bool, got {self.strict!r}")
        if not isinstance(self.compact, bool):
            raise ValueError(f"structured_output.compact must be a bool, got {self.compact!r}")
        if self.compact and self.json_schema is None and not self.json_object:
            raise ValueError("structured_output.compact applies to json_schema and json_object "
                             f"only, not {chosen[0]}")


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM's names and defaults).

    ``temperature == 0`` means greedy. ``top_k``/``logprobs``/``seed``/``max_tokens`` use ``None``
    for "not set". Every invalid value raises ``ValueError`` naming the field. Only the engine's
    own domain is checked here (a probability in [0, 1], a positive divisor); an API's product
    limits (OpenAI's 20 logprobs, penalties in [-2, 2]) belong to that API's request types.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (OpenAI semantics, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(
                value
            ):
                raise bad(name, "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise bad("top_k", "must be None or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be None or an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or self.logprobs < 0
        ):
            raise bad("logprobs", "must be None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be None or an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                                     f"{token_id!r}")
                if (not isinstance(bias, int | float) or isinstance(bias, bool)
                        or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias[{token_id}] must be a number in "
                                     f"[-100, 100], got {bias!r}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise bad("structured_output", "must be a StructuredOutputParams")
            # The grammar ends the request by allowing only EOS once it is complete: an EOS
            # that does not stop, or is banned, would leave no valid token.
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be set with structured_output")
            if self.min_tokens:
                raise bad("min_tokens", "must be 0 with structured_output")

    @property
    def plain_logits(self) -> bool:
        """No logit_bias and no grammar: the logits are the model's own."""
        return self.logit_bias is None and self.structured_output is None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A repetition, presence or frequency penalty: the logits depend on the tokens so far."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def argmax_only(self) -> bool:
        """The token is the argmax of the raw logits (once ``min_tokens`` are out): greedy, with
        no logprobs, no logit_bias or grammar, no penalties."""
        return (self.greedy and self.logprobs is None and self.plain_logits
                and not self.penalized)
