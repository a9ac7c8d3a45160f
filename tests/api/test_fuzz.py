"""schemathesis against the OpenAPI schema of the running API (uvicorn on loopback, SQLite and
a local folder): every operation, with generated valid and invalid parameters and bodies, must
answer without a server error (5xx), and every error must be in OpenAI's error shape. The
operator's ``/v1/status`` gets the operator key (the API has one), every other operation a
tenant's key.

Every operation that names a tenant's object by id is fuzzed again with the ids of real
objects: the caller's own (so the routes past the lookup are fuzzed too), and a second
tenant's, which must answer 404 ``not_found`` every time, never 403 or 200, and name none of
that tenant's other objects; a list's ``after`` cursor set to the second tenant's id is
refused the same way. ``test_every_object_route_is_fuzzed_for_isolation`` keeps that list
complete as routes are added."""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from api.app import build_context, create_app
from service.settings import Settings
from tests.api.conftest import RecordingQueue
from tests.conftest_services import chat_line, jsonl, make_key, migrated, serve_app
from tests.figures import record

COUNTS: dict[str, int] = {}
OPERATIONS: set[str] = set()
REFUSED: dict[str, int] = {}  # operation -> a second tenant's ids refused with 404
OPERATOR_KEY = "fuzz-operator-key-0123456789"
# The path parameters that name a tenant's object, by the kind of object.
OBJECT_PARAMS = {"file_id": "file", "batch_id": "batch", "job_id": "job",
                 "endpoint_id": "endpoint", "message_batch_id": "message_batch"}
# Path parameters that name something every tenant shares.
SHARED_PARAMS = {"model"}
# Lists whose ``after`` cursor is an object id, and the kind of that object.
AFTER_KINDS = {"/v1/files": "file", "/v1/batches": "batch", "/v1/jobs": "job"}


@dataclass
class LiveApi:
    base_url: str
    key: str
    own: dict[str, str]  # kind -> an object of the fuzzing tenant
    other: dict[str, str]  # kind -> an object of a second tenant


