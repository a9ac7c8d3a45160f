"""Structured output (json_schema / json_object / EBNF) and logit_bias on a tiny random model.

Random weights make these strong tests: unconstrained output is garbage, so every valid JSON
document below is the grammar mask's doing.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.errors import StructuredOutputError
from engine.outputs import RequestMetrics
from engine.runner.sampler import Sampler
from engine.sampling_params import StructuredOutputParams

SCHEMAS: list[dict] = [
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": -5, "maximum": 120},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"], "additionalProperties": False},
    {"type": "object",
     "properties": {"color": {"enum": ["red", "green"]},
                    "size": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "object",
     "properties": {"user": {"type": "object",
                             "properties": {"id": {"type": "integer", "minimum": 0,
                                                   "maximum": 999},
                                            "tag": {"type": "string", "maxLength": 3}},
                             "required": ["id", "tag"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object",
     "properties": {"xs": {"type": "array", "items": {"enum": ["a", "b"]},
                           "minItems": 1, "maxItems": 3}},
     "required": ["xs"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "boolean"}},
     "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"],
                "additionalProperties": False},
               {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1,
                                               "maxLength": 5}},
     "required": ["name"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object",
                      "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
    {"type": "object",
     "properties": {"level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
                    "kind": {"const": "fixed"}},
     "required": ["level", "kind"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def prompt_ids(llm, n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, llm.engine.model_runner.vocab_size, (n,), generator=g).tolist()


def schema_params(schema, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 400)
    return SamplingParams(structured_output=StructuredOutputParams(json_schema=schema), **kwargs)


def assert_valid(output, schema) -> None:
    assert output.finish_reason == "stop", (output.finish_reason, output.text)
    jsonschema.validate(json.loads(output.text), schema)


def test_every_json_schema_output_validates_beside_token_exact_neighbours(llm):
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)]
    plain_prompts = [prompt_ids(llm, 14, seed=100), prompt_ids(llm, 9, seed=101)]
    alone = [o.token_ids for o in llm.generate(plain_prompts, plain)]

    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(prompt_ids(llm, seed=i))
        # Greedy and seeded sampling alternate.
        params.append(schema_params(schema, temperature=0) if i % 2 == 0
                      else schema_params(schema, temperature=1.0, seed=i))
    outs = llm.generate(plain_prompts[:1] + prompts[:6] + plain_prompts[1:] + prompts[6:],
                        plain[:1] + params[:6] + plain[1:] + params[6:])
    assert outs[0].token_ids == alone[0]
    assert outs[7].token_ids == alone[1]
    structured = outs[1:7] + outs[8:]
    for schema, out in zip(SCHEMAS, structured, strict=True):
        assert_valid(out, schema)
    # The grammar ends the request with EOS, like a model that stops on its own.
    assert all(o.token_ids[-1] in llm.engine.eos_token_ids for o in structured)


def test_json_object_n_children_and_seeded_reproducibility(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=300,
                            structured_output=StructuredOutputParams(json_object=True))
    first = llm.generate([prompt_ids(llm, seed=7)], params)[0]
    again = llm.generate([prompt_ids(llm, seed=7)], params)[0]
    for a, b in zip(first.outputs, again.outputs, strict=True):
        assert a.finish_reason == "stop"
        assert isinstance(json.loads(a.text), dict)
        assert a.token_ids == b.token_ids


def test_preemption_keeps_grammar_state(tiny_model_dir):
    small = LLM(str(tiny_model_dir), num_kv_blocks=14, block_size=8, max_num_batched_tokens=32)
    schemas = SCHEMAS[3:9]
    outs = small.generate([prompt_ids(small, 20, seed=s) for s in range(len(schemas))],
                          [schema_params(s, temperature=1.0, seed=3) for s in schemas])
    stats = small.engine.get_stats()
    assert stats.num_preemptions > 0
    for schema, out in zip(schemas, outs, strict=True):
        assert_valid(out, schema)


def test_max_tokens_cuts_json_with_length(llm):
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 30}
    out = llm.generate([prompt_ids(llm)], schema_params(schema, temperature=0, max_tokens=6))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_stop_strings_still_apply_to_structured_output(llm):
    schema = SCHEMAS[3]
    full = llm.generate([prompt_ids(llm)], schema_params(schema, temperature=0))[0]
    assert '"size"' in full.text
    out = llm.generate([prompt_ids(llm)],
                       schema_params(schema, temperature=0, stop=['"size"']))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == '"size"'
    assert full.text.startswith(out.text) and '"size"' not in out.text


def test_ebnf_grammar(llm):
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=50, n=4,
                            structured_output=StructuredOutputParams(grammar=grammar))
    out = llm.generate([prompt_ids(llm)], params)[0]
    for child in out.outputs:
        word, number = child.text.split(" ")
        assert word in ("yes", "no") and number.isdigit() and len(number) <= 2


def test_compiled_grammars_are_cached_by_canonical_text(llm):
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"q": {"enum": ["cache-test"]}},
              "required": ["q"], "additionalProperties": False}
    compiles, hits = manager.num_compiles, manager.num_cache_hits
    spaced = json.dumps(schema, indent=4)
    outs = llm.generate([prompt_ids(llm)] * 3, [schema_params(schema, temperature=0),
                                                schema_params(spaced, temperature=0),
                                                schema_params(schema, temperature=0, n=2)])
    assert manager.num_compiles == compiles + 1
    assert manager.num_cache_hits == hits + 2
    assert all(json.loads(c.text) == {"q": "cache-test"} for o in outs for c in o.outputs)
    # strict and not strict are different grammars.
    loose = SamplingParams(max_tokens=50, structured_output=StructuredOutputParams(
        json_schema=schema, strict=False))
    llm.generate([prompt_ids(llm)], loose)
    assert manager.num_compiles == compiles + 2


def test_cache_is_bounded_lru(llm):
    from engine.core.structured_output import StructuredOutputManager

    manager = StructuredOutputManager(llm.tokenizer, llm.engine.model_runner.vocab_size,
                                      llm.engine.eos_token_ids, max_cached=2)
    formats = [StructuredOutputParams(json_schema={"const": k}) for k in ("a", "b", "c")]
    manager.compile(formats[0])
    manager.compile(formats[1])
    manager.compile(formats[0])  # a is now the most recent
    manager.compile(formats[2])  # evicts b
    assert manager.num_cached == 2 and manager.num_compiles == 3
    manager.compile(formats[0])
    assert manager.num_cache_hits == 2
    manager.compile(formats[1])
    assert manager.num_compiles == 4


@pytest.mark.parametrize("fmt, words", [
    (StructuredOutputParams(json_schema={"type": "colour"}), ["json_schema", "colour"]),
    (StructuredOutputParams(json_schema='{"type": '), ["json_schema", "not valid JSON"]),
    (StructuredOutputParams(json_schema={"type": "integer", "minimum": 5, "maximum": 1}),
     ["json_schema", "minimum"]),
    (StructuredOutputParams(json_schema={"type": "array", "minItems": "two"}),
     ["json_schema", "minItems"]),
    (StructuredOutputParams(json_schema={"$ref": "#/$defs/missing"}),
     ["json_schema", "missing"]),
    (StructuredOutputParams(grammar="root ::= undefined_rule"), ["grammar", "undefined_rule"]),
    (StructuredOutputParams(structural_tag={"type": "nonsense"}), ["structural_tag"]),
])
def test_bad_formats_raise_a_typed_error_at_add_request(llm, fmt, words):
    engine = llm.engine
    with pytest.raises(StructuredOutputError) as error:
        engine.add_request("bad-format", prompt_ids(llm), SamplingParams(structured_output=fmt))
    assert isinstance(error.value, ValueError)
    for word in words:
        assert word in str(error.value)
    assert not engine.has_unfinished_requests()


def test_structured_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(json_object=True, grammar="root ::= \"a\"")
    with pytest.raises(ValueError, match="json_schema must be a dict"):
        StructuredOutputParams(json_schema=[1, 2])  # type: ignore[arg-type]
    fmt = StructuredOutputParams(json_object=True)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output=fmt)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=fmt)


def test_batched_mask_matches_each_matcher_exactly(llm):
    """Row by row, the sampler's masked logits are -inf exactly where the row's own matcher
    rejects the token, and unconstrained rows are untouched."""
    engine = llm.engine
    manager = engine.structured_output
    vocab = engine.model_runner.vocab_size
    formats = [StructuredOutputParams(json_schema=SCHEMAS[3]),
               StructuredOutputParams(grammar='root ::= "ab" [0-9]+')]
    compiled = [manager.compile(f) for f in formats]
    prefixes = ['{"color": "re', "ab1"]

    def request(i: int, fmt) -> Request:
        params = SamplingParams(temperature=0, logprobs=3,
                                structured_output=fmt)
        r = Request(f"r{i}", [1, 2, 3], params, 10, engine.eos_token_ids,
                    RequestMetrics(0.0))
        return r

    rows = [request(0, formats[0]), request(1, None), request(2, formats[1])]
    for r, c, prefix in zip((rows[0], rows[2]), compiled, prefixes, strict=True):
        r.grammar = xgr.GrammarMatcher(c)
        assert r.grammar.accept_string(prefix)
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    from engine.core.structured_output import apply_grammar_masks

    apply_grammar_masks(masked, rows)
    assert torch.equal(masked[1], logits[1])
    for row, c, prefix in ((0, compiled[0], prefixes[0]), (2, compiled[1], prefixes[1])):
        allowed = []
        for token in range(vocab):
            m = xgr.GrammarMatcher(c)
            m.accept_string(prefix)
            allowed.append(m.accept_token(token))
        allowed_t = torch.tensor(allowed)
        assert allowed_t.any() and not allowed_t.all()
        assert torch.equal(masked[row] == float("-inf"), ~allowed_t)
        assert torch.equal(masked[row][allowed_t], logits[row][allowed_t])
    # The sampler picks the argmax among allowed tokens and reports post-mask logprobs.
    ids, logprobs = Sampler(vocab, 0)(logits.clone(), rows)
    for row in (0, 2):
        assert ids[row] == int(masked[row].argmax())
        lp = logprobs[row]
        assert lp is not None
        expected = torch.log_softmax(masked[row], -1)
        assert lp.logprob == pytest.approx(float(expected[ids[row]]))
        assert all(v != float("-inf") for _, v in lp.top)


def test_accept_tokens_advances_each_matcher_and_names_a_rejected_token(llm):
    """The step's sampled tokens go to their matchers in one batched call: each advances as
    its own ``accept_token`` would, and a token a grammar rejects (an engine bug: the mask
    allowed only accepted ones) is an error naming the request and the token."""
    from engine.core.structured_output import accept_tokens

    engine = llm.engine
    compiled = engine.structured_output.compile(
        StructuredOutputParams(grammar='root ::= "ab" [0-9]+'))
    vocab = engine.model_runner.vocab_size
    allowed = [t for t in range(vocab) if xgr.GrammarMatcher(compiled).accept_token(t)]
    rejected = next(t for t in range(vocab) if t not in allowed)

    def request(i: int, token: int) -> Request:
        r = Request(f"r{i}", [1, 2, 3, token], SamplingParams(temperature=0), 10,
                    engine.eos_token_ids, RequestMetrics(0.0))
        r.grammar = xgr.GrammarMatcher(compiled)
        return r

    rows = [request(0, allowed[0]), request(1, allowed[-1])]
    accept_tokens(rows, [r.token_ids[-1] for r in rows])
    for r in rows:  # each where its own matcher is after accepting the token alone
        twin = xgr.GrammarMatcher(compiled)
        assert twin.accept_token(r.token_ids[-1])
        masks = xgr.allocate_token_bitmask(2, vocab)
        r.grammar.fill_next_token_bitmask(masks, 0)
        twin.fill_next_token_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1])
        fresh = xgr.allocate_token_bitmask(1, vocab)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(fresh, 0)
        assert not torch.equal(masks[0], fresh[0])  # it did move
    with pytest.raises(RuntimeError, match=f"request r7: token {rejected} was sampled but its "
                                           "grammar rejects it"):
        accept_tokens([request(6, allowed[0]), request(7, rejected)], [allowed[0], rejected])


# ---- logit_bias -------------------------------------------------------------------------------


def test_logit_bias_bans_and_forces_greedy_and_sampled(llm):
    prompt = prompt_ids(llm, seed=3)
    base = dict(max_tokens=20, ignore_eos=True)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, **base))[0].token_ids
    # Ban every token greedy picked: none of them may appear.
    ban = {t: -100 for t in set(greedy)}
    banned = llm.generate([prompt], SamplingParams(temperature=0, logit_bias=ban, **base))[0]
    assert not set(banned.token_ids) & set(ban)
    sampled = llm.generate([prompt], SamplingParams(temperature=1.5, seed=2, logit_bias=ban,
                                                    **base))[0]
    assert not set(sampled.token_ids) & set(ban)
    # Force one token: +100 wins on every path.
    force = {77: 100}
    for params in (SamplingParams(temperature=0, logit_bias=force, **base),
                   SamplingParams(temperature=1.0, seed=4, logit_bias=force, **base),
                   SamplingParams(temperature=1.0, logit_bias=force, logprobs=2, **base)):
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == [77] * 20
    # A small bias shifts, and seeded sampling with it is reproducible.
    small = SamplingParams(temperature=1.0, seed=9, logit_bias={greedy[0]: 2.5, 5: -1}, **base)
    a, b = llm.generate([prompt, prompt], [small, small])
    assert a.token_ids == b.token_ids
    plain = SamplingParams(temperature=1.0, seed=9, **base)
    assert llm.generate([prompt], plain)[0].token_ids != a.token_ids


def test_logit_bias_logprobs_are_post_bias(llm):
    prompt = prompt_ids(llm, seed=4)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                logit_bias={42: 100}))[0]
    lp = out.outputs[0].logprobs[0]
    assert lp.token_id == 42 and lp.logprob > -1e-3 and lp.top[0][0] == 42


def test_logit_bias_validation(llm):
    with pytest.raises(ValueError, match=r"logit_bias\[3\]"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"3": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1})
    vocab = llm.engine.model_runner.vocab_size
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.engine.add_request("bias", prompt_ids(llm), SamplingParams(logit_bias={vocab: 1}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 4}])
def test_json_strings_take_only_valid_unescaped_characters(llm, schema):
    """xgrammar's own string classes let raw control characters (bounded strings) and encoded
    surrogates through; the compiled grammar must not."""
    compiled = llm.engine.structured_output.compile(StructuredOutputParams(json_schema=schema))

    def accepts(data: bytes) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(data)

    for good in (b'"ab', "\"é€".encode(), "\"😀".encode(), "\"ह".encode()):
        assert accepts(good), good
    for bad in (b'"a\x15', b'"\x00', b'"\xed\xa0\x80', b'"\xe0\x88\xa6', b'"\xc0\x80'):
        assert not accepts(bad), bad


# A forced tool call's schema (openai_format.tools.forced_call, tool_choice "required").
CALL_SCHEMA = {"anyOf": [{"type": "object",
                          "properties": {"name": {"const": "add"},
                                         "arguments": {"type": "object",
                                                       "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}},
                                                       "required": ["a", "b"],
                                                       "additionalProperties": False}},
                          "required": ["name", "arguments"], "additionalProperties": False}]}
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}


def test_compact_json_allows_no_whitespace_between_tokens(llm):
    """A compact format takes exactly ``json.dumps(separators=(",", ":"))``'s text; the default
    one still takes pretty-printed JSON. Distinct grammars, so distinct cache entries."""
    manager = llm.engine.structured_output

    def complete(fmt: StructuredOutputParams, text: str) -> bool:
        matcher = xgr.GrammarMatcher(manager.compile(fmt))
        return matcher.accept_string(text) and matcher.is_completed()

    compact = json.dumps(CALL, separators=(",", ":"))
    whitespaced = [json.dumps(CALL, indent=2), json.dumps(CALL), " " + compact, compact + "\n",
                   compact.replace(":", ": ", 1), compact.replace(",", ",\n", 1)]
    for fmt in (StructuredOutputParams(json_schema=CALL_SCHEMA, compact=True),
                StructuredOutputParams(json_schema=CALL_SCHEMA, strict=False, compact=True),
                StructuredOutputParams(json_object=True, compact=True)):
        assert complete(fmt, compact), fmt
        for text in whitespaced:
            assert not complete(fmt, text), (fmt, text)
    pretty = StructuredOutputParams(json_schema=CALL_SCHEMA)
    assert complete(pretty, compact) and complete(pretty, json.dumps(CALL, indent=2))
    assert complete(StructuredOutputParams(json_object=True), json.dumps(CALL, indent=2))
    assert manager.compile(pretty) is not manager.compile(
        StructuredOutputParams(json_schema=CALL_SCHEMA, compact=True))
    assert manager.compile(StructuredOutputParams(json_schema=CALL_SCHEMA, compact=True)) is \
        manager.compile(StructuredOutputParams(json_schema=json.dumps(CALL_SCHEMA), compact=True))
    with pytest.raises(ValueError, match="compact applies to json_schema and json_object"):
        StructuredOutputParams(grammar='root ::= "a"', compact=True)
    with pytest.raises(ValueError, match="compact must be a bool"):
        StructuredOutputParams(json_object=True, compact="yes")  # type: ignore[arg-type]
