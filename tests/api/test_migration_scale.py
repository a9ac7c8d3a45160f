"""0005_scale up and down on SQLite and PostgreSQL, over rows the old code wrote: the counters
are filled from the lines, a repeated custom_id moves from the error JSON onto its line (and
back), lines the old claim marked running are pending again."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from alembic import command
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from service.db import Database
from service.migrate import alembic_config


def _seed(db: Database) -> None:
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).replace(tzinfo=None)
    with db.engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, webhook_secret, created_at) "
                          "VALUES ('t', 't', 's', :now)"), {"now": now})
        conn.execute(text("INSERT INTO files (id, tenant_id, filename, purpose, bytes, "
                          "storage_key, num_lines, num_errors, created_at) VALUES "
                          "('file-1', 't', 'f', 'batch', 1, 'k', 5, 1, :now)"), {"now": now})
        conn.execute(text(
            "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, "
            "status, priority, created_at, num_total, num_completed, num_failed, input_tokens, "
            "output_tokens, cached_tokens, est_prompt_tokens_per_line, "
            "est_output_tokens_per_line) VALUES ('batch_1', 't', '/v1/chat/completions', "
            "'file-1', '24h', 'in_progress', 0, :now, 5, 0, 0, 0, 0, 0, 0, 0)"), {"now": now})
        rows = [  # (line_no, custom_id, status, tokens, error)
            (1, "a", "completed", 10, None),
            (2, "b", "running", 0, None),
            (3, "c", "pending", 0, None),
            (4, None, "failed", 0, '{"code": "duplicate_custom_id", "message": "m", '
                                   '"custom_id": "a"}'),
            (5, "e", "failed", 3, '{"code": "server_error", "message": "m"}'),
        ]
        for line_no, custom_id, status, tokens, error in rows:
            conn.execute(text(
                "INSERT INTO request_lines (tenant_id, batch_id, line_no, custom_id, endpoint, "
                "sort_key, status, error, prompt_tokens, completion_tokens, cached_tokens) "
                "VALUES ('t', 'batch_1', :n, :c, '/v1/chat/completions', '', :s, :e, :p, 1, 2)"),
                {"n": line_no, "c": custom_id, "s": status, "e": error, "p": tokens})


def _lines(db: Database) -> dict[int, tuple]:
    with db.engine.connect() as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(text(
            "SELECT line_no, custom_id, status FROM request_lines ORDER BY line_no"))}


def test_scale_migration_up_and_down(any_db_url):
    db = Database(any_db_url)
    config = alembic_config(any_db_url)
    command.upgrade(config, "0004_deadlines")
    _seed(db)

    command.upgrade(config, "0005_scale")
    with db.engine.connect() as conn:
        counters = conn.execute(text(
            "SELECT slot, num_open, num_completed, num_failed, input_tokens, output_tokens, "
            "cached_tokens FROM batch_counters WHERE batch_id = 'batch_1'")).all()
    assert [tuple(r) for r in counters] == [(0, 2, 1, 2, 13, 5, 10)]
    lines = _lines(db)
    assert lines[2] == ("b", "pending")  # no line is left "running"
    assert lines[4] == ("a", "failed")  # the repeated custom_id is on its line
    names = {i["name"] for i in inspect(db.engine).get_indexes("request_lines")}
    assert {"uq_request_lines_batch_custom_id", "ix_request_lines_batch_line"} <= names

    command.downgrade(config, "0004_deadlines")
    inspector = inspect(db.engine)
    assert "batch_counters" not in inspector.get_table_names()
    assert "engine_fields" not in {c["name"] for c in inspector.get_columns("request_lines")}
    assert "uq_request_lines_batch_custom_id" in {
        u["name"] for u in inspector.get_unique_constraints("request_lines")}
    lines = _lines(db)
    assert lines[4] == (None, "failed")  # back in the error JSON, where 0004's finalize looks
    with db.engine.connect() as conn:
        error = conn.execute(text("SELECT error FROM request_lines WHERE line_no = 4")).scalar()
    assert (json.loads(error) if isinstance(error, str) else error)["custom_id"] == "a"

    command.upgrade(config, "head")  # and up again
    assert _lines(db)[4] == ("a", "failed")

    # 0006 down and up (on PostgreSQL its indexes change CONCURRENTLY, outside a transaction).
    command.downgrade(config, "0005_scale")
    names = {i["name"] for i in inspect(db.engine).get_indexes("request_lines")}
    assert {"ix_request_lines_batch_status", "ix_request_lines_shard_status",
            "uq_request_lines_batch_custom_id"} <= names
    assert not {n for n in names if n.endswith(("_new", "_old"))}
    command.upgrade(config, "head")
    indexes = {i["name"]: i for i in inspect(db.engine).get_indexes("request_lines")}
    assert "ix_request_lines_shard" in indexes and "ix_request_lines_batch_status" not in indexes
    assert indexes["uq_request_lines_batch_custom_id"]["unique"]
    with db.engine.begin() as conn, pytest.raises(IntegrityError):  # uniqueness still holds
        conn.execute(text(
            "INSERT INTO request_lines (tenant_id, batch_id, line_no, custom_id, endpoint, "
            "sort_key, status, shard_id) VALUES ('t', 'batch_1', 9, 'c', "
            "'/v1/chat/completions', '', 'pending', 'batch_1:0')"))
    db.dispose()
