"""What one run of the scale benchmark is asked to do (``RunConfig``) and what it measured
(``RunResult``): the fields ``bench.scale`` fills and ``bench.scale_report`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunConfig:
    num_workers: int
    num_lines: int
    engine: str  # instant | paced
    lines_per_s: float | None  # per worker, paced only
    idle_s: float
    timeout_s: float
    database_url: str
    broker_url: str
    idle_settle_s: float = 0.0
    repeat: int = 1  # which of the --repeat runs of this configuration (1-based)
    # Seconds between the separate poller's polls (new connection each) while the batch is in
    # progress (0: no poller).
    fresh_poll_interval: float = 0.1
    # The first page's size a second poller asks for the same way (0: no list poller), and
    # the seconds between a third one's runs of ``boxcar status``'s database part (0: none).
    list_limit: int = 20
    cli_status_interval: float = 0.5
    kill_one: bool = False  # SIGKILL one worker a third of the way through the batch


@dataclass
class RunResult:
    num_workers: int
    num_lines: int
    engine: str
    lines_per_s_per_worker: float | None
    lines_per_s: float
    ideal_lines_per_s: float | None
    efficiency: float | None
    claim_attempts: float | None
    claims: float | None
    attempts_per_claim: float | None
    lock_wait_share: float | None  # lock samples over active ones (before issue 31)
    active_backend_samples: int
    idle_commits_per_s_per_worker: float
    pg_cpu_ms_per_line: float
    service_cpu_ms_per_line: float  # the API and worker processes (the bench client excluded)
    status_poll_ms_median: float | None  # as the client measured it
    num_status_polls: int
    machine_cpu_busy: float
    peak_connections: int
    exactly_once: bool
    missing: int
    duplicated: int
    # What active backends waited on, biggest first: wait_event_type, wait_event, statement
    # (``scale_probes.statement_label``) and the share of all active backend samples.
    waits: list[dict[str, Any]] = field(default_factory=list)
    # request_lines after the batch: the share of its row updates (the result writes) that were
    # HOT (no index entries written, the new version in the old one's page), its heap and
    # index size per line, and the mean row's bytes.
    line_hot_update_share: float | None = None
    line_heap_bytes_per_line: float = 0.0
    line_index_bytes_per_line: float = 0.0
    line_row_bytes: float = 0.0
    # The same polls as the API timed them itself (its Server-Timing header: from the request's
    # first byte in to the response's headers out).
    status_poll_server_ms_median: float | None = None
    status_poll_db_ms_median: float | None = None
    # The polls of the separate client process (new connection each) while the batch was in
    # progress: what a user's client sees; the API's own time for them beside.
    fresh_poll_ms_p50: float | None = None
    fresh_poll_ms_p95: float | None = None
    fresh_poll_server_ms_p50: float | None = None
    fresh_poll_server_ms_p95: float | None = None
    fresh_poll_connect_ms_p50: float | None = None  # of the client's: the TCP handshake
    fresh_poll_connect_ms_p95: float | None = None
    num_fresh_polls: int = 0
    # The same for the first page of ``GET /v1/batches?limit=list_limit``, from a poller of its
    # own beside the first.
    list_poll_ms_p50: float | None = None
    list_poll_ms_p95: float | None = None
    list_poll_server_ms_p50: float | None = None
    list_poll_server_ms_p95: float | None = None
    num_list_polls: int = 0
    # ``boxcar status --api`` from a third process (``GET /v1/status`` on a new connection): the
    # client's ms and the API's Server-Timing ``app`` ms.
    api_status_ms_p50: float | None = None
    api_status_ms_p95: float | None = None
    api_status_server_ms_p50: float | None = None
    api_status_server_ms_p95: float | None = None
    num_api_status: int = 0
    # ``boxcar status``'s database part from a fourth process (connect, then one round trip with
    # the schema's check and the reads, and the report: ``collect_ms``, all after connecting),
    # and once its statements explained (``bench.scale_status``: rows read by table).
    cli_status_ms_p50: float | None = None
    cli_status_ms_p95: float | None = None
    cli_status_collect_ms_p50: float | None = None
    cli_status_collect_ms_p95: float | None = None
    num_cli_status: int = 0
    cli_status_explained: dict[str, Any] | None = None
    # pg_stat_activity's samples: every backend's, the non-idle ones', the active ones waiting
    # on their own client (ClientRead), those waiting on a lock, and the lock share of the
    # first two (lock_wait_share above is over the active ones).
    backend_samples: int = 0
    non_idle_samples: int = 0
    client_wait_samples: int = 0
    lock_samples: int = 0
    lock_share_of_backends: float | None = None
    lock_share_of_non_idle: float | None = None
    # Contention: claim statements, those that lost a wanted shard to another worker (SKIP
    # LOCKED passed over it, or it was taken since read) and the shards so lost.
    claim_statements: float | None = None
    contended_statements: float | None = None
    claims_lost: float | None = None
    repeat: int = 1
    killed_workers: int = 0  # SIGKILLed during the batch (the kill run)
    num_cpus: int = 0  # the machine's: what the CPU figures are shares of
    # The batch's phases as the polls saw them (to a poll interval): prepare (created to
    # in_progress, one worker), the run (to every line closed: all workers) and finalize (to
    # completed, one worker); and lines/s over the run alone, against the ideal.
    prepare_s: float | None = None
    run_s: float | None = None
    finalize_s: float | None = None
    run_lines_per_s: float | None = None
    run_efficiency: float | None = None
