"""A finished batch's output and error files expire ``output_expires_after`` seconds after they
are written, and the worker's housekeeper deletes them (its clock injected, not slept)."""

from __future__ import annotations

import datetime as dt

from openai.types import FileObject

from tests.conftest_services import chat_line
from tests.openai_shapes import strict


def test_output_files_expire_and_the_housekeeper_deletes_them(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker()
    lines = [chat_line("ok", "hi"), chat_line("bad", "x", temperature=9)]
    batch = stack.create_batch(lines, output_expires_after={"anchor": "created_at",
                                                            "seconds": 7200})
    done = stack.wait_status(batch["id"], "completed")
    files = [stack.client.get(f"/v1/files/{done[k]}").json()
             for k in ("output_file_id", "error_file_id")]
    for file in files:
        strict(FileObject, file)
        assert file["expires_at"] == file["created_at"] + 7200
    keys = [f"batches/{batch['id']}/{kind}.jsonl" for kind in ("output", "errors")]
    assert all(stack.ctx.storage.exists(k) for k in keys)
    housekeeper = worker.housekeeper
    housekeeper.clock = lambda: dt.datetime.fromtimestamp(files[0]["created_at"] + 7100, dt.UTC)
    assert housekeeper.expire_files() == 0
    housekeeper.clock = lambda: dt.datetime.fromtimestamp(files[0]["created_at"] + 7202, dt.UTC)
    assert housekeeper.expire_files() == 2
    assert not any(stack.ctx.storage.exists(k) for k in keys)
    for file in files:
        assert stack.client.get(f"/v1/files/{file['id']}/content").status_code == 404
    # The input file (30 days by default) is still there.
    assert stack.client.get(f"/v1/files/{done['input_file_id']}").status_code == 200
