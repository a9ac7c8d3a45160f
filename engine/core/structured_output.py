"""Structured output: a grammar per distinct request format, a matcher per sequence, and the
batched token bitmask the sampler applies (xgrammar, CPU bitmask path).

``StructuredOutputManager.matchers`` is called at ``add_request`` time, so a bad schema or grammar
raises ``StructuredOutputError`` (a ``ValueError``) there, naming the problem. Compiled grammars
are cached (LRU, bounded) by the canonical text of the format: the same schema written with
other whitespace is one cache entry. Each sequence (each of n children) gets its own
``GrammarMatcher``; the engine advances it only on newly sampled tokens, never on recompute after
preemption (the output tokens are kept and recomputed, not sampled again).
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.errors import StructuredOutputError
from engine.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    # Annotations only: the worker's request pipeline imports this module for its error type,
    # and a process that never steps a model (a test's or a benchmark's fake engine) should not
    # pay torch's import (~4 s of CPU, ~270 MiB RSS, measured).
    import torch
    import xgrammar as xgr

    from engine.core.request import Request

# Whitespace runs the JSON grammar allows between tokens: a small model can otherwise loop on
# newlines until max_tokens. 16 fits a few levels of pretty-printing indentation. A compact
# format (a forced tool call) allows none: json.dumps(separators=(",", ":")).
MAX_JSON_WHITESPACE = 16
_COMPACT_SEPARATORS = (",", ":")
DEFAULT_MAX_CACHED_GRAMMARS = 128


def canonical_key(params: StructuredOutputParams) -> tuple[str, str, bool]:
    """(kind, canonical text, compact): JSON re-serialized compactly, key order kept (it is the
    order the properties are generated in)."""
    if params.json_object:
        return ("json_object", "", params.compact)
    if params.json_schema is not None:
        schema = _load_json(params.json_schema, "json_schema")
        _check_schema(schema)
        kind = "json_schema" if params.strict else "json_schema_loose"
        return (kind, _dump(schema), params.compact)
    if params.structural_tag is not None:
        return ("structural_tag", _dump(_load_json(params.structural_tag, "structural_tag")),
                False)
    assert params.grammar is not None
    return ("grammar", params.grammar, False)


class StructuredOutputManager:
    """Compiles request formats for one tokenizer/vocabulary and hands out matchers."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_cached: int = DEFAULT_MAX_CACHED_GRAMMARS,
    ) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        # vocab_size is the model's (padded) vocabulary: ids past the tokenizer's are masked.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        # Our own LRU below is the cache; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2,
                                            cache_enabled=False)
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str, bool], xgr.CompiledGrammar] = OrderedDict()
        self.num_cache_hits = 0
        self.num_compiles = 0

    def compile(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        key = canonical_key(params)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return compiled
        compiled = self._compile(*key)
        self.num_compiles += 1
        self._cache[key] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def matchers(self, params: StructuredOutputParams, n: int) -> list[xgr.GrammarMatcher]:
        """One matcher per sequence (n > 1: one per child) over one compiled grammar."""
        import xgrammar as xgr

        compiled = self.compile(params)
        return [xgr.GrammarMatcher(compiled) for _ in range(n)]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, kind: str, text: str, compact: bool) -> xgr.CompiledGrammar:
        compiler = self.compiler
        try:
            if kind == "json_object":
                return compiler.compile_grammar(
                    _json_schema_ebnf('{"type": "object"}', False, compact))
            if kind in ("json_schema", "json_schema_loose"):
                return compiler.compile_grammar(
                    _json_schema_ebnf(text, kind == "json_schema", compact))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as error:
            field = {"json_schema_loose": "json_schema"}.get(kind, kind)
            raise StructuredOutputError(
                f"structured_output.{field} is not supported: {_clean(error)}"
            ) from error


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request]) -> None:
    """Set to -inf, in place, every token the row's grammar does not allow next. One bitmask
    ``[num_rows, ceil(vocab / 32)]`` is filled on the host for the constrained rows in one call
    (xgrammar's ``BatchGrammarMatcher``, over threads where the logits are on a GPU; a call a
    row took 208-374 us for 256 JSON rows at a vocabulary of 1,024, the batched call 76, issue
    46), copied to the logits' device without blocking and applied there in one call.
    """
    rows = [i for i, r in enumerate(requests) if _constrained(r)]
    if not rows:
        return
    import xgrammar as xgr  # only once a request has a grammar: the import takes ~1 s

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(requests), vocab)  # [num_rows, ceil(vocab / 32)]
    matchers = _matchers([requests[i] for i in rows])
    _batch_matcher(logits.device).batch_fill_next_token_bitmask(matchers, bitmask,
                                                                indices=rows)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=vocab, indices=rows)


