"""/v1/files: streamed upload with line-by-line checks, list, retrieve, content, delete."""

from __future__ import annotations

import json

from openai.types import FileObject

from tests.conftest_services import chat_line, jsonl
from tests.openai_shapes import strict


def upload(client, data: bytes, *, purpose: str = "batch", filename: str = "in.jsonl"):
    return client.post("/v1/files", data={"purpose": purpose},
                       files={"file": (filename, data, "application/jsonl")})


def test_upload_counts_lines_and_records_line_errors(client, ctx):
    data = jsonl([chat_line("a", "hi"), "{not json", chat_line("a", "dup"),
                  {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": [], "model": "m"}}, chat_line("c", "ok")])
    response = upload(client, data)
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["object"] == "file" and file["purpose"] == "batch"
    assert file["bytes"] == len(data)
    assert file["line_count"] == 5 and file["error_count"] == 3
    assert [e["line"] for e in file["line_errors"]] == [2, 3, 4]
    assert file["line_errors"][1]["code"] == "duplicate_custom_id"
    strict(FileObject, file)
    # Stored as uploaded, byte for byte.
    content = client.get(f"/v1/files/{file['id']}/content")
    assert content.status_code == 200 and content.content == data


def test_list_retrieve_delete(client):
    ids = [upload(client, jsonl([chat_line(str(i), "x")])).json()["id"] for i in range(3)]
    listing = client.get("/v1/files").json()
    assert listing["object"] == "list"
    assert [f["id"] for f in listing["data"]] == ids[::-1]
    page = client.get("/v1/files", params={"limit": 1, "after": ids[2]}).json()
    assert [f["id"] for f in page["data"]] == [ids[1]] and page["has_more"]
    assert client.get(f"/v1/files/{ids[0]}").json()["id"] == ids[0]
    deleted = client.delete(f"/v1/files/{ids[0]}").json()
    assert deleted == {"id": ids[0], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{ids[0]}").status_code == 404


def test_request_level_errors_are_clear_4xx(client):
    wrong_purpose = upload(client, jsonl([chat_line("a", "x")]), purpose="fine-tune")
    assert wrong_purpose.status_code == 400
    assert wrong_purpose.json()["error"]["param"] == "purpose"
    not_jsonl = upload(client, b"\x89PNG\r\n\x1a\n\x00\x00binary")
    assert not_jsonl.status_code == 400
    assert "not JSONL" in not_jsonl.json()["error"]["message"]
    assert upload(client, b"").status_code == 400
    assert upload(client, b"[1, 2]\n").status_code == 400
    too_large = upload(client, b'{"custom_id": "x"}\n' * 5000)
    assert too_large.status_code == 400
    assert too_large.json()["error"]["param"] == "file"
    assert too_large.json()["error"]["code"] == "file_too_large"
    too_many = upload(client, jsonl([chat_line(str(i), "x") for i in range(51)]))
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_lines"
    missing = client.post("/v1/files", data={"purpose": "batch"})
    assert missing.status_code == 400
    assert client.get("/v1/files/file-nope").status_code == 404


def test_limits_are_400s_naming_the_field(client):
    """Over the byte or the line limit, by upload or inline: a 400 in OpenAI's shape whose
    param (and message) names the field the lines came in."""
    too_large = upload(client, b'{"custom_id": "x"}\n' * 5000).json()["error"]
    assert (too_large["code"], too_large["param"]) == ("file_too_large", "file")
    assert too_large["message"].startswith("'file' is larger than the limit of 65,536 bytes")
    too_many = upload(client, jsonl([chat_line(str(i), "x") for i in range(51)])).json()["error"]
    assert (too_many["code"], too_many["param"]) == ("too_many_lines", "file")
    assert too_many["message"].startswith("'file' has more than 50 lines")
    big = [{"custom_id": f"i{i}", "body": {"messages": [{"role": "user", "content": "x" * 1700}]}}
           for i in range(45)]  # each line under the line-size limit, all of them over 64 KiB
    inline = client.post("/v1/batches", json={"endpoint": "/v1/chat/completions",
                                              "completion_window": "24h", "requests": big})
    assert inline.status_code == 400, inline.text
    error = inline.json()["error"]
    assert (error["code"], error["param"]) == ("file_too_large", "requests")
    assert error["message"].startswith("'requests' is larger than the limit")


def test_rejected_upload_leaves_nothing_behind(client, ctx):
    upload(client, jsonl([chat_line(str(i), "x") for i in range(51)]))
    assert client.get("/v1/files").json()["data"] == []
    import os

    root = ctx.storage.root
    leftovers = [n for _, _, names in os.walk(root) for n in names]
    assert leftovers == []


def test_auth_and_tenant_isolation(client, app, ctx):
    from fastapi.testclient import TestClient

    from tests.conftest_services import make_key

    file_id = upload(client, jsonl([chat_line("a", "x")])).json()["id"]
    anonymous = TestClient(app)
    response = anonymous.get("/v1/files")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = TestClient(app, headers={"Authorization": "Bearer bx-not-a-key"})
    assert wrong.get("/v1/files").status_code == 401
    other = TestClient(app, headers={"Authorization": f"Bearer {make_key(ctx.db, 'other')}"})
    assert other.get(f"/v1/files/{file_id}").status_code == 404
    assert other.get(f"/v1/files/{file_id}/content").status_code == 404
    assert other.delete(f"/v1/files/{file_id}").status_code == 404
    assert other.get("/v1/files").json()["data"] == []


def test_large_upload_streams_in_chunks(client, ctx, settings):
    # Many lines across several multipart chunks, each checked.
    lines = [chat_line(f"id-{i}", "y" * 900) for i in range(45)]
    data = jsonl(lines)
    assert len(data) > 40_000
    file = upload(client, data).json()
    assert file["line_count"] == 45 and file["error_count"] == 0
    assert json.loads(client.get(f"/v1/files/{file['id']}/content").text.splitlines()[44])[
        "custom_id"] == "id-44"


def test_multipart_parser_handles_any_chunking(tmp_path):
    import httpx

    from api.uploads import JsonlIngest, MultipartStream
    from service.storage import LocalStorage, get_bytes

    data = jsonl([chat_line(f"id-{i}", "z" * (i * 7)) for i in range(30)] + ["{bad"])
    request = httpx.Request("POST", "http://x/v1/files", data={"purpose": "batch"},
                            files={"file": ("in.jsonl", data)})
    body = request.read()
    storage = LocalStorage(str(tmp_path))
    for size in (1, 7, 4096):
        ingest = JsonlIngest(storage, f"file-{size}", 1 << 20, 100)
        parser = MultipartStream(request.headers["content-type"], ingest.feed)
        for start in range(0, len(body), size):
            parser.feed(body[start:start + size])
        parser.finish()
        ingest.finish()
        assert parser.fields == {"purpose": "batch"} and parser.filename == "in.jsonl"
        assert (ingest.num_lines, ingest.num_errors) == (31, 1)
        assert get_bytes(storage, ingest.storage_key) == data


def test_a_byte_order_mark_does_not_cost_line_one(client):
    data = b"\xef\xbb\xbf" + jsonl([chat_line("a", "hi"), chat_line("b", "ok")])
    file = upload(client, data).json()
    assert file["line_count"] == 2 and file["error_count"] == 0, file
