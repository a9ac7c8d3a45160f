"""Prometheus counters of the API and the workers (one registry per process; the API serves
it at /metrics, a production worker on ``BOXCAR_WORKER_METRICS_PORT``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

FILES_UPLOADED = Counter("boxcar_files_uploaded_total", "Input files accepted")
BATCHES_CREATED = Counter("boxcar_batches_created_total", "Batches created")
JOBS_CREATED = Counter("boxcar_jobs_created_total", "Single jobs created")
SHARDS_CLAIMED = Counter("boxcar_shards_claimed_total", "Shards this worker claimed")
LINES_FINISHED = Counter("boxcar_lines_finished_total", "Lines finished by this worker",
                         ["status"])
ENGINE_STEPS = Counter("boxcar_engine_steps_total", "Engine steps run")
BATCHES_FINALIZED = Counter("boxcar_batches_finalized_total", "Batches finalized", ["status"])
WEBHOOK_ATTEMPTS = Counter("boxcar_webhook_attempts_total", "Webhook delivery attempts",
                           ["result"])
BACKLOG_LINES = Gauge("boxcar_worker_backlog_lines", "Lines held, queued or in the engine")
