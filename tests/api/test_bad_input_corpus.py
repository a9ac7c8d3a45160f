"""A corpus of malformed inputs at every entry point: auth and headers, query parameters, request
bodies, whole files, and single lines of a batch file. Each gets a precise error (status, code,
param, message); a bad line fails alone while the rest of its batch runs (on the real engine,
tiny model: the context-length checks need one)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api import uploads
from service.keys import create_key, revoke_key
from service.models import Batch
from service.served_models import default_model
from tests.conftest_services import chat_line, completion_line, jsonl, make_key, wait_for
from tests.figures import record
from tests.openai_shapes import check_line, error_of
from worker.process import WorkerService

ENGINE_OPTIONS = {"device": "cpu", "max_num_seqs": 8, "num_kv_blocks": 256, "num_threads": 1}
TABLE = "Bad-input corpus: precise errors at every entry point"


@dataclass(frozen=True)
class Case:
    name: str
    entry: str  # auth, header, params, body, file
    method: str
    path: str
    kwargs: dict
    status: int
    code: str | None
    param: str | None
    fragment: str


def _upload(content: bytes, purpose: str | None = "batch", name: str = "in.jsonl") -> dict:
    data = {} if purpose is None else {"purpose": purpose}
    return {"data": data, "files": {"file": (name, content)}}


def _batch(**body) -> dict:
    base = {"input_file_id": "{file}", "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}
    return {"json": {**base, **body}}


GOOD = jsonl([chat_line("g", "hi")])
PRIVATE = "points at"

CASES = [
    # auth
    Case("no Authorization header", "auth", "GET", "/v1/batches", {"headers": {
        "Authorization": ""}}, 401, "invalid_api_key", None, "Missing API key"),
    Case("Basic instead of Bearer", "auth", "GET", "/v1/files", {"headers": {
        "Authorization": "Basic dXNlcjpwYXNz"}}, 401, "invalid_api_key", None,
         "Unsupported authorization scheme"),
    Case("a key without the Bearer scheme", "auth", "GET", "/v1/files", {"headers": {
        "Authorization": "bx-just-the-key-here"}}, 401, "invalid_api_key", None,
         "Unsupported authorization scheme"),
    Case("empty bearer key", "auth", "GET", "/v1/files", {"headers": {
        "Authorization": "Bearer   "}}, 401, "invalid_api_key", None, "Missing API key"),
    Case("wrong API key", "auth", "GET", "/v1/files", {"headers": {
        "Authorization": "Bearer bx-not-a-key-of-this-service"}}, 401, "invalid_api_key", None,
        "Incorrect API key"),
    Case("revoked API key", "auth", "GET", "/v1/files", {"headers": {
        "Authorization": "Bearer {revoked}"}}, 401, "invalid_api_key", None,
        "Incorrect API key"),
    # headers and body framing
    Case("JSON body where multipart is expected", "header", "POST", "/v1/files",
         {"json": {"file": "x"}}, 400, "invalid_request", None, "multipart/form-data"),
    Case("multipart without a boundary", "header", "POST", "/v1/files", {
        "content": b"x", "headers": {"content-type": "multipart/form-data"}}, 400,
        "invalid_request", None, "multipart/form-data"),
    Case("declared length over the limit", "header", "POST", "/v1/files", {
        "content": b"x", "headers": {"content-type": "multipart/form-data; boundary=b",
                                     "content-length": str(1 << 30)}},
         400, "file_too_large", "file", "limit of 65,536 bytes"),
    Case("body that is not JSON", "body", "POST", "/v1/batches", {
        "content": b'{"endpoint": ', "headers": {"content-type": "application/json"}},
         400, "invalid_json", None, "not valid JSON"),
    Case("body that is a JSON list", "body", "POST", "/v1/batches", {"json": [1, 2]}, 400,
         "invalid_request", None, "must be a JSON object"),
    # query parameters
    Case("limit=0", "params", "GET", "/v1/batches", {"params": {"limit": 0}}, 400,
         "invalid_request", "limit", "greater than or equal to 1"),
    Case("limit=1000 on batches", "params", "GET", "/v1/batches", {"params": {"limit": 1000}},
         400, "invalid_request", "limit", "less than or equal to 100"),
    Case("limit not a number", "params", "GET", "/v1/files", {"params": {"limit": "many"}}, 400,
         "invalid_request", "limit", "valid integer"),
    Case("order=sideways", "params", "GET", "/v1/files", {"params": {"order": "sideways"}}, 400,
         "invalid_request", "order", "'asc' or 'desc'"),
    Case("after= an unknown id", "params", "GET", "/v1/batches", {"params": {
        "after": "batch_nope"}}, 404, "not_found", None, "No such batch"),
    # files
    Case("empty file", "file", "POST", "/v1/files", _upload(b""), 400, "invalid_file", "file",
         "File is empty"),
    Case("only blank lines", "file", "POST", "/v1/files", _upload(b"  \n\r\n\n"), 400,
         "invalid_file", "file", "File is empty"),
    Case("a CSV file", "file", "POST", "/v1/files", _upload(b"a,b\n1,2\n", name="x.csv"), 400,
         "invalid_file", "file", "not JSONL"),
    Case("binary, not UTF-8", "file", "POST", "/v1/files", _upload(b"\x89PNG\r\n\x1a\n\xff\xfe"),
         400, "invalid_file", "file", "not valid UTF-8"),
    Case("one JSON array, not lines", "file", "POST", "/v1/files", _upload(
        json.dumps([chat_line("a", "hi")]).encode()), 400, "invalid_file", "file",
        "got a list"),
    Case("file over the byte limit", "file", "POST", "/v1/files", _upload(
        GOOD * (70_000 // len(GOOD))), 400, "file_too_large", "file", "limit of 65,536 bytes"),
    Case("file over the line limit", "file", "POST", "/v1/files", _upload(
        jsonl([chat_line(f"l{i}", "hi") for i in range(51)])), 400, "too_many_lines", "file",
        "more than 50 lines"),
    Case("a line over the line-size limit", "file", "POST", "/v1/files", _upload(
        jsonl([chat_line("long", "x" * 3000)])), 400, "invalid_file", "file",
        "longer than 2048 bytes"),
    Case("purpose missing", "file", "POST", "/v1/files", _upload(GOOD, purpose=None), 400,
         "invalid_request", "purpose", "Missing required parameter: 'purpose'"),
    Case("purpose fine-tune", "file", "POST", "/v1/files", _upload(GOOD, purpose="fine-tune"),
         400, "invalid_purpose", "purpose", "accepts 'batch'"),
    Case("file part missing", "file", "POST", "/v1/files", {"data": {"purpose": "batch"},
         "files": {"other": ("x", b"1")}}, 400, "invalid_request", "file",
         "Missing required parameter: 'file'"),
    # batch bodies
    Case("unknown endpoint", "body", "POST", "/v1/batches", _batch(endpoint="/v1/moderations"),
         400, "invalid_endpoint", "endpoint", "supported are"),
    Case("unsupported completion window", "body", "POST", "/v1/batches",
         _batch(completion_window="7d"), 400, "invalid_completion_window",
         "completion_window", "supported are 24h, 1h"),
    Case("malformed completion window", "body", "POST", "/v1/batches",
         _batch(completion_window="soon"), 400, "invalid_completion_window",
         "completion_window", "'soon'"),
    Case("metadata with 17 keys", "body", "POST", "/v1/batches",
         _batch(metadata={f"k{i}": "v" for i in range(17)}), 400, "invalid_metadata",
         "metadata", "metadata must hold at most 16 pairs, got 17"),
    Case("metadata value of 600 chars", "body", "POST", "/v1/batches",
         _batch(metadata={"k": "v" * 600}), 400, "invalid_metadata", "metadata",
         "values must be at most 512 characters, got 600 for key 'k'"),
    Case("metadata key of 65 chars", "body", "POST", "/v1/batches",
         _batch(metadata={"k" * 65: "v"}), 400, "invalid_metadata", "metadata",
         "keys must be at most 64 characters, got 65"),
    Case("output_expires_after under an hour", "body", "POST", "/v1/batches",
         _batch(output_expires_after={"anchor": "created_at", "seconds": 60}), 400,
         "invalid_expires_after", "output_expires_after.seconds",
         "between 3600 (1 hour) and 2592000 (30 days), got 60"),
    Case("metadata value not a string", "body", "POST", "/v1/batches",
         _batch(metadata={"k": 1}), 400, "invalid_request", "metadata.k", "valid string"),
    Case("webhook to loopback", "body", "POST", "/v1/batches",
         _batch(webhook_url="http://127.0.0.1:8080/hook"), 400, "invalid_webhook_url",
         "webhook_url", PRIVATE),
    Case("webhook to cloud metadata", "body", "POST", "/v1/batches",
         _batch(webhook_url="http://169.254.169.254/latest"), 400, "invalid_webhook_url",
         "webhook_url", "non-public address 169.254.169.254"),
    Case("webhook to localhost", "body", "POST", "/v1/batches",
         _batch(webhook_url="http://localhost/hook"), 400, "invalid_webhook_url",
         "webhook_url", "localhost"),
    Case("webhook not http", "body", "POST", "/v1/batches",
         _batch(webhook_url="ftp://example.com/x"), 400, "invalid_webhook_url", "webhook_url",
         "absolute http(s) URL"),
    Case("priority 101", "body", "POST", "/v1/batches", _batch(priority=101), 400,
         "invalid_request", "priority", "less than or equal to 100"),
    Case("batch priority above the tenant cap", "body", "POST", "/v1/batches",
         _batch(priority=11), 400, "invalid_priority", "priority", "ask for (10;"),
    Case("job priority above the tenant cap", "body", "POST", "/v1/jobs", {"json": {
        "body": {"prompt": "x"}, "priority": 50}}, 400, "invalid_priority", "priority",
         "priority 50 is above"),
    Case("job priority negative", "body", "POST", "/v1/jobs", {"json": {
        "body": {"prompt": "x"}, "priority": -1}}, 400, "invalid_request", "priority",
         "greater than or equal to 0"),
    Case("both a file and requests", "body", "POST", "/v1/batches",
         _batch(requests=[{"custom_id": "a", "body": {}}]), 400, "invalid_request",
         "input_file_id", "exactly one"),
    Case("empty requests", "body", "POST", "/v1/batches", {"json": {
        "endpoint": "/v1/chat/completions", "requests": []}}, 400, "invalid_request",
         "requests", "must not be empty"),
    Case("an input file that does not exist", "body", "POST", "/v1/batches",
         _batch(input_file_id="file-nope"), 404, "not_found", None, "No such file"),
    Case("a file with no valid line", "body", "POST", "/v1/batches",
         _batch(input_file_id="{bad_file}"), 400, "invalid_file", "input_file_id",
         "no valid request lines"),
    Case("cancel a completed batch", "body", "POST", "/v1/batches/{done_batch}/cancel", {}, 409,
         "invalid_state", None, "cannot be cancelled: it is completed"),
    # jobs and webhooks
    Case("job body for neither endpoint", "body", "POST", "/v1/jobs", {"json": {
        "body": {"model": "x"}}}, 400, "invalid_request", "body", "body.prompt is required"),
    Case("job with absurd temperature", "body", "POST", "/v1/jobs", {"json": {"body": {
        "messages": [{"role": "user", "content": "hi"}], "temperature": 1e9}}}, 400,
         "invalid_value", "body", "between 0 and 2"),
    Case("job with a private webhook", "body", "POST", "/v1/jobs", {"json": {
        "body": {"prompt": "hi"}, "webhook_url": "http://10.0.0.8/x"}}, 400,
         "invalid_webhook_url", "webhook_url", "non-public address 10.0.0.8"),
    Case("webhook endpoint on a private network", "body", "POST", "/v1/webhook_endpoints",
         {"json": {"url": "http://192.168.1.10/hook"}}, 400, "invalid_webhook_url", "url",
         "192.168.1.10"),
    Case("webhook endpoint for unknown events", "body", "POST", "/v1/webhook_endpoints",
         {"json": {"url": "https://example.com/h", "events": ["batch.exploded"]}}, 400,
         "invalid_events", "events", "batch.exploded"),
    # another tenant's ids
    Case("another tenant's file", "auth", "GET", "/v1/files/{other_file}", {}, 404,
         "not_found", None, "No such file"),
    Case("another tenant's file content", "auth", "GET", "/v1/files/{other_file}/content", {},
         404, "not_found", None, "No such file"),
    Case("another tenant's batch", "auth", "GET", "/v1/batches/{other_batch}", {}, 404,
         "not_found", None, "No such batch"),
    Case("cancel another tenant's batch", "auth", "POST", "/v1/batches/{other_batch}/cancel",
         {}, 404, "not_found", None, "No such batch"),
    Case("a batch on another tenant's file", "auth", "POST", "/v1/batches",
         _batch(input_file_id="{other_file}"), 404, "not_found", None, "No such file"),
]


@pytest.fixture
def ids(client, ctx, settings) -> dict[str, str]:
    """The objects the cases refer to: own files and batches, another tenant's, a revoked key."""
    def upload(c: TestClient, content: bytes) -> str:
        response = c.post("/v1/files", **_upload(content))
        assert response.status_code == 200, response.text
        return response.json()["id"]

    other_key = make_key(ctx.db, "other-tenant")
    with TestClient(client.app, headers={"Authorization": f"Bearer {other_key}"}) as other:
        other_file = upload(other, GOOD)
        other_batch = other.post("/v1/batches", json={
            "input_file_id": other_file, "endpoint": "/v1/chat/completions"}).json()["id"]
    own_file = upload(client, GOOD)
    done_batch = client.post("/v1/batches", json={
        "input_file_id": own_file, "endpoint": "/v1/chat/completions"}).json()["id"]
    with ctx.db.session() as session:
        session.execute(update(Batch).where(Batch.id == done_batch).values(status="completed"))
        revoked = create_key(session, tenant_name="acme")
        revoke_key(session, key_id=revoked.key_id)
    return {"file": own_file, "bad_file": upload(client, b'{"custom_id": 1}\n'),
            "other_file": other_file, "other_batch": other_batch, "done_batch": done_batch,
            "revoked": revoked.key}


