"""Batches and their shards written straight into a database, for tests that read them back
(``boxcar status``'s readers): a batch of 4 lines a shard, its shards in the given states, a
running shard leased to ``owner`` for 30 s."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from service.db import Database, utcnow
from service.models import SHARD_RUNNING, Batch, File, Shard


def add_batch(db: Database, tenant_id: str, *, status: str, shards: list[str],
              owner: str = "host:1", **batch_fields: Any) -> str:
    """The new batch's id; ``batch_fields`` are more of the batch row's columns."""
    batch_id = f"batch_{uuid.uuid4().hex[:12]}"
    now = utcnow()
    with db.session() as session:
        file = File(id=f"file-{uuid.uuid4().hex[:12]}", tenant_id=tenant_id, purpose="batch",
                    filename="x.jsonl", bytes=1, storage_key="k", num_lines=4 * len(shards))
        session.add(file)
        session.flush()
        session.add(Batch(id=batch_id, tenant_id=tenant_id, endpoint="/v1/chat/completions",
                          input_file_id=file.id, completion_window="24h", status=status,
                          num_total=4 * len(shards), created_at=now,
                          expires_at=now + dt.timedelta(hours=1), **batch_fields))
        session.flush()
        for i, shard_status in enumerate(shards):
            running = shard_status == SHARD_RUNNING
            session.add(Shard(id=f"{batch_id}:{i}", tenant_id=tenant_id, batch_id=batch_id,
                              status=shard_status, num_lines=4,
                              lease_owner=owner if running else None,
                              lease_expires_at=now + dt.timedelta(seconds=30) if running
                              else None))
    return batch_id
