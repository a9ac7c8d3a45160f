"""Service settings, read once from ``BOXCAR_*`` environment variables (pydantic-settings).

The defaults are the embedded mode: SQLite and a local folder under ``.boxcar/``, no broker
(workers poll the database). Production sets a PostgreSQL URL, ``s3://bucket/prefix`` storage and
a Redis broker.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from openai_format.embeddings import MAX_BATCH_EMBEDDING_INPUTS
from service.expiry import MAX_EXPIRES_AFTER_S, MIN_EXPIRES_AFTER_S

_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# An operator key shorter than this is refused: it reads every tenant's batches (GET /v1/status).
MIN_OPERATOR_KEY_CHARS = 16


def parse_completion_window(window: str) -> int:
    """Seconds in a completion window such as ``"24h"``; ``ValueError`` when malformed."""
    match = _WINDOW.match(window.strip()) if isinstance(window, str) else None
    if match is None or int(match.group(1)) == 0:
        raise ValueError(
            f"completion_window must look like '24h' (a positive number and s, m, h or d), "
            f"got {window!r}"
        )
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class Settings(BaseSettings):
    """Every knob of the service. Field ``x`` is read from ``BOXCAR_X``."""

    model_config = SettingsConfigDict(env_prefix="BOXCAR_", frozen=True, extra="ignore")

    # Where things live.
    database_url: str = "sqlite:///.boxcar/boxcar.db"
    broker_url: str | None = None  # None or "": embedded queue (workers poll the database)
    queue_namespace: str = "boxcar"  # prefix of the Celery queue names
    # kombu transport options laid over boxcar's (service.queue.TRANSPORT_OPTIONS),
    # JSON: e.g. {"visibility_timeout": 600}; docs/operations.md says why each default is so.
    broker_transport_options: dict[str, Any] = Field(default_factory=dict)
    storage_url: str = ".boxcar/storage"  # a folder, or s3://bucket/prefix
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_create_bucket: bool = True

    # The model the workers serve.
    # engine.checkpoint.model_cache.DEFAULT_MODEL, which this package may not import;
    # tests/cli/test_cli.py checks the two agree.
    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None  # the model's id; default: the setting's last part
    # The deployment's models (ids or model settings), served even while no worker is up; the
    # first is the default of requests naming none. Empty: the one ``model`` above.
    models: list[str] = Field(default_factory=list)
    # Seconds a model stays served after its last worker was seen (service.served_models).
    model_ttl: float = 3600.0
    engine_options: dict[str, Any] = Field(default_factory=dict)  # EngineConfig fields (JSON)

    # API limits.
    max_file_bytes: int = 200 * 1024 * 1024
    max_file_lines: int = 50_000
    max_inline_requests: int = 10_000
    # Seconds after creation that a file expires unless its upload (``expires_after``) or its
    # batch (``output_expires_after``) says otherwise: OpenAI's 30 days for batch files; within
    # OpenAI's bounds (3,600 s to 30 days, service.expiry); None keeps files until deleted.
    file_expires_after: int | None = 30 * 86400
    output_expires_after: int | None = 30 * 86400
    # Enqueued tokens (prompt plus max output tokens of unfinished lines) a tenant may hold per
    # model; None: no limit. A key may carry its own (``boxcar keys``; service.quotas).
    max_enqueued_tokens: int | None = None
    # The Retry-After of a job refused for the quota (seconds).
    quota_retry_after: int = 30
    # Embedding inputs a batch's lines hold in all (OpenAI's limit: 50,000); more are line errors.
    max_batch_embedding_inputs: int = MAX_BATCH_EMBEDDING_INPUTS
    # Windows a batch may ask for; each is its deadline, which orders the queue
    # (service.queue_order: earliest deadline first).
    completion_windows: list[str] = Field(default_factory=lambda: ["1h", "4h", "24h"])
    # The highest ``priority`` a tenant may give a job or a batch (the schema allows 0-100).
    max_priority: int = 10
    # False (OpenAI's rule): a line's url must be the batch's endpoint; True: either endpoint.
    mixed_endpoints: bool = False
    # A batch whose estimate at create passes the end of its completion window: False, it is
    # created with a ``completion_window_at_risk`` warning; True, it fails its validation
    # (``completion_window_infeasible``). api.create_eta.
    refuse_at_risk: bool = False
    bootstrap_api_key: str | None = None  # ensured to exist (tenant "default") at start
    # Seconds an API process trusts a key it has checked before asking the database again (a
    # status poll then makes no auth query): a revoked key works at most this long in an API
    # process that saw it just before. 0: every request checks its key in the database.
    api_key_cache_seconds: float = 5.0
    # The oldest view of a batch a status poll, or the first page of the batch list, is
    # answered with: an API process reads the batches polled and the first pages asked in the
    # last few seconds, together, a few times in this span, and answers them from memory
    # (api.poll_snapshots; PostgreSQL). 0: every poll and list reads the database.
    api_poll_snapshot_seconds: float = 0.5
    # The operator's key: ``GET /v1/status`` (the whole service's status, every tenant's
    # batches) answers only a request bearing it, and ``boxcar status --api`` sends it. None:
    # that endpoint is off (403). At least MIN_OPERATOR_KEY_CHARS characters.
    operator_key: SecretStr | None = None
    # Where ``boxcar status`` asks for the report (an API's base URL, with operator_key): the
    # API answers from its warm connections and held report. None: it reads the database.
    api_url: str | None = None

    # Work distribution.
    shard_size: int = 256
    lease_seconds: float = 15.0
    poll_interval: float = 0.5
    # The longest an idle worker's loops sleep between polls (doubling from poll_interval):
    # broker messages wake them at once, so polling is only the fallback.
    idle_poll_interval: float = 20.0
    max_shard_attempts: int = 5
    worker_max_shards: int = 8
    worker_max_lines: int = 4096
    worker_max_jobs: int = 256
    job_collect_window: float = 0.005  # seconds an idle engine waits to gather single jobs
    finalize_scan_interval: float = 5.0
    worker_metrics_port: int | None = None  # Prometheus /metrics of a production worker
    worker_metrics_interval: float = 2.0  # seconds between a worker's metrics snapshots in the db
    # The niceness a `boxcar worker` process takes at start, at least (0: as started): on a
    # machine it shares with the API and the database, their answers (status polls) wait less
    # for a CPU; alone on its machine it changes nothing.
    worker_nice: int = 10

    # Webhooks.
    webhook_allow_private: bool = False
    webhook_timeout: float = 10.0
    webhook_retry_delays: list[float] = Field(
        default_factory=lambda: [5.0, 30.0, 120.0, 600.0, 1800.0, 7200.0, 18000.0]
    )

    @field_validator("shard_size", "max_file_lines", "max_file_bytes", "worker_max_shards",
                     "worker_max_lines", "worker_max_jobs", "max_shard_attempts",
                     "max_inline_requests", "max_batch_embedding_inputs")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("lease_seconds", "poll_interval", "idle_poll_interval", "webhook_timeout",
                     "worker_metrics_interval", "model_ttl", "quota_retry_after")
    @classmethod
    def _positive_seconds(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0 seconds, got {value}")
        return value

    @field_validator("file_expires_after", "output_expires_after")
    @classmethod
    def _expiry(cls, value: int | None) -> int | None:
        if value is not None and not MIN_EXPIRES_AFTER_S <= value <= MAX_EXPIRES_AFTER_S:
            raise ValueError(f"must be within {MIN_EXPIRES_AFTER_S}-{MAX_EXPIRES_AFTER_S} "
                             f"seconds (OpenAI's bounds), or null for never, got {value}")
        return value

    @field_validator("max_enqueued_tokens")
    @classmethod
    def _limit(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1 token, or null for no limit, got {value}")
        return value

    @field_validator("worker_nice")
    @classmethod
    def _nice(cls, value: int) -> int:
        if not 0 <= value <= 19:
            raise ValueError(f"must be within 0-19 (os.nice; 0: none), got {value}")
        return value

    @field_validator("api_key_cache_seconds", "api_poll_snapshot_seconds")
    @classmethod
    def _seconds_or_zero(cls, value: float) -> float:
        if value < 0:
            raise ValueError(f"must be >= 0 seconds (0: no cache), got {value}")
        return value

    @field_validator("operator_key")
    @classmethod
    def _operator_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # unset, or set empty: no operator endpoint
        if len(value.get_secret_value()) < MIN_OPERATOR_KEY_CHARS:
            raise ValueError(f"must be at least {MIN_OPERATOR_KEY_CHARS} characters (it opens "
                             "every tenant's status), e.g. `python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))'`")
        return value

    @field_validator("max_priority")
    @classmethod
    def _priority(cls, value: int) -> int:
        if not 0 <= value <= 100:
            raise ValueError(f"must be within 0-100, got {value}")
        return value

    @field_validator("completion_windows")
    @classmethod
    def _windows(cls, value: list[str]) -> list[str]:
        for window in value:
            parse_completion_window(window)
        return value

    @property
    def embedded_queue(self) -> bool:
        return not self.broker_url

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()