def _objects(base_url: str, key: str, tag: str) -> dict[str, str]:
    """A file, a batch (validating: no worker), a queued job, a webhook endpoint and a
    Message Batch."""
    with httpx.Client(base_url=base_url, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        lines = [chat_line(f"{tag}-{i}", f"hello {i}") for i in range(3)]
        file_id = c.post("/v1/files", data={"purpose": "batch"},
                         files={"file": (f"{tag}.jsonl", jsonl(lines))}).json()["id"]
        batch_id = c.post("/v1/batches", json={"input_file_id": file_id,
                                               "endpoint": "/v1/chat/completions"}).json()["id"]
        job_id = c.post("/v1/jobs", json={"body": {"prompt": "hi", "max_tokens": 2}}).json()["id"]
        endpoint_id = c.post("/v1/webhook_endpoints",
                             json={"url": "https://example.com/hook"}).json()["id"]
        message_batch_id = c.post("/v1/messages/batches", json={"requests": [
            {"custom_id": tag, "params": {"max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}]}}]}).json()["id"]
    return {"file": file_id, "batch": batch_id, "job": job_id, "endpoint": endpoint_id,
            "message_batch": message_batch_id}


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    app_settings = Settings(database_url=f"sqlite:///{root / 'boxcar.db'}",
                            storage_url=str(root / "storage"), max_file_bytes=256 * 1024,
                            max_file_lines=100, operator_key=OPERATOR_KEY)
    ctx = build_context(app_settings, db=migrated(app_settings.database_url),
                        queue=RecordingQueue())
    key, other_key = make_key(ctx.db, "fuzz"), make_key(ctx.db, "fuzz-other")
    with serve_app(create_app(context=ctx)) as base_url:
        yield LiveApi(base_url, key, own=_objects(base_url, key, "own"),
                      other=_objects(base_url, other_key, "other"))
    ctx.db.dispose()
    total = sum(COUNTS.values())
    if total:
        record("Fuzzing: schemathesis on the live API's OpenAPI schema",
               operations=len(OPERATIONS), requests=total,
               **{f"http_{k}": v for k, v in sorted(COUNTS.items())},
               server_errors=sum(v for k, v in COUNTS.items() if k.startswith("5")),
               other_tenant_404=sum(REFUSED.values()), isolation_operations=len(REFUSED))


def _schema():
    """The schema the live API serves at /openapi.json (the same app, built here at collection:
    schemathesis's lazy fixture loading does not work with this pytest)."""
    root = tempfile.mkdtemp(prefix="boxcar-fuzz-schema-")
    try:
        app = create_app(Settings(database_url=f"sqlite:///{root}/schema.db", storage_url=root))
        return schemathesis.openapi.from_dict(app.openapi())
    finally:
        shutil.rmtree(root, ignore_errors=True)


schema = _schema()


def test_the_schema_is_the_served_one(live_api):
    assert httpx.get(f"{live_api.base_url}/openapi.json").json() == schema.raw_schema


def _anthropic(path: str) -> bool:
    """Whether the route is Anthropic's (``/v1/messages/...``), whose errors are in its shape."""
    return path.startswith("/v1/messages")


def _error_shape(ctx, response, case) -> bool | None:
    """A 4xx answer is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
    ``{"type": "error", "error": {"type", "message"}}`` under its routes)."""
    COUNTS[str(response.status_code)] = COUNTS.get(str(response.status_code), 0) + 1
    if 400 <= response.status_code < 500:
        body = response.json()
        if _anthropic(case.path):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            assert body["error"]["message"] and body["error"]["type"] != "api_error", body
            return None
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"], body
        assert body["error"]["type"] != "server_error", body  # a 405 too is the client's
    return None


def _run(case, live_api: LiveApi) -> None:
    OPERATIONS.add(f"{case.operation.method.upper()} {case.path}")
    key = OPERATOR_KEY if case.path == "/v1/status" else live_api.key
    case.call_and_validate(base_url=live_api.base_url, headers={"Authorization": f"Bearer {key}"},
                           checks=[not_a_server_error, _error_shape])


def _object_params(operation) -> list[str]:
    """The path parameters that name a tenant's object (from the path: an operation being
    filtered has its parameters not yet read)."""
    return [name for name in re.findall(r"{(\w+)}", operation.path) if name not in SHARED_PARAMS]


def _targets_objects(context) -> bool:
    """For ``schema.include``: the operation (``context.operation``) names a tenant's object."""
    operation = context.operation
    return bool(_object_params(operation)) or (
        operation.method.upper() == "GET" and operation.path in AFTER_KINDS)


def test_every_object_route_is_fuzzed_for_isolation():
    """Each path parameter of the schema is a known object kind or a shared name, and every
    list of a tenant's objects with an ``after`` cursor is in ``AFTER_KINDS``: a new route
    with an id joins the isolation fuzz below, or this fails."""
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        for name in _object_params(operation):
            assert name in OBJECT_PARAMS, (
                f"{operation.method.upper()} {operation.path}: {name!r} names a kind of object "
                "the isolation fuzz does not know: add it to OBJECT_PARAMS and make one for each "
                "tenant in _objects (or to SHARED_PARAMS if every tenant shares it)")
        after = "after" in {p.name for p in operation.query}
        if after and operation.path != "/v1/webhook_deliveries":  # that one's is a message id
            assert operation.path in AFTER_KINDS, operation.path
        elif operation.method.upper() == "GET":
            assert operation.path not in AFTER_KINDS, operation.path
    targeted = [o for o in operations if _object_params(o) or (
        o.method.upper() == "GET" and o.path in AFTER_KINDS)]
    assert len(targeted) >= 10, [(o.method, o.path) for o in targeted]


def _with_objects(case, objects: dict[str, str]) -> list[str]:
    """``case`` naming ``objects`` (kind -> id) in its path and ``after`` cursor; the ids it
    names."""
    named = []
    for name in _object_params(case.operation):
        case.path_parameters[name] = objects[OBJECT_PARAMS[name]]
        named.append(case.path_parameters[name])
    if case.method.upper() == "GET" and case.path in AFTER_KINDS:
        case.query = {**(case.query or {}), "after": objects[AFTER_KINDS[case.path]]}
        named.append(case.query["after"])
    return named


@schema.include(_targets_objects).parametrize()
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_real_objects_fuzzed_and_another_tenants_are_404(case, live_api):
    # The caller's own objects: whatever else is generated, no server error.
    _with_objects(case, live_api.own)
    _run(case, live_api)
    if case.method.upper() != case.operation.method.upper():
        return  # a method the route does not have (TRACE, ...): a 405 whatever the id
    # A second tenant's: 404, as for an id that does not exist, naming none of its objects.
    named = _with_objects(case, live_api.other)
    response = case.call(base_url=live_api.base_url,
                         headers={"Authorization": f"Bearer {live_api.key}"})
    COUNTS[str(response.status_code)] = COUNTS.get(str(response.status_code), 0) + 1
    answer = (case.method, case.formatted_path, case.query, response.status_code, response.text)
    if response.status_code == 404:
        error = response.json()["error"]
        assert error["type" if _anthropic(case.path) else "code"] in (
            "not_found", "not_found_error"), answer
        operation = f"{case.method} {case.path}"
        REFUSED[operation] = REFUSED.get(operation, 0) + 1
    else:  # refused first for another generated parameter (a bad limit): never 200 or 403
        assert response.status_code == 400, answer
        assert response.json()["error"].get("param") not in (*_object_params(case.operation),
                                                         "after"), answer
    for object_id in set(live_api.other.values()) - set(named):
        assert object_id not in response.text, (case.formatted_path, object_id)


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live_api):
    _run(case, live_api)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_deep(case, live_api):
    _run(case, live_api)
