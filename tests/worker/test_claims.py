"""Where a claim starts among equal shards (``claims.find_candidates``' ``spread``): each
batch's run of shards is rotated, never reordered against another batch, so workers that read
the same head of the queue try different shards first; with PostgreSQL two workers of different
spreads take different shards and lose none to each other."""

from __future__ import annotations

from service.db import utcnow
from tests.conftest_services import chat_line
from worker import claims
from worker.claims import Candidate, rotated
from worker.prepare import prepare_batch


def shards(batch_id: str, n: int) -> list[Candidate]:
    return [Candidate(f"{batch_id}:{i}", "t", 0, False, None, batch_id) for i in range(n)]


def ids(found: list[Candidate]) -> list[str]:
    return [c.id for c in found]


def test_each_batch_s_run_is_rotated_in_place():
    both = shards("a", 4) + shards("b", 3)
    assert rotated(both, 0) == both
    assert ids(rotated(both, 1)) == ["a:1", "a:2", "a:3", "a:0", "b:1", "b:2", "b:0"]
    assert ids(rotated(both, 5)) == ["a:1", "a:2", "a:3", "a:0", "b:2", "b:0", "b:1"]
    assert rotated([], 3) == []


def test_candidates_start_where_the_spread_says_and_keep_the_batch_order(make_stack,
                                                                         any_db_url):
    stack = make_stack(any_db_url)  # no worker: nothing claims behind our back
    first, second = (stack.create_batch([chat_line(f"{name}-{i}", "x") for i in range(16)])
                     for name in ("first", "second"))
    for batch in (first, second):
        assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                             shard_size=4)

    def candidates(spread: int) -> list[str]:
        with stack.ctx.db.read_session() as session:
            return ids(claims.find_candidates(session, now=utcnow(), max_bulk=8, max_jobs=0,
                                              spread=spread))

    in_order = [f"{b['id']}:{i}" for b in (first, second) for i in range(4)]
    assert candidates(0) == in_order
    assert candidates(2) == [in_order[i] for i in (2, 3, 0, 1, 6, 7, 4, 5)]
    # Two workers of different spreads read the same head, then claim: different shards,
    # neither losing one it wanted to the other.
    won = []
    for worker, wanted in (("w1", candidates(0)), ("w2", candidates(2))):
        with stack.ctx.db.session() as session:
            got = claims.claim_shards(session, wanted, worker_id=worker, lease_seconds=30,
                                      max_bulk=2, max_jobs=0)
        assert [c.id for c in got] == wanted[:2]
        won.append({c.id for c in got})
    assert won[0].isdisjoint(won[1])