def accept_tokens(requests: list[Request], tokens: list[int]) -> None:
    """Advance each request's matcher by the token just drawn for it, in one call: where it is
    drawn (the sampler), so that no step waits for the host to advance it (async scheduling).
    A terminated matcher's request has ended (``_constrained``): it takes none."""
    live = [(r, t) for r, t in zip(requests, tokens, strict=True) if _constrained(r)]
    if not live:
        return
    import xgrammar as xgr

    requests = [r for r, _ in live]
    tokens = [t for _, t in live]
    accepted = xgr.BatchGrammarMatcher.batch_accept_token(_matchers(requests), tokens)
    for request, token_id, ok in zip(requests, tokens, accepted, strict=True):
        if not ok:
            # The mask allowed only tokens the matcher accepts: an engine bug, not input.
            raise RuntimeError(f"request {request.request_id}: token {token_id} was sampled "
                               "but its grammar rejects it")


def _constrained(request: Request) -> bool:
    """A grammar that still rules the request's next token. A terminated matcher (its EOS
    accepted) is a request that ended the step before, still drawn for by a step in flight
    (async scheduling): its token is dropped, its row left unconstrained."""
    return request.grammar is not None and not request.grammar.is_terminated()


def _matchers(requests: list[Request]) -> list[xgr.GrammarMatcher]:
    matchers = [r.grammar for r in requests]
    assert all(m is not None for m in matchers)  # (requests with a grammar)
    return matchers  # type: ignore[return-value]


_BATCH_MATCHERS: dict[int, xgr.BatchGrammarMatcher] = {}
# Threads the batched bitmask fill takes beside a GPU's logits; beside a CPU's, one: the model's
# OpenMP threads spin on the cores between ops, and two xgrammar threads among them made a
# 256-row step's sampling 3.7x slower (756 -> 2,769 us; 2 cores, `python -m bench.step_overhead
# --structured`).
GPU_FILL_THREADS = 8


def _batch_matcher(device: torch.device) -> xgr.BatchGrammarMatcher:
    """The process's batch matcher for logits on ``device`` (made at first use)."""
    threads = 1 if device.type == "cpu" else min(GPU_FILL_THREADS, os.cpu_count() or 1)
    matcher = _BATCH_MATCHERS.get(threads)
    if matcher is None:
        import xgrammar as xgr

        matcher = _BATCH_MATCHERS[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
    return matcher


def _load_json(value: str | dict[str, Any], field: str) -> Any:
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise StructuredOutputError(
            f"structured_output.{field} is not valid JSON: {error}"
        ) from error


def _check_schema(schema: Any) -> None:
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError(
            f"structured_output.json_schema must be a JSON object, got {type(schema).__name__}"
        )
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise StructuredOutputError(
            f"structured_output.json_schema is not a valid JSON Schema at {where}: "
            f"{error.message}"
        ) from error


# xgrammar 0.2.9 writes JSON string characters as these classes. The length-bounded one lets raw
# control characters through (JSON parsers reject them) and both let UTF-8-encoded surrogates
# through (they decode to U+FFFD); a model with random weights emits both. The EBNF class below
# is exact: it also rejects overlong encodings, unlike the same class in a regex.
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_STRING_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'


def _json_schema_ebnf(schema_text: str, strict: bool, compact: bool) -> str:
    import xgrammar as xgr

    if compact:
        grammar = xgr.Grammar.from_json_schema(
            schema_text, strict_mode=strict, any_whitespace=False,
            separators=_COMPACT_SEPARATORS,
        )
    else:
        grammar = xgr.Grammar.from_json_schema(
            schema_text, strict_mode=strict, max_whitespace_cnt=MAX_JSON_WHITESPACE
        )
    text = str(grammar)
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _STRING_CHAR)
    return text


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _clean(error: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and source location; keep the message."""
    text = str(error).strip()
    text = _CPP_PREFIX.sub("", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")
