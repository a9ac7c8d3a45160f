"""Prepare in committed chunks: each chunk's shards are claimable once it commits, finalize waits
for the last one, and a prepare that stops half way (an error, a killed worker, a lease taken
over) is resumed from the batch's cursor with every line inserted exactly once, in the same
shards as a prepare that never stopped."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import func, select, update

from service import counters
from service.db import utcnow
from service.models import Batch, RequestLine, Shard
from tests.conftest_services import chat_line
from worker import claims, finalize, prepare_rows
from worker.housekeeper import Housekeeper
from worker.prepare import PrepareLeaseLost, chunk_shards, prepare_batch


def lines(n: int) -> list:
    """``n`` lines, every seventh a bad one (a temperature past 2), most ninths a repeated
    custom_id (its first is the line before), and prompts of a few prefixes: at 60, 47 valid
    lines, 8 bad, 5 repeats."""
    out: list = []
    for i in range(n):
        if i % 7 == 6:
            out.append(chat_line(f"bad{i}", "x", temperature=3))
        elif i % 9 == 8:
            out.append(chat_line(f"c{i - 1}", "repeated"))
        else:
            out.append(chat_line(f"c{i}", f"prefix {i % 3} line {i}"))
    return out


def layout(db, batch_id: str) -> dict:
    """Everything prepare wrote for a batch, by line number and shard index (no batch ids)."""
    with db.read_session() as session:
        rows = session.execute(
            select(RequestLine.line_no, RequestLine.status, RequestLine.custom_id,
                   RequestLine.body, RequestLine.error, RequestLine.position,
                   RequestLine.shard_id, RequestLine.enqueued_tokens)
            .where(RequestLine.batch_id == batch_id).order_by(RequestLine.pk)).all()
        shards = session.execute(select(Shard.id, Shard.num_lines)
                                 .where(Shard.batch_id == batch_id)).all()
        batch = session.scalars(select(Batch).where(Batch.id == batch_id)).one()
        sums = counters.sums(session, [batch_id])[batch_id]
    return {
        "lines": [(r.line_no, r.status, r.custom_id, r.body, (r.error or {}).get("message"),
                   r.position, r.shard_id and r.shard_id.rsplit(":", 1)[1], r.enqueued_tokens)
                  for r in rows],
        "shards": sorted((int(s.id.rsplit(":", 1)[1]), s.num_lines) for s in shards),
        "batch": (batch.status, batch.num_total, batch.errors, batch.enqueued_tokens,
                  batch.est_prompt_tokens_per_line, batch.est_output_tokens_per_line,
                  batch.prepared_lines, batch.prepared_at is not None, batch.lease_owner),
        "counters": (sums.num_open, sums.num_failed),
    }


def prepared_whole(stack, *, shard_size: int) -> tuple[str, dict]:
    """A 60-line batch (``lines``) prepared in one run that never stopped: its id and
    ``layout``, what a resumed prepare must match."""
    whole = stack.create_batch(lines(60))["id"]
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, whole, worker_id="prep",
                         shard_size=shard_size)
    return whole, layout(stack.ctx.db, whole)


def test_chunks_double_from_a_few_shards_up_to_the_cap():
    assert [chunk_shards(n) for n in (0, 4, 8, 16, 32, 64, 1000)] == [4, 4, 8, 16, 32, 32, 32]


def test_each_chunk_is_claimable_once_committed_and_finalize_waits_for_the_last(
        make_stack, any_db_url):
    stack = make_stack(any_db_url)
    db = stack.ctx.db
    batch = stack.create_batch(lines(60))
    seen: list[dict] = []

    def on_shards(shard_ids: list[str]) -> None:
        # Committed: visible to any other session, the batch running, its shards claimable.
        with db.read_session() as session:
            row = session.scalars(select(Batch).where(Batch.id == batch["id"])).one()
            candidates = claims.find_candidates(session, now=utcnow(), max_bulk=100,
                                                max_jobs=0)
            num_lines = session.scalar(select(func.count()).select_from(RequestLine)
                                       .where(RequestLine.batch_id == batch["id"]))
        seen.append({"shards": len(shard_ids), "status": row.status,
                     "cursor": row.prepared_lines, "prepared": row.prepared_at is not None,
                     "claimable": {c.id for c in candidates} >= set(shard_ids),
                     "lines": num_lines, "total": stack.batch(batch["id"])["request_counts"]})
        if len(seen) == 1:
            # The first chunk's lines all end (a poison shard, say): with no line open, the
            # batch is still not finalized, its prepare not being over.
            with db.session() as session:
                pks = session.scalars(select(RequestLine.pk).where(
                    RequestLine.shard_id.in_(shard_ids))).all()
                claims.fail_lines(session, list(pks), code="server_error", message="m",
                                  worker_id="w")
            with db.read_session() as session:
                assert counters.num_open(session, batch["id"]) == 0
                assert batch["id"] not in finalize.finalizable_batches(session)
            assert finalize.finalize_batch(db, stack.ctx.storage, batch["id"],
                                           worker_id="w") is None

    created = prepare_batch(db, stack.ctx.storage, batch["id"], worker_id="prep", shard_size=1,
                            on_shards=on_shards)
    # 47 valid lines in chunks of 4, 4, 8, 16 shards and the rest, 15.
    assert [s["shards"] for s in seen] == [4, 4, 8, 16, 15]
    assert len(created) == 47
    assert all(s["status"] == "in_progress" and s["claimable"] for s in seen)
    assert [s["prepared"] for s in seen] == [False] * 4 + [True]
    cursors = [s["cursor"] for s in seen]
    assert cursors == [4, 10, 20, 40, 60]  # each chunk ends at the valid line that fills it
    assert [s["lines"] for s in seen] == cursors  # every line up to the cursor, no more
    assert {s["total"]["total"] for s in seen} == {60}  # the file's count from the start
    with db.read_session() as session:
        assert finalize.finalizable_batches(session) == []  # 43 lines open
    assert stack.batch(batch["id"])["request_counts"] == {"total": 60, "completed": 0,
                                                          "failed": 13 + 4}


class Killed(BaseException):
    """The worker's process ends here (no ``except Exception`` runs: the lease stays)."""


