"""0009_chunked_prepare up and down on SQLite and PostgreSQL: batches past validating were
prepared in one transaction, so they count as prepared; a validating one is still to prepare."""

from __future__ import annotations

import datetime as dt

from alembic import command
from sqlalchemy import inspect, text

from service.db import Database
from service.migrate import alembic_config

T0 = dt.datetime(2026, 12, 1, 10, 0)
T1 = dt.datetime(2026, 12, 1, 10, 5)


def _seed(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, webhook_secret, created_at) "
                          "VALUES ('t', 't', 's', :now)"), {"now": T0})
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, "
                          "storage_key, num_lines, num_errors, enqueued_tokens, created_at) "
                          "VALUES ('file-1', 't', 'f', 'batch', 1, 'k', 5, 0, 0, :now)"),
                     {"now": T0})
        for batch_id, status, in_progress_at in (("b_validating", "validating", None),
                                                 ("b_running", "in_progress", T1),
                                                 ("b_cancelled", "cancelled", None)):
            conn.execute(text(
                "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, "
                "completion_window, status, priority, created_at, in_progress_at, num_total, "
                "num_completed, num_failed, input_tokens, output_tokens, cached_tokens, "
                "est_prompt_tokens_per_line, est_output_tokens_per_line, enqueued_tokens) "
                "VALUES (:id, 't', '/v1/chat/completions', 'file-1', '24h', :status, 0, :t0, "
                ":t1, 5, 0, 0, 0, 0, 0, 0, 0, 0)"),
                {"id": batch_id, "status": status, "t0": T0, "t1": in_progress_at})


def _prepared(db: Database) -> dict[str, tuple]:
    with db.engine.connect() as conn:
        rows = conn.execute(text("SELECT id, prepared_lines, prepared_at FROM batches")).all()
    # SQLite gives the timestamp back as text, PostgreSQL as a datetime.
    return {r[0]: (r[1], None if r[2] is None else str(r[2])[:16]) for r in rows}


def test_chunked_prepare_migration_up_and_down(any_db_url):
    db = Database(any_db_url)
    config = alembic_config(any_db_url)
    command.upgrade(config, "0008_model_kind")
    _seed(db)

    command.upgrade(config, "0009_chunked_prepare")
    assert _prepared(db) == {"b_validating": (0, None), "b_running": (0, "2026-12-01 10:05"),
                             "b_cancelled": (0, "2026-12-01 10:00")}

    command.downgrade(config, "0008_model_kind")
    columns = {c["name"] for c in inspect(db.engine).get_columns("batches")}
    assert not {"prepared_lines", "prepared_at"} & columns
    command.upgrade(config, "head")
    assert _prepared(db)["b_validating"] == (0, None)
    db.dispose()
