"""The kinds of public object id (``file-…``, ``batch_…``, boxcar's own) and of shard id; the
random part comes from ``openai_format.ids.new_id``."""

from __future__ import annotations

from openai_format.ids import new_id


def file_id() -> str:
    return new_id("file-")


def batch_id() -> str:
    return new_id("batch_")


JOB_PREFIX = "job_"


def job_id() -> str:
    return new_id(JOB_PREFIX)


def shard_id(owner_id: str, index: int) -> str:
    """Shard ``index`` of a batch or a job (a job has one, shard 0)."""
    return f"{owner_id}:{index}"


def is_job_shard(shard_id: str) -> bool:
    """Whether a shard id (as a queue message names it) belongs to a single job, not a batch."""
    return shard_id.startswith(JOB_PREFIX)


def tenant_id() -> str:
    return new_id("tenant_")


def key_id() -> str:
    return new_id("key_")


def webhook_endpoint_id() -> str:
    return new_id("we_")


def webhook_message_id() -> str:
    return new_id("msg_")