def _stopping_at(line_no: int, exc: BaseException):
    """``iter_lines`` that raises ``exc`` when it reaches ``line_no``."""
    real = prepare_rows.iter_lines

    def iter_lines(storage, key):
        for n, raw in enumerate(real(storage, key), start=1):
            if n == line_no:
                raise exc
            yield raw
    return iter_lines


def _expire_lease(db, batch_id: str) -> None:
    with db.session() as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            lease_expires_at=utcnow() - dt.timedelta(seconds=1)))


@pytest.mark.parametrize("crash", ["error", "killed"])
def test_a_prepare_stopped_half_way_resumes_each_line_exactly_once(
        make_stack, any_db_url, monkeypatch, crash):
    stack = make_stack(any_db_url)
    db, storage = stack.ctx.db, stack.ctx.storage
    _, expected = prepared_whole(stack, shard_size=2)

    batch_id = stack.create_batch(lines(60))["id"]
    # Chunks of 8, 8, 16 valid lines end at lines 10, 20, 40: stop in the third chunk.
    with monkeypatch.context() as patch:
        if crash == "error":  # storage fails: the worker hands the lease back
            patch.setattr(prepare_rows, "iter_lines", _stopping_at(30, OSError("storage")))
            with pytest.raises(OSError):
                prepare_batch(db, storage, batch_id, worker_id="prep", shard_size=2)
        else:  # the worker is killed: its lease stays until it runs out
            patch.setattr(prepare_rows, "iter_lines", _stopping_at(30, Killed()))
            with pytest.raises(Killed):
                prepare_batch(db, storage, batch_id, worker_id="prep", shard_size=2)
    half = layout(db, batch_id)
    assert half["batch"][0] == "in_progress" and half["batch"][6] == 20
    assert half["batch"][7] is False  # not prepared: finalize leaves it alone
    assert half["lines"] == [line for line in expected["lines"] if line[0] <= 20]
    assert half["counters"] == (16, 4)  # through line 20: 16 valid, 2 bad and 2 repeats
    if crash == "killed":
        assert half["batch"][8] == "prep"
        assert prepare_batch(db, storage, batch_id, worker_id="other", shard_size=2) is None
        _expire_lease(db, batch_id)
    else:
        assert half["batch"][8] is None

    # Another worker's housekeeping finds the unfinished batch and resumes it.
    announced: list[str] = []
    keeper = Housekeeper(db, storage, stack.settings.model_copy(update={"shard_size": 2}),
                         worker_id="other", on_prepared=announced.extend,
                         on_finalized=lambda: None)
    keeper.run_once(scan=False)
    assert layout(db, batch_id) == expected
    assert sorted(announced) == sorted(
        f"{batch_id}:{k}" for k in range(len(half["shards"]), len(expected["shards"])))


