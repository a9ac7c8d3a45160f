"""Tenant isolation: tenant A cannot list, read, cancel, download or delete anything of tenant
B's (files, output and error files, batches, jobs, webhook endpoints, deliveries), by id, through
a list's ``after`` cursor, or by building on it (a batch on B's file). Every attempt is a 404,
as for an id that does not exist, so ids do not leak either; B's objects are left untouched."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engine.testing.fake_engine import FakeEngine
from tests.conftest_services import chat_line, jsonl, make_key, wait_for
from tests.figures import record
from worker.process import WorkerService


def _client(app, key: str) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {key}"})


def _objects(c: TestClient, tag: str) -> dict[str, str]:
    """A file, a finished batch (output and error files), a job, a webhook endpoint."""
    lines = [chat_line(f"{tag}-{i}", f"hello {i}", max_tokens=2) for i in range(3)]
    lines.append(chat_line(f"{tag}-hot", "x", temperature=9))
    file_id = c.post("/v1/files", data={"purpose": "batch"},
                     files={"file": (f"{tag}.jsonl", jsonl(lines))}).json()["id"]
    endpoint = c.post("/v1/webhook_endpoints",
                      json={"url": "https://example.com/hook"}).json()["id"]
    batch_id = c.post("/v1/batches", json={"input_file_id": file_id,
                                           "endpoint": "/v1/chat/completions"}).json()["id"]
    job_id = c.post("/v1/jobs", json={"body": {"prompt": "hi", "max_tokens": 2}}).json()["id"]
    batch = wait_for(lambda: (b := c.get(f"/v1/batches/{batch_id}").json())["status"]
                     == "completed" and b, 30, 0.05, f"{tag}'s batch")
    wait_for(lambda: c.get(f"/v1/jobs/{job_id}").json()["status"] == "completed", 30, 0.05,
             f"{tag}'s job")
    return {"file": file_id, "output": batch["output_file_id"], "errors": batch["error_file_id"],
            "batch": batch_id, "job": job_id, "endpoint": endpoint}


@pytest.fixture
def tenants(app, ctx, settings):
    worker = WorkerService(settings.model_copy(update={"poll_interval": 0.05,
                                                       "finalize_scan_interval": 0.3}),
                           engine=FakeEngine(), db=ctx.db, storage=ctx.storage,
                           queue=ctx.queue).start()
    a, b = _client(app, make_key(ctx.db, "tenant-a")), _client(app, make_key(ctx.db, "tenant-b"))
    with a, b:
        objects_a, objects_b = _objects(a, "a"), _objects(b, "b")
        worker.stop()
        for c, objects in ((a, objects_a), (b, objects_b)):  # stays "validating": cancellable
            objects["running"] = c.post("/v1/batches", json={
                "input_file_id": objects["file"], "endpoint": "/v1/chat/completions"}).json()["id"]
        yield a, b, objects_a, objects_b


def attempts(b: dict[str, str]) -> list[tuple[str, str, dict]]:
    return [
        ("GET", f"/v1/files/{b['file']}", {}),
        ("GET", f"/v1/files/{b['file']}/content", {}),
        ("GET", f"/v1/files/{b['output']}", {}),
        ("GET", f"/v1/files/{b['output']}/content", {}),
        ("GET", f"/v1/files/{b['errors']}/content", {}),
        ("DELETE", f"/v1/files/{b['file']}", {}),
        ("DELETE", f"/v1/files/{b['output']}", {}),
        ("GET", "/v1/files", {"params": {"after": b["file"]}}),
        ("GET", f"/v1/batches/{b['batch']}", {}),
        ("POST", f"/v1/batches/{b['running']}/cancel", {}),
        ("GET", "/v1/batches", {"params": {"after": b["batch"]}}),
        ("POST", "/v1/batches", {"json": {"input_file_id": b["file"],
                                          "endpoint": "/v1/chat/completions"}}),
        ("GET", f"/v1/jobs/{b['job']}", {}),
        ("GET", "/v1/jobs", {"params": {"after": b["job"]}}),
        ("DELETE", f"/v1/webhook_endpoints/{b['endpoint']}", {}),
        ("GET", "/v1/webhook_deliveries", {"params": {"after": "msg_" + "0" * 24}}),
    ]


def _ghost(object_id: str) -> str:
    """An id of the same kind and shape that no tenant has."""
    return object_id[:-6] + "000000"


def _swap(value, ids):
    """``value`` (a path, or request kwargs) with each of ``ids`` replaced by its ghost."""
    if isinstance(value, dict):
        return {k: _swap(v, ids) for k, v in value.items()}
    if isinstance(value, str):
        for object_id in ids:
            value = value.replace(object_id, _ghost(object_id))
    return value


def _masked(text: str, ids) -> str:
    for object_id in ids:
        text = text.replace(object_id, "<id>")
    return text


def test_ids_that_leak_are_caught():
    """The checks above can fail: an answer naming another id, or differing from the answer for
    a missing id, is not the same masked text."""
    b_file, other = "file-" + "1" * 24, "batch_" + "2" * 24
    leaked = f'{{"error": "{b_file} belongs to another tenant, see {other}"}}'
    missing = f'{{"error": "No such file: {_ghost(b_file)}"}}'
    assert _masked(leaked, [b_file]) != _masked(missing, [_ghost(b_file)])
    assert _ghost(b_file) != b_file and len(_ghost(b_file)) == len(b_file)


def test_tenant_a_cannot_touch_tenant_bs_objects(tenants):
    a, b, objects_a, objects_b = tenants
    refused = 0
    for method, path, kwargs in attempts(objects_b):
        response = a.request(method, path, **kwargs)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
        # Ids do not leak: the answer is the one for an id that does not exist (the requested
        # id echoed back at most), and no other id of b's appears in it.
        asked = [oid for oid in objects_b.values() if oid in path + str(kwargs)]
        ghost_path, ghost_kwargs = _swap(path, asked), _swap(kwargs, asked)
        ghost = a.request(method, ghost_path, **ghost_kwargs)
        assert ghost.status_code == 404, (method, ghost_path, ghost.text)
        assert _masked(response.text, asked) == _masked(ghost.text, map(_ghost, asked)), path
        for object_id in set(objects_b.values()) - set(asked):
            assert object_id not in response.text, (path, object_id)
        refused += 1

    # Lists show only a's own objects.
    def listed(path: str, **params) -> set[str]:
        return {x["id"] for x in a.get(path, params=params).json()["data"]}

    assert not listed("/v1/files") & set(objects_b.values())
    assert not listed("/v1/batches") & set(objects_b.values())
    assert not listed("/v1/jobs") & set(objects_b.values())
    assert not listed("/v1/webhook_endpoints") & set(objects_b.values())
    assert not listed("/v1/webhook_deliveries", object_id=objects_b["batch"])
    deliveries = a.get("/v1/webhook_deliveries").json()["data"]
    assert deliveries and all(d["object_id"] in objects_a.values() for d in deliveries)
    assert a.get("/v1/tenant").json()["webhook_secret"] != b.get("/v1/tenant").json()[
        "webhook_secret"]

    # b's objects are as they were.
    assert b.get(f"/v1/files/{objects_b['file']}/content").status_code == 200
    assert b.get(f"/v1/files/{objects_b['output']}/content").status_code == 200
    assert b.get(f"/v1/batches/{objects_b['running']}").json()["status"] == "validating"
    assert objects_b["endpoint"] in {x["id"] for x in b.get("/v1/webhook_endpoints").json()[
        "data"]}
    # And a's own ids behave normally (the 404s above were about ownership).
    for method, path, kwargs in attempts(objects_a)[:5]:
        assert a.request(method, path, **kwargs).status_code == 200, path
    record("Tenant isolation", attempts=refused, answered_404=refused, leaked=0)