def _fill(value, ids: dict[str, str]):
    if isinstance(value, str):
        return value.format(**ids) if "{" in value and "}" in value else value
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    return value


def test_the_corpus_is_large_enough():
    assert len(CASES) + len(LINE_CASES) >= 30
    assert {c.entry for c in CASES} == {"auth", "header", "params", "body", "file"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_request_gets_a_precise_error(case: Case, client, ids, monkeypatch):
    monkeypatch.setattr(uploads, "MAX_LINE_BYTES", 2048)
    kwargs = dict(case.kwargs)
    if "json" in kwargs or "headers" in kwargs:
        kwargs = {k: (_fill(v, ids) if k in ("json", "headers") else v)
                  for k, v in kwargs.items()}
    if kwargs.get("headers", {}).get("Authorization") == "":
        headers = {k: v for k, v in client.headers.items() if k.lower() != "authorization"}
        with TestClient(client.app, headers=headers) as anonymous:
            response = anonymous.request(case.method, case.path, params=kwargs.get("params"))
    else:
        response = client.request(case.method, _fill(case.path, ids), **kwargs)
    assert response.status_code == case.status, response.text
    error = response.json()["error"]
    assert error["code"] == case.code, error
    assert error["param"] == case.param, error
    assert case.fragment in error["message"], error
    assert "Traceback" not in response.text
    if case.status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    record(TABLE, entry=case.entry, input=case.name, status=case.status, code=case.code,
           param=case.param, message=error["message"][:70])


# ---------------------------------------------------------------------------------------------
# Lines: one file of good and bad lines, run on the tiny model; each bad line fails alone.

def _raw(text: str) -> bytes:
    return text.encode()


LINE_CASES: list[tuple[str, bytes, str | None, str, str]] = [
    # (name, line, custom_id in the error file, code, message fragment)
    ("invalid UTF-8", b'{"custom_id": "u\xff"}', None, "invalid_json", "not valid UTF-8"),
    ("not JSON", _raw('{"custom_id": "nj",'), None, "invalid_json", "not valid JSON"),
    ("a JSON list", _raw("[1, 2]"), None, "invalid_request", "expected a JSON object"),
    ("custom_id missing", _raw(json.dumps({"method": "POST", "url": "/v1/chat/completions",
                                           "body": {"messages": []}})),
     None, "missing_custom_id", "custom_id is missing"),
    ("custom_id empty", _raw(json.dumps({**chat_line("", "x")})), None,
     "missing_custom_id", "non-empty string"),
    ("custom_id a number", _raw(json.dumps({**chat_line("x", "x"), "custom_id": 7})),
     None, "missing_custom_id", "non-empty string"),
    ("custom_id repeated", _raw(json.dumps(chat_line("good-0", "again"))), "good-0",
     "duplicate_custom_id", "used by an earlier line"),
    ("method GET", _raw(json.dumps({**chat_line("get", "x"), "method": "GET"})), "get",
     "invalid_method", "method must be 'POST'"),
    ("unknown url", _raw(json.dumps({**chat_line("emb", "x"), "url": "/v1/moderations"})),
     "emb", "invalid_url", "'/v1/moderations'"),
    ("body missing", _raw(json.dumps({"custom_id": "nob", "method": "POST",
                                      "url": "/v1/chat/completions"})),
     "nob", "invalid_request", "body is missing"),
    ("body a string", _raw(json.dumps({**chat_line("strb", "x"), "body": "hi"})), "strb",
     "invalid_request", "body must be an object, got a string"),
    ("chat body without messages", _raw(json.dumps({**chat_line("wrong", "x"),
                                                    "body": {"prompt": "x"}})),
     "wrong", "invalid_value", "body.prompt is not a supported parameter"),
    ("unknown parameter", _raw(json.dumps(chat_line("unk", "x", temprature=0.5))), "unk",
     "invalid_value", "body.temprature is not a supported parameter"),
    ("reasoning_effort", _raw(json.dumps(chat_line("re", "x", reasoning_effort="low"))), "re",
     "invalid_value", "body.reasoning_effort is not supported"),
    ("logit_bias key not a token id", _raw(json.dumps(chat_line("lbk", "x",
                                                                logit_bias={"a": 1}))),
     "lbk", "invalid_value", "body.logit_bias keys must be token ids"),
    ("logit_bias 200", _raw(json.dumps(chat_line("lbv", "x", logit_bias={"5": 200}))),
     "lbv", "invalid_value", "between -100 and 100"),
    ("json_schema without a schema spec", _raw(json.dumps(chat_line(
        "rf", "x", response_format={"type": "json_schema"}))), "rf", "invalid_value",
     "body.response_format.json_schema is required"),
    ("tool_choice without tools", _raw(json.dumps(chat_line("tc", "x", tool_choice="required"))),
     "tc", "invalid_value", "body.tool_choice requires body.tools"),
    ("negative temperature", _raw(json.dumps(chat_line("t-", "x", temperature=-0.5))), "t-",
     "invalid_value", "body.temperature must be between 0 and 2"),
    ("absurd temperature", _raw(json.dumps(chat_line("t+", "x", temperature=1e300))), "t+",
     "invalid_value", "body.temperature must be between 0 and 2"),
    ("NaN temperature", _raw(json.dumps(chat_line("tnan", "x")).replace(
        '"max_tokens": 4', '"max_tokens": 4, "temperature": NaN')), "tnan", "invalid_value",
     "body.temperature must be between 0 and 2"),
    ("top_p 0", _raw(json.dumps(chat_line("p0", "x", top_p=0))), "p0", "invalid_value",
     "body.top_p must be greater than 0"),
    ("n = 1000", _raw(json.dumps(chat_line("n", "x", n=1000))), "n", "invalid_value",
     "body.n must be between 1 and 128"),
    ("max_tokens 0", _raw(json.dumps(chat_line("m0", "x", max_tokens=0))), "m0",
     "invalid_value", "body.max_tokens must be an integer >= 1"),
    ("max_tokens a string", _raw(json.dumps(chat_line("ms", "x", max_tokens="10"))), "ms",
     "invalid_request", "body.max_tokens must be an integer, got a string"),
    ("presence_penalty 5", _raw(json.dumps(chat_line("pp", "x", presence_penalty=5))), "pp",
     "invalid_value", "body.presence_penalty must be between -2 and 2"),
    ("top_logprobs 50", _raw(json.dumps(chat_line("lp", "x", logprobs=True, top_logprobs=50))),
     "lp", "invalid_value", "body.top_logprobs must be between 0 and 20"),
    ("min_tokens over max_tokens", _raw(json.dumps(chat_line("mt", "x", min_tokens=9))), "mt",
     "invalid_value", "body.min_tokens must be <= max_tokens (4)"),
    ("an empty stop string", _raw(json.dumps(chat_line("st", "x", stop=[""]))), "st",
     "invalid_value", "must not contain empty strings"),
    ("stream true", _raw(json.dumps(chat_line("sm", "x", stream=True))), "sm", "invalid_value",
     "body.stream must be false"),
    ("no messages", _raw(json.dumps({**chat_line("nm", "x"), "body": {"messages": []}})), "nm",
     "invalid_value", "body.messages must not be empty"),
    ("unknown role", _raw(json.dumps({**chat_line("role", "x"), "body": {
        "messages": [{"role": "wizard", "content": "x"}]}})), "role", "invalid_value",
     "body.messages[0].role must be"),
    ("an image part", _raw(json.dumps({**chat_line("img", "x"), "body": {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}})),
     "img", "invalid_value", "only text parts are supported"),
    ("tool call arguments not JSON", _raw(json.dumps({**chat_line("ep", "x"), "body": {
        "messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]}})),
     "ep", "invalid_value", "arguments must be a JSON object as text"),
    ("model not a string", _raw(json.dumps({**chat_line("mdl", "x"), "body": {
        **chat_line("mdl", "x")["body"], "model": 42}})), "mdl", "invalid_request",
     "body.model must be a string, got a number"),
    # Caught by the worker, which knows the model: its context is 512 tokens.
    ("max_tokens above the context", _raw(json.dumps(chat_line("mbig", "x",
                                                               max_tokens=100_000))),
     "mbig", "context_length_exceeded", "maximum context length is 512 tokens"),
    ("prompt and max_tokens longer than the context", _raw(json.dumps(
        chat_line("plong", "~" * 200, max_tokens=400))), "plong",
     "context_length_exceeded", "400 in max_tokens"),
    ("chat prompt longer than the context", _raw(json.dumps({**chat_line("clong", "x"), "body": {
        "messages": [{"role": "user", "content": "~" * 2000}]}})), "clong",
     "context_length_exceeded", "context is 512 tokens"),
    ("logit_bias outside the vocabulary", _raw(json.dumps(chat_line(
        "tok", "x", logit_bias={"99999": 1}))), "tok", "invalid_value",
     "token id 99999 is outside the model's vocabulary"),
    ("a schema the compiler refuses", _raw(json.dumps(chat_line("sch", "x", response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}))),
     "sch", "invalid_value", "body.response_format.json_schema.schema"),
    ("tool_choice auto on a model without tool calls", _raw(json.dumps(chat_line(
        "auto", "x", tools=[{"type": "function", "function": {"name": "f"}}]))), "auto",
     "invalid_value", "body.tool_choice 'auto'"),
    ("a completions line in a chat batch", _raw(json.dumps(completion_line("cmpl", "x"))),
     "cmpl", "invalid_url", "does not match the batch's endpoint"),
]


@pytest.fixture
def tiny_worker(ctx, settings, tiny_model_dir):
    # The tiny model under the API's default model id: the lines name no model.
    worker_settings = settings.model_copy(update={
        "model": str(tiny_model_dir), "served_model_name": default_model(settings),
        "engine_options": ENGINE_OPTIONS, "poll_interval": 0.05, "finalize_scan_interval": 0.3})
    worker = WorkerService(worker_settings, db=ctx.db, storage=ctx.storage,
                           queue=ctx.queue).start()
    yield worker
    worker.stop()


def test_bad_lines_fail_alone(client, tiny_worker):
    good = [chat_line(f"good-{i}", f"Question {i}?", max_tokens=3) for i in range(6)]
    good.append(chat_line("good-text", "Once upon", max_tokens=3, temperature=0,
                          logit_bias={"65": 5}, user="u", metadata={"k": "v"}))
    body = b""
    for i, (_, line, *_rest) in enumerate(LINE_CASES):
        if i % 5 == 0 and good:
            body += jsonl([good.pop(0)])
        body += line + b"\n"
    body += jsonl(good)
    uploaded = client.post("/v1/files", **_upload(body))
    assert uploaded.status_code == 200, uploaded.text
    file = uploaded.json()
    upload_errors = {e["line"]: e for e in file["line_errors"]}
    batch = client.post("/v1/batches", json={
        "input_file_id": file["id"], "endpoint": "/v1/chat/completions"}).json()
    done = wait_for(lambda: (b := client.get(f"/v1/batches/{batch['id']}").json())["status"]
                    in ("completed", "failed") and b, 120, 0.1, "the corpus batch")
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": len(LINE_CASES) + 7, "completed": 7,
                                      "failed": len(LINE_CASES)}
    output = [json.loads(x) for x in
              client.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == sorted(
        [f"good-{i}" for i in range(6)] + ["good-text"])
    for line in output:
        check_line(line, "/v1/chat/completions")
    errors = [json.loads(x) for x in
              client.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()]
    # A line without a custom_id is not in the error file: the batch's errors name its line.
    with_id = [case for case in LINE_CASES if case[2] is not None]
    assert len(errors) == len(with_id)
    for (name, _, custom_id, code, fragment), line in zip(with_id, errors, strict=True):
        error = error_of(line)
        assert (line["custom_id"], error["code"]) == (custom_id, code), (name, line)
        assert fragment in error["message"], (name, line)
    batch_errors = {e["line"]: e for e in done["errors"]["data"]}
    for name, _, custom_id, code, fragment in LINE_CASES:
        at_upload = any(e["code"] == code for e in upload_errors.values())
        if custom_id is None:
            assert any(e["code"] == code and fragment in e["message"]
                       for e in batch_errors.values()), name
        record(TABLE, entry="line", input=name, status="error line", code=code,
               found_by="upload" if at_upload else "worker", message=fragment[:70])
    # Found at upload already: everything but what needs the model or the batch's endpoint.
    assert file["error_count"] == len(LINE_CASES) - 7