def test_a_prepare_whose_lease_was_taken_over_commits_nothing_more(make_stack, any_db_url,
                                                                    monkeypatch):
    """The first preparer stalls past its lease in its third chunk; another prepares the
    batch to the end; the first's commit then finds the cursor moved and rolls back."""
    stack = make_stack(any_db_url)
    db, storage = stack.ctx.db, stack.ctx.storage
    _, expected = prepared_whole(stack, shard_size=2)
    batch_id = stack.create_batch(lines(60))["id"]
    real = prepare_rows.iter_lines

    def stalling(storage_, key):
        for n, raw in enumerate(real(storage_, key), start=1):
            if n == 30:
                _expire_lease(db, batch_id)
                monkeypatch.setattr(prepare_rows, "iter_lines", real)
                assert prepare_batch(db, storage, batch_id, worker_id="other", shard_size=2)
            yield raw

    monkeypatch.setattr(prepare_rows, "iter_lines", stalling)
    with pytest.raises(PrepareLeaseLost):
        prepare_batch(db, storage, batch_id, worker_id="prep", shard_size=2)
    assert layout(db, batch_id) == expected


def _killed_half_way(stack, monkeypatch) -> str:
    """A 60-line batch whose preparer was killed in its third chunk (lines 1-20 committed)."""
    batch_id = stack.create_batch(lines(60))["id"]
    with monkeypatch.context() as patch:
        patch.setattr(prepare_rows, "iter_lines", _stopping_at(30, Killed()))
        with pytest.raises(Killed):
            prepare_batch(stack.ctx.db, stack.ctx.storage, batch_id, worker_id="prep",
                          shard_size=2)
    _expire_lease(stack.ctx.db, batch_id)
    return batch_id


def test_an_unfinished_prepare_past_its_window_is_expired(make_stack, sqlite_url, monkeypatch):
    stack = make_stack(sqlite_url)
    db = stack.ctx.db
    batch_id = _killed_half_way(stack, monkeypatch)
    assert finalize.finalize_batch(db, stack.ctx.storage, batch_id, worker_id="w") is None
    with db.session() as session:  # its window ends before any worker resumes it
        session.execute(update(Batch).where(Batch.id == batch_id).values(
            expires_at=utcnow() - dt.timedelta(seconds=1)))
    with db.read_session() as session:
        assert finalize.finalizable_batches(session) == [batch_id]
    assert finalize.finalize_batch(db, stack.ctx.storage, batch_id, worker_id="w") == "expired"
    assert prepare_batch(db, stack.ctx.storage, batch_id, worker_id="w", shard_size=2) is None
    counts = stack.batch(batch_id)["request_counts"]
    assert counts == {"total": 20, "completed": 0, "failed": 20}  # the lines it had


def test_a_file_deleted_half_way_ends_prepare_at_the_cursor(make_stack, sqlite_url,
                                                            monkeypatch):
    stack = make_stack(sqlite_url)
    db = stack.ctx.db
    batch_id = _killed_half_way(stack, monkeypatch)
    file_id = stack.batch(batch_id)["input_file_id"]
    assert stack.client.delete(f"/v1/files/{file_id}").status_code == 200
    assert prepare_batch(db, stack.ctx.storage, batch_id, worker_id="w", shard_size=2) == []
    half = layout(db, batch_id)
    assert half["batch"][:2] == ("in_progress", 20) and half["batch"][6:9] == (20, True, None)
    assert half["batch"][2][-1]["code"] == "invalid_file"
    assert "lines after 20 not read" in half["batch"][2][-1]["message"]
    assert half["counters"] == (16, 4)
