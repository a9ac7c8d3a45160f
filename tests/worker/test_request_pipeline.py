"""The one request pipeline (``pipeline.engine_adapter``) on a tiny random-weight model: structured
outputs, tool calls, logit_bias and per-line errors, through ``boxcar run`` and through the
service (API + worker), which must agree line for line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from cli.offline import run_batch_file
from engine import EngineConfig, LLMEngine
from openai_format.tools import ToolCallMode, template_supports_tools, tool_calls_from_text
from pipeline.engine_adapter import PrepareError, prepare
from tests.engine.test_structured_output import SCHEMAS
from tests.openai_shapes import check_line, error_of, strict

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
    "strict": True}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer", "minimum": 0,
                                                       "maximum": 99},
                                                 "b": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = {"get_weather": WEATHER, "add": ADD}


def make_engine(model_dir: Path, max_model_len: int = 512) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), max_num_seqs=8, max_num_batched_tokens=128, num_kv_blocks=128,
        block_size=16, device="cpu", dtype="float32", max_model_len=max_model_len))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def chat(custom_id: str, content: str = "Hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": content}], **body}}


def completion(custom_id: str, prompt: str = "Once", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, **body}}


def json_schema(schema: dict, strict_mode: bool | None = None) -> dict:
    spec: dict = {"name": "out", "schema": schema}
    if strict_mode is not None:
        spec["strict"] = strict_mode
    return {"type": "json_schema", "json_schema": spec}


def run(engine, tmp_path: Path, lines: list) -> tuple[dict[str, dict], object]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    summary = run_batch_file(engine, path, out, progress=False)
    result = {}
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        check_line(line)
        result[line["custom_id"]] = line
    return result, summary


def body_of(line: dict) -> dict:
    assert line["response"]["status_code"] == 200, line
    return line["response"]["body"]


# --- structured outputs ------------------------------------------------------------------------


def test_every_json_schema_line_parses_and_validates(engine, tmp_path):
    lines = []
    for i, schema in enumerate(SCHEMAS):
        for strict_mode in (True, False):
            sampling = {"temperature": 0} if (i + strict_mode) % 2 else {"temperature": 1.0,
                                                                        "seed": i}
            lines.append(chat(f"s{i}-{strict_mode}", f"item {i}", max_tokens=300,
                              response_format=json_schema(schema, strict_mode), **sampling))
    lines.append(chat("obj", "any", max_tokens=300, temperature=0,
                      response_format={"type": "json_object"}))
    result, summary = run(engine, tmp_path, lines)
    assert summary.num_failed == 0
    completions, _ = run(engine, tmp_path, [completion(
        "cmpl-schema", "x", max_tokens=300, seed=3, response_format=json_schema(SCHEMAS[3]))])
    for i, schema in enumerate(SCHEMAS):
        for strict_mode in (True, False):
            choice = body_of(result[f"s{i}-{strict_mode}"])["choices"][0]
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    # json_object allows any object: random weights may ramble on until max_tokens.
    obj = body_of(result["obj"])["choices"][0]
    assert obj["finish_reason"] == "length" or isinstance(
        json.loads(obj["message"]["content"]), dict)
    text = body_of(completions["cmpl-schema"])["choices"][0]["text"]
    jsonschema.validate(json.loads(text), SCHEMAS[3])
    # One compiled grammar per distinct format (strict and loose differ), cached.
    assert engine.structured_output.num_cached >= len(SCHEMAS)


def test_max_tokens_cutting_the_json_is_length(engine, tmp_path):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    result, _ = run(engine, tmp_path, [
        chat("cut", max_tokens=5, temperature=0, response_format=json_schema(schema))])
    choice = body_of(result["cut"])["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


def test_bad_schemas_are_clear_line_errors(engine, tmp_path):
    result, summary = run(engine, tmp_path, [
        chat("bad-type", response_format=json_schema({"type": "nonsense"})),
        chat("bad-ref", response_format=json_schema({"$ref": "#/$defs/missing"})),
        chat("ok", max_tokens=2),
    ])
    for custom_id in ("bad-type", "bad-ref"):
        error = error_of(result[custom_id])
        assert error["code"] == "invalid_value"
        assert error["message"].startswith("body.response_format.json_schema.schema: ")
        assert error["param"] == "body.response_format.json_schema.schema"
    assert summary.num_ok == 1


# --- tool calls --------------------------------------------------------------------------------


def test_forced_tool_calls(engine, tmp_path):
    named = {"type": "function", "function": {"name": "get_weather"}}
    lines = [
        chat("named", "Weather in Paris?", tools=[WEATHER, ADD], tool_choice=named,
             temperature=0, max_tokens=200),
        chat("required", "2+3?", tools=[WEATHER, ADD], tool_choice="required", seed=1,
             max_tokens=200),
        chat("required-greedy", "2+3?", tools=[ADD], tool_choice="required", temperature=0,
             max_tokens=200),
        chat("none", "hi", tools=[ADD], tool_choice="none", max_tokens=3),
    ]
    result, summary = run(engine, tmp_path, lines)
    assert summary.num_failed == 0
    for custom_id in ("named", "required", "required-greedy"):
        choice = body_of(result[custom_id])["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None and len(message["tool_calls"]) == 1
        call = message["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        tool = TOOLS[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tool["function"]["parameters"])
    assert (body_of(result["named"])["choices"][0]["message"]["tool_calls"][0]["function"]
            ["name"] == "get_weather")
    none = body_of(result["none"])["choices"][0]
    assert "tool_calls" not in none["message"] and none["finish_reason"] == "length"


def test_a_forced_call_is_compact_json(engine):
    """tool_choice "required" / named: the grammar takes the call with no whitespace between
    JSON tokens, not pretty-printed; a response_format schema keeps allowing whitespace."""
    import xgrammar as xgr

    def grammar(**body):
        prepared = prepare(engine, CHAT, {"messages": [{"role": "user", "content": "2+3?"}],
                                          **body})
        assert not isinstance(prepared, PrepareError)
        fmt = prepared.params.structured_output
        assert fmt is not None
        return engine.structured_output.compile(fmt)

    def complete(compiled, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    named = {"type": "function", "function": {"name": "add"}}
    for compiled, value in ((grammar(tools=[WEATHER, ADD], tool_choice="required"), call),
                            (grammar(tools=[WEATHER, ADD], tool_choice=named),
                             call["arguments"])):
        assert complete(compiled, json.dumps(value, separators=(",", ":")))
        assert not complete(compiled, json.dumps(value))
        assert not complete(compiled, json.dumps(value, indent=2))
    schema = ADD["function"]["parameters"]
    assert complete(grammar(response_format=json_schema(schema)),
                    json.dumps(call["arguments"], indent=2))


def test_a_forced_call_fits_the_max_tokens_its_compact_text_needs(engine, tmp_path):
    """The longest compact ``add`` call, ``{"name":"add","arguments":{"a":99,"b":99}}``, is 43
    characters, so 44 tokens (one a character at least, and EOS) hold any call sampled. With
    whitespace allowed, this random model pretty-prints: the same schema as a response_format
    is cut at 44 (the greedy forced call took 119 tokens when its grammar allowed whitespace)."""
    call_schema = {"type": "object",
                   "properties": {"name": {"const": "add"},
                                  "arguments": ADD["function"]["parameters"]},
                   "required": ["name", "arguments"], "additionalProperties": False}
    samplings = [{"temperature": 0}, {"seed": 0}, {"seed": 1}, {"seed": 2}]
    lines = [chat(f"call-{i}", "2+3?", tools=[ADD], tool_choice="required", max_tokens=44,
                  **sampling) for i, sampling in enumerate(samplings)]
    lines += [chat(f"spaced-{i}", "2+3?", response_format=json_schema(call_schema),
                   max_tokens=44, **sampling) for i, sampling in enumerate(samplings)]
    result, summary = run(engine, tmp_path, lines)
    assert summary.num_failed == 0
    for i in range(len(samplings)):
        choice = body_of(result[f"call-{i}"])["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(arguments, ADD["function"]["parameters"])
        spaced = body_of(result[f"spaced-{i}"])["choices"][0]
        assert spaced["finish_reason"] == "length"
        assert any(c in spaced["message"]["content"] for c in " \t\r\n")


def test_auto_tool_choice_needs_a_template_that_writes_calls(engine, tmp_path):
    result, _ = run(engine, tmp_path, [chat("auto", tools=[ADD]),
                                       chat("auto2", tools=[ADD], tool_choice="auto")])
    for custom_id in ("auto", "auto2"):
        error = error_of(result[custom_id])
        assert error["code"] == "invalid_value" and error["param"] == "tool_choice"
        assert "tool_choice 'auto'" in error["message"]


def test_hermes_template_gets_tools_and_history_and_calls_are_parsed(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.tokenizer.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "Answer with <tool_call>{\"name\", \"arguments\"}</tool_call>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
        "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert template_supports_tools(engine.tokenizer.chat_template) == "hermes"
    body = {"tools": [ADD], "max_tokens": 2, "messages": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]}
    prepared = prepare(engine, CHAT, body)
    assert not isinstance(prepared, PrepareError)
    assert prepared.tool_mode == ToolCallMode("hermes")
    text = engine.tokenizer.decode(prepared.prompt)
    assert "<tools>add;</tools>" in text
    assert '<tool_call>add{"a": 2, "b": 3}</tool_call>' in text
    assert "<|im_start|>tool\n5" in text
    content, calls = tool_calls_from_text(
        ToolCallMode("hermes"),
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2})]
    assert tool_calls_from_text(ToolCallMode("hermes"), "no call") == ("no call", [])


def test_a_template_error_fails_only_its_line(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    engine.tokenizer.chat_template = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}")
    result, summary = run(engine, tmp_path, [
        {"custom_id": "sys", "method": "POST", "url": CHAT, "body": {
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}},
        chat("ok", max_tokens=2)])
    error = error_of(result["sys"])
    assert error["code"] == "invalid_request" and "no system role" in error["message"]
    assert summary.num_ok == 1


# Gemma's own chat template (gemma-2-it, gemma-3-it): no system role, turns must alternate.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


def test_gemma_refuses_a_system_role_as_a_line_error(tmp_path):
    from tests.conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / "gemma2", "gemma2", sliding_window=12)
    engine = make_engine(folder)
    engine.tokenizer.chat_template = GEMMA_TEMPLATE
    result, summary = run(engine, tmp_path, [
        {"custom_id": "sys", "method": "POST", "url": CHAT, "body": {
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}},
        {"custom_id": "twice", "method": "POST", "url": CHAT, "body": {
            "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}},
        chat("ok", max_tokens=2)])
    error = error_of(result["sys"])
    assert error["code"] == "invalid_request"
    assert "System role not supported" in error["message"] and "messages" in error["message"]
    assert "roles must alternate" in error_of(result["twice"])["message"]
    assert summary.num_ok == 1


# --- logit_bias --------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_on_both_endpoints(engine, tmp_path):
    forced = 65
    result, summary = run(engine, tmp_path, [
        chat("force", max_tokens=6, temperature=0, logit_bias={str(forced): 100}),
        chat("plain", max_tokens=6, temperature=0),
        chat("outside", logit_bias={"100000": 5}),
    ])
    text = body_of(result["force"])["choices"][0]["message"]["content"]
    assert text == engine.tokenizer.decode([forced] * 6)
    error = error_of(result["outside"])
    assert error["code"] == "invalid_value" and error["param"] == "logit_bias"
    assert "token id 100000 is outside the model's vocabulary" in error["message"]
    assert body_of(result["plain"])["choices"][0]["message"]["content"] != text
    # -100 bans: with every token but one banned, that one is all that can come out.
    vocab = engine.model_runner.vocab_size
    banned = {str(t): -100 for t in range(vocab) if t != forced}
    result, _ = run(engine, tmp_path, [
        completion("ban", "Once", max_tokens=4, temperature=0.8, seed=1, logit_bias=banned),
        completion("force", "Once", max_tokens=3, temperature=0, logit_bias={str(forced): 100}),
    ])
    assert body_of(result["ban"])["choices"][0]["text"] == engine.tokenizer.decode([forced] * 4)
    assert body_of(result["force"])["choices"][0]["text"] == engine.tokenizer.decode([forced] * 3)
    assert summary.num_failed == 1


# --- one pipeline: boxcar run and the service agree ---------------------------------------------


def corpus() -> list:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    return [
        "\ufeff" + json.dumps(chat("bom-first", "first line after a BOM", max_tokens=3,
                                   temperature=0)),
        chat("greedy", "Tell me a story", max_tokens=6, temperature=0),
        chat("seeded", "Tell me a story", max_tokens=6, temperature=0.9, seed=4, n=2),
        chat("schema", "a number", max_tokens=40, temperature=0,
             response_format=json_schema(schema, True)),
        chat("object", "anything", max_tokens=60, seed=2, response_format={"type": "json_object"}),
        chat("named-tool", "weather?", max_tokens=80, temperature=0, tools=[WEATHER],
             tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        chat("bias", max_tokens=3, temperature=0, logit_bias={"70": 100}),
        "{not json",
        {"method": "POST", "url": CHAT, "body": {}},
        chat("greedy", "again"),  # a repeated custom_id
        chat("bad-temp", temperature=3),
        chat("unknown-param", foo=1),
        chat("reasoning", reasoning_effort="low"),
        completion("other-url", "x"),
        chat("too-long", "word " * 300),
        chat("max-tokens-overflow", "hi", max_tokens=1000),
        chat("outside-vocab", logit_bias={"99999": 1}),
        chat("bad-schema", response_format=json_schema({"type": "nonsense"})),
        chat("auto-tools", tools=[ADD]),
        chat("stream", stream=True),
    ]


def comparable(line: dict) -> tuple:
    """What must be equal on both paths (ids and timestamps are not)."""
    check_line(line, CHAT)
    if line["response"] is None or line["response"]["status_code"] != 200:
        error = error_of(line)
        return ("error", error["code"], error["message"], error.get("param"))
    body = line["response"]["body"]
    choices = []
    for c in body["choices"]:
        message = dict(c["message"])
        calls = [(t["function"]["name"], t["function"]["arguments"])
                 for t in message.pop("tool_calls", None) or []]
        choices.append((message["content"], calls, c["finish_reason"]))
    return ("ok", choices, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])


def test_boxcar_run_and_the_service_give_the_same_lines(tiny_model_dir, tmp_path, make_stack,
                                                         sqlite_url):
    lines = corpus()
    offline, summary = run(make_engine(tiny_model_dir), tmp_path, lines)
    offline_lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]

    stack = make_stack(sqlite_url)
    stack.add_worker(make_engine(tiny_model_dir))
    done = stack.wait_status(stack.create_batch(lines)["id"], "completed", timeout=120)
    strict_batch = strict(__import__("openai").types.Batch, done)
    assert strict_batch.status == "completed"
    service_lines = (stack.lines_of(done["output_file_id"])
                     + stack.lines_of(done["error_file_id"]))

    def by_id(found: list[dict]) -> dict[str, list[tuple]]:
        result: dict[str, list[tuple]] = {}
        for line in found:
            result.setdefault(line["custom_id"], []).append(comparable(line))
        return {k: sorted(v, key=repr) for k, v in result.items()}

    assert by_id(offline_lines) == by_id(service_lines)
    assert set(offline) == {x["custom_id"] for x in lines if isinstance(x, dict)
                            and "custom_id" in x} | {"bom-first"}
    # Lines without a custom_id: by line number, in the summary and in the batch's errors.
    service_unnumbered = [(e["line"], e["code"], e["message"]) for e in done["errors"]["data"]
                          if e["code"] in ("invalid_json", "missing_custom_id")]
    assert [(e["line"], e["code"], e["message"]) for e in summary.line_errors] == (
        service_unnumbered)
    assert [e[:2] for e in service_unnumbered] == [(8, "invalid_json"), (9, "missing_custom_id")]
    assert summary.num_ok == done["request_counts"]["completed"] == 7
    assert summary.num_failed == done["request_counts"]["failed"]


def test_any_exception_while_preparing_fails_only_its_line(engine, tmp_path, monkeypatch):
    import pipeline.engine_adapter as adapter

    original_add = engine.add_request
    original_params = adapter.sampling_params

    def add(request_id, prompt, params, **kwargs):
        if params.seed == 666:
            raise RuntimeError("the grammar library crashed")
        return original_add(request_id, prompt, params, **kwargs)

    def params_of(sampling):
        if sampling["seed"] == 667:
            raise KeyError("unforeseen")
        return original_params(sampling)

    monkeypatch.setattr(engine, "add_request", add)
    monkeypatch.setattr(adapter, "sampling_params", params_of)
    result, summary = run(engine, tmp_path, [chat("crash", seed=666), chat("bug", seed=667),
                                             chat("ok", max_tokens=2)])
    for custom_id, fragment in (("crash", "the grammar library crashed"),
                                ("bug", "unforeseen")):
        error = error_of(result[custom_id])
        assert error["code"] == "server_error" and fragment in error["message"]
        assert result[custom_id]["response"]["status_code"] == 500
    assert summary.num_ok == 1
