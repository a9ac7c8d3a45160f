"""/v1/responses lines on the one request pipeline, on a tiny random-weight model: the same line
gives the same Response (or the same error) through ``boxcar run``, a file batch, an inline
batch and a job, and a Responses line runs exactly as the chat line it maps to."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from openai.types.responses import Response

from tests.conftest_services import wait_for
from tests.openai_shapes import check_line, error_of, strict
from tests.worker.test_request_pipeline import body_of, make_engine, run

URL = "/v1/responses"
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def resp(custom_id: str, input_: str | list = "Hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL,
            "body": {"input": input_, **body}}


def corpus() -> list[dict]:
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Oslo\", \"unit\": \"c\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "-3"},
    ]
    return [
        resp("greedy", "Tell me a story", instructions="Be brief.", max_output_tokens=6,
             temperature=0, metadata={"run": "1"}),
        resp("schema", "a number", max_output_tokens=40, temperature=0,
             text={"format": {"type": "json_schema", "name": "num", "schema": SCHEMA,
                              "strict": True}}),
        resp("named-tool", "weather?", max_output_tokens=80, temperature=0, tools=[WEATHER],
             tool_choice={"type": "function", "name": "get_weather"}),
        resp("history", history, max_output_tokens=4, temperature=0, tools=[WEATHER],
             tool_choice="none"),
        resp("cut", "Tell me a long story", max_output_tokens=3, temperature=0),
        resp("stream", stream=True),
        resp("previous", previous_response_id="resp_123"),
        resp("auto-tools", tools=[WEATHER]),
        resp("bad-schema", text={"format": {"type": "json_schema", "name": "x",
                                            "schema": {"type": "nonsense"}}}),
    ]


def outputs(lines: list[dict]) -> dict[str, dict]:
    result = {}
    for line in lines:
        check_line(line, URL if line["response"] and line["response"]["status_code"] == 200
                   else None)
        result[line["custom_id"]] = line
    return result


def comparable(line: dict) -> tuple:
    if line["response"] is None or line["response"]["status_code"] != 200:
        error = error_of(line)
        return ("error", error["code"], error["message"], error.get("param"))
    body = line["response"]["body"]
    items = [(i["type"], i.get("content") and i["content"][0]["text"], i.get("name"),
              i.get("arguments")) for i in body["output"]]
    return ("ok", body["status"], items, body["usage"]["input_tokens"],
            body["usage"]["output_tokens"])


def test_responses_lines_through_boxcar_run(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    result, summary = run(engine, tmp_path, corpus())
    assert summary.num_ok == 5 and summary.num_failed == 4
    greedy = strict(Response, body_of(result["greedy"]))
    assert greedy.id.startswith("resp_") and greedy.object == "response"
    assert greedy.instructions == "Be brief." and greedy.metadata == {"run": "1"}
    assert greedy.usage.output_tokens <= 6

    schema = strict(Response, body_of(result["schema"]))
    assert schema.status == "completed"
    jsonschema.validate(json.loads(schema.output_text), SCHEMA)

    named = strict(Response, body_of(result["named-tool"]))
    assert [item.type for item in named.output] == ["function_call"]
    call = named.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    cut = strict(Response, body_of(result["cut"]))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3

    assert error_of(result["stream"])["message"] == (
        "line 6: body.stream must be false: a batch line has one response")
    assert "no conversation store" in error_of(result["previous"])["message"]
    auto = error_of(result["auto-tools"])
    assert auto["param"] == "tool_choice" and "tool_choice 'auto'" in auto["message"]
    bad = error_of(result["bad-schema"])
    assert bad["code"] == "invalid_value" and bad["param"] == "body.text.format.schema"
    assert bad["message"].startswith("body.text.format.schema: ")


def test_a_responses_line_runs_as_the_chat_line_it_maps_to(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    responses, _ = run(engine, tmp_path, [
        resp("r", "Tell me a story", instructions="Be brief.", max_output_tokens=8,
             temperature=0)])
    chats, _ = run(engine, tmp_path, [
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Tell me a story"}],
            "max_completion_tokens": 8, "temperature": 0}}])
    response = body_of(responses["r"])
    completion = body_of(chats["c"])
    assert response["output"][0]["content"][0]["text"] == (
        completion["choices"][0]["message"]["content"])
    assert response["usage"]["input_tokens"] == completion["usage"]["prompt_tokens"]
    assert response["usage"]["output_tokens"] == completion["usage"]["completion_tokens"]
    assert completion["object"] == "chat.completion"


def test_boxcar_run_batches_and_jobs_give_the_same_responses(tiny_model_dir, tmp_path: Path,
                                                             make_stack, sqlite_url):
    lines = corpus()
    offline, _ = run(make_engine(tiny_model_dir), tmp_path, lines)

    stack = make_stack(sqlite_url)
    stack.add_worker(make_engine(tiny_model_dir))
    from_file = stack.wait_status(stack.create_batch(lines, endpoint=URL)["id"], "completed",
                                  timeout=120)
    assert from_file["endpoint"] == URL
    inline = stack.client.post("/v1/batches", json={
        "endpoint": URL, "completion_window": "24h",
        "requests": [{k: v for k, v in line.items() if k != "method"} for line in lines]})
    assert inline.status_code == 200, inline.text
    from_inline = stack.wait_status(inline.json()["id"], "completed", timeout=120)

    def served(batch: dict) -> dict[str, tuple]:
        found = outputs(stack.lines_of(batch["output_file_id"])
                        + stack.lines_of(batch["error_file_id"]))
        return {k: comparable(v) for k, v in found.items()}

    expected = {k: comparable(v) for k, v in offline.items()}
    assert served(from_file) == expected
    assert served(from_inline) == expected

    job = stack.client.post("/v1/jobs", json={"body": lines[0]["body"]})
    assert job.status_code == 200, job.text
    assert job.json()["endpoint"] == URL
    job_id = job.json()["id"]
    done = wait_for(lambda: (j := stack.client.get(f"/v1/jobs/{job_id}").json())["status"]
                    == "completed" and j, 60, 0.05, "the job")
    typed = strict(Response, done["result"])
    assert comparable({"response": {"status_code": 200, "body": done["result"]}}) == (
        expected["greedy"])
    assert typed.metadata == {"run": "1"}
    refused = stack.client.post("/v1/jobs", json={"body": {"input": "x", "stream": True}})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "body.stream must be false: a batch line has one response")
