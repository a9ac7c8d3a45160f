"""The units that move between a worker's threads: a line to run, a line's result, and the set
of shards this worker holds leases on.

The five "line" types, in the order a line meets them:

1. ``openai_format.parse.BatchLine`` -- an input line that parsed and passed every check
   (``LineError`` -- one that did not: code, detail, line number), at upload and at prepare;
2. ``service.models.RequestLine`` -- its row in the database, written by prepare;
3. ``LineWork`` (here) -- the row as loaded when a worker claimed its shard: what the drain loop
   gives the engine;
4. ``LineResult`` (here) -- its outcome, written back to the row by the result writer;
5. the output or error file line (``openai_format.responses``), built from the row at finalize.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from openai_format.engine_fields import EngineFields
from service.queue_order import EngineOrder, engine_order


@dataclass(frozen=True)
class LineWork:
    """One request line, as loaded from its row when the shard was claimed."""

    line_pk: int
    shard_id: str
    tenant_id: str
    batch_id: str | None
    job_id: str | None
    endpoint: str
    body: dict[str, Any]
    priority: int = 0  # the shard's: a job's is JOB_PRIORITY_BASE + its own
    deadline: float | None = None  # unix seconds: the batch's expires_at (service.queue_order)
    # The validated fields stored at prepare (``openai_format.engine_fields``); None for rows
    # from before them (0005_scale), whose ``body`` is parsed instead.
    engine_fields: EngineFields | None = None
    # Which claim of its shard loaded it (``Shard.attempts``): when this worker loses a shard's
    # lease and claims the shard again, dropping the lost claim's lines leaves the new claim's.
    attempt: int = 1

    @property
    def is_job(self) -> bool:
        return self.job_id is not None

    def engine_order(self, *, at_risk: bool = False) -> EngineOrder:
        """The engine's (priority, rank) of this line; ``at_risk``: its batch's deadline is."""
        return engine_order(is_job=self.is_job, priority=self.priority, deadline=self.deadline,
                            at_risk=at_risk)

    @property
    def engine_request_id(self) -> str:
        """The engine's id for this line (unique within one engine); not the OpenAI
        ``request_id`` of its response, which is ``LineResult.request_id``."""
        return f"line-{self.line_pk}"


@dataclass(frozen=True)
class LineResult:
    """A finished line: ``status`` is "completed" (``response``) or "failed" (``error``)."""

    work: LineWork
    status: str
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    request_id: str | None = None  # the response's request_id (``req_…``)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class HeldShard:
    id: str
    tenant_id: str
    batch_id: str | None
    job_id: str | None
    priority: int
    open_line_pks: set[int] = field(default_factory=set)
    attempt: int = 1  # which claim of the shard this is (``Shard.attempts``)

    @property
    def is_job(self) -> bool:
        return self.job_id is not None


class HeldShards:
    """Shards this worker holds a lease on, and which of their lines still await a result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[str, HeldShard] = {}

    def add(self, shard: HeldShard) -> None:
        with self._lock:
            self._shards[shard.id] = shard

    def remove(self, shard_ids: list[str] | set[str]) -> list[HeldShard]:
        with self._lock:
            return [s for sid in shard_ids if (s := self._shards.pop(sid, None)) is not None]

    def line_done(self, shard_id: str, line_pk: int) -> bool:
        """Record a result; True when it was the shard's last open line."""
        with self._lock:
            shard = self._shards.get(shard_id)
            if shard is None:
                return False
            shard.open_line_pks.discard(line_pk)
            return not shard.open_line_pks

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._shards)

    def of_batches(self, batch_ids: set[str]) -> list[str]:
        with self._lock:
            return [s.id for s in self._shards.values() if s.batch_id in batch_ids]

    def batch_ids(self) -> set[str]:
        with self._lock:
            return {s.batch_id for s in self._shards.values() if s.batch_id is not None}

    def get(self, shard_id: str) -> HeldShard | None:
        with self._lock:
            return self._shards.get(shard_id)

    def counts(self) -> tuple[int, int, int]:
        """(bulk shards, job shards, open lines)."""
        with self._lock:
            jobs = sum(1 for s in self._shards.values() if s.is_job)
            lines = sum(len(s.open_line_pks) for s in self._shards.values())
            return len(self._shards) - jobs, jobs, lines

    def __contains__(self, shard_id: object) -> bool:
        with self._lock:
            return shard_id in self._shards

    def __len__(self) -> int:
        with self._lock:
            return len(self._shards)
