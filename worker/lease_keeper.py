"""The worker's shard leases: claim work when the engine's backlog runs low, heartbeat what is
held, drop what was lost or whose batch stopped (cancelled, expired), and make other workers'
expired leases claimable again. The database is polled; broker messages only ring the bell."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from metrics.counters import BACKLOG_LINES, SHARDS_CLAIMED
from service import ids, served_models
from service.db import Database, utcnow
from service.loop import RoundLoop
from service.models import IN_PROGRESS
from service.settings import Settings
from worker import claims
from worker.drain import Drainer
from worker.items import HeldShards
from worker.result_writer import settle_job

log = logging.getLogger(__name__)

# Bulk shards one claim statement takes at most, and how many candidates it may pick them from.
BULK_PER_CLAIM = 2
CANDIDATES_PER_WANT = 4
# How often a worker with no room for bulk work (its engine's queue is deep: most of a busy
# worker's rounds) polls for jobs without being asked. A job's broker message wakes the claim
# loop at once; this poll only finds jobs whose message was lost. Every round (the poll
# interval, 0.5 s) it cost a transaction: 32 busy workers, 64 a second, ~18% of a paced bench
# worker's CPU (bench.cpu_profile).
BUSY_CLAIM_POLL_S = 2.0
# Where a claim starts in each batch's run of equal shards (claims.find_candidates' spread):
# drawn anew each claim, from more places than a batch's candidates (so every start is as
# likely), from a generator seeded by the worker's id (a rerun draws the same).
SPREAD_SPAN = 1 << 20


class LeaseKeeper(RoundLoop):
    round_name = "lease round"

    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        worker_id: str,
        held: HeldShards,
        drainer: Drainer,
        announce_shards: Callable[[list[str]], None],
        on_batches_touched: Callable[[set[str]], None],
        model: str | None = None,
        aliases: list[str] | None = None,
        kind: str | None = None,
        engine_alive: Callable[[], bool] = lambda: True,
        on_engine_dead: Callable[[], None] = lambda: None,
        on_claims: Callable[[int, int, int], None] = lambda attempts, won, lost: None,
    ) -> None:
        super().__init__(min(settings.poll_interval, settings.lease_seconds / 3),
                         # Idle means nothing held: no lease to renew, only the reaper's turn.
                         idle_interval=settings.idle_poll_interval)
        self.db = db
        self.settings = settings
        self.worker_id = worker_id
        self._spread = random.Random(worker_id)
        self.held = held
        self.drainer = drainer
        self._announce_shards = announce_shards
        self._on_batches_touched = on_batches_touched
        self.model = model  # claim only this model's shards (None: any, a test's fake engine)
        self.aliases = aliases or []
        self.kind = kind  # service.served_models.KINDS
        self._last_check = 0.0
        self._last_reap = 0.0
        self._last_announce = 0.0  # never: the first round announces (unless start() did)
        self._check_now = threading.Event()  # a batch changed: look at the held batches now
        # Leases are renewed only for an engine that runs: a worker whose engine thread died
        # must not keep its shards alive (nobody else could take them).
        self._engine_alive = engine_alive
        self._on_engine_dead = on_engine_dead
        # (shards asked for, shards won, wanted ones lost to others): the worker's metrics
        self._on_claims = on_claims
        self._found_work = False
        # Until then a hungry engine does not wake the claim loop: its last claim found the
        # queue dry (see ``wake_hungry``).
        self._dry_until = 0.0
        self._asked = True  # a wake since the last claim poll (the first round claims)
        self._last_claim_poll = 0.0

    def wake(self, *, check: bool = False) -> None:
        self._asked = True
        if check:
            self._check_now.set()
        self._wake.set()

    def wake_hungry(self) -> None:
        """The engine's queue is running low: claim more now, unless the last claim found no
        candidate less than a poll interval ago. The drain loop calls this at every step that
        leaves its queue low, so with the queue dry (a batch's last shards are all taken) each
        worker would otherwise run a claim transaction per engine step (12 a second at the
        paced bench's pace, 32 workers: ~400 a second, all finding nothing). New shards still
        wake it at once (their broker message: ``wake``), and the poll finds them anyway."""
        if time.monotonic() >= self._dry_until:
            self.wake()

    def has_room(self, *, is_job: bool) -> bool:
        bulk, jobs, lines = self.held.counts()
        if is_job:
            return jobs < self.settings.worker_max_jobs
        return (bulk < self.settings.worker_max_shards
                and lines < self.settings.worker_max_lines
                and self.drainer.num_queued < self.drainer.low_water)

    def _bulk_to_low_water(self) -> int:
        """The bulk shards that bring the engine's queue up to its low water (at least one).

        No more: a held line is one no other worker can run, so at a batch's end a worker that
        took two shards when one was enough keeps running while others have gone idle (32 paced
        workers reached 79% of ideal in the run phase, most of the loss in that tail)."""
        missing = self.drainer.low_water - self.drainer.num_queued
        return max(1, -(-missing // self.settings.shard_size))

    def claim(self, shard_ids: list[str], *, max_bulk: int, max_jobs: int,
              fill: bool = False) -> int:
        """Claim up to ``max_bulk`` bulk and ``max_jobs`` job shards among ``shard_ids`` (in
        that order of preference; with ``fill``, bulk shards others took meanwhile are made up
        for by other claimable ones, ``claims.claim_shards``) in one short transaction, then
        load their lines with no lock held and hand them to the engine; returns the number of
        shards won."""
        with self.db.session() as session:
            claimed = self._claim_in(session, shard_ids, max_bulk=max_bulk, max_jobs=max_jobs,
                                     fill=fill)
        return self._load(claimed)

    def _claim_in(self, session: Session, shard_ids: list[str], *, max_bulk: int,
                  max_jobs: int, fill: bool) -> list[claims.ClaimedShard]:
        """The claim statement, counted (``on_claims``) only when it runs: the shards it asked
        for, those it won and the wanted ones another worker had (``claims.num_lost``).
        Nothing to ask for (no candidate: the queue is dry) runs no statement and counts
        nothing."""
        num_jobs = sum(1 for sid in shard_ids if ids.is_job_shard(sid))
        attempts = min(num_jobs, max_jobs) + min(len(shard_ids) - num_jobs, max_bulk)
        if attempts <= 0:
            return []
        claimed = claims.claim_shards(
            session, shard_ids, worker_id=self.worker_id,
            lease_seconds=self.settings.lease_seconds, max_bulk=max_bulk, max_jobs=max_jobs,
            model=self.model, fill=fill)
        self._on_claims(attempts, len(claimed), claims.num_lost(
            shard_ids, claimed, max_bulk=max_bulk, max_jobs=max_jobs))
        return claimed

    def _load(self, claimed: list[claims.ClaimedShard]) -> int:
        """Load the claimed shards' lines (after the claim's commit, no lock held) and hand
        them to the engine; returns how many."""
        if not claimed:
            return 0
        try:
            with self.db.read_session() as session:
                found = claims.load_lines(session, claimed)
        except Exception:
            # Hand them back now rather than when the leases run out.
            with self.db.session() as session:
                claims.release(session, [c.id for c in claimed], worker_id=self.worker_id)
            raise
        for claim in found:
            self._take(claim)
        return len(found)

    def _take(self, claim: claims.Claim) -> None:
        """Hand a claimed shard's lines to the engine; fail a poison shard's lines, close an
        empty one."""
        settings = self.settings
        poisoned = claim.attempts > settings.max_shard_attempts
        if poisoned or not claim.lines:
            with self.db.session() as session:
                if poisoned:
                    claims.fail_lines(
                        session, [w.line_pk for w in claim.lines], code="server_error",
                        message=f"gave up after {claim.attempts - 1} workers failed to run this "
                        "shard", worker_id=self.worker_id)
                    if claim.shard.job_id is not None:
                        settle_job(session, claim.shard.job_id)
                claims.finish_shard(session, claim.shard.id, worker_id=self.worker_id)
            if claim.shard.batch_id is not None:
                self._on_batches_touched({claim.shard.batch_id})
            return
        SHARDS_CLAIMED.inc()
        self.held.add(claim.shard)
        self.drainer.add(claim.lines, is_job=claim.shard.is_job)
        log.debug("claimed %s (%d lines)", claim.shard.id, len(claim.lines))

    def claim_some(self) -> int:
        """Claim what there is room for: jobs, then up to ``BULK_PER_CLAIM`` bulk shards (no
        more than the engine's queue needs to reach its low water), in one statement (called
        in a loop). The candidates are a few times what is wanted, so a worker that loses some
        to others still gets its share in the same statement."""
        bulk, jobs, _ = self.held.counts()
        max_jobs = self.settings.worker_max_jobs - jobs
        max_bulk = self.settings.worker_max_shards - bulk if self.has_room(is_job=False) else 0
        max_bulk = min(max_bulk, BULK_PER_CLAIM, self._bulk_to_low_water())
        reap = time.monotonic() - self._last_reap >= self.settings.lease_seconds
        if max_jobs <= 0 and max_bulk <= 0:
            if reap:
                self._reap()
            return 0
        # On PostgreSQL the reap (when due), the candidates' read and the claim are one
        # transaction: one commit a poll, and the claim follows the read by a round trip, so
        # candidates are seldom gone by then. SQLite reads without its write lock and claims
        # in a write transaction of its own only when there is something to claim.
        one = not self.db.is_sqlite
        claimed: list[claims.ClaimedShard] = []
        with self.db.session() if reap or one else self.db.read_session() as session:
            reaped = claims.reap_expired(session) if reap else []
            candidates = claims.find_candidates(
                session, now=utcnow(), model=self.model, max_bulk=max_bulk * CANDIDATES_PER_WANT,
                max_jobs=max_jobs, spread=self._spread.randrange(SPREAD_SPAN))
            shard_ids = [c.id for c in candidates if c.id not in self.held]
            if one:
                claimed = self._claim_in(session, shard_ids, max_bulk=max_bulk,
                                         max_jobs=max_jobs, fill=True)
        if reap:
            self._reaped(reaped)
        self._found_work = bool(shard_ids)
        self._dry_until = 0.0 if shard_ids else time.monotonic() + self.interval
        if one:
            return self._load(claimed)
        return self.claim(shard_ids, max_bulk=max_bulk, max_jobs=max_jobs, fill=True)

    def _reap(self) -> None:
        with self.db.session() as session:
            reaped = claims.reap_expired(session)
        self._reaped(reaped)

    def _reaped(self, reaped: list[str]) -> None:
        self._last_reap = time.monotonic()
        if reaped:
            log.info("made %d shards with expired leases claimable again", len(reaped))
            self._announce_shards(reaped)

    def announce(self) -> None:
        """Say (again) that this worker serves its model (at start, then once a minute): a read
        of the model's row, written only when something changed or it is due a refresh
        (``service.served_models``: the heartbeat keeps the model seen meanwhile)."""
        if self.model is not None:
            with self.db.session() as session:
                served_models.announce(session, model=self.model, aliases=self.aliases,
                                       kind=self.kind, model_ttl=self.settings.model_ttl)
            self._last_announce = time.monotonic()

    def check(self) -> None:
        """Heartbeat what is held (one statement); drop lost shards and stopped batches. A
        worker holding nothing does not touch the database here (expired leases are reaped
        with the claim poll, ``claim_some``)."""
        held = self.held.ids()
        if not held:
            return
        with self.db.session() as session:
            lost = claims.heartbeat(session, held, worker_id=self.worker_id,
                                    lease_seconds=self.settings.lease_seconds)
            statuses = claims.batch_statuses(session, self.held.batch_ids())
        if lost:
            log.warning("lost the lease of %d shards: %s", len(lost), sorted(lost))
            # The drop applies at the drain loop's next turn, maybe after this thread claimed
            # a lost shard again: it names the lost claims, not the shards.
            claims_lost = {(shard.id, shard.attempt) for shard in self.held.remove(lost)}
            self.drainer.drop(lambda work: (work.shard_id, work.attempt) in claims_lost)
        stopped = {bid for bid, status in statuses.items() if status != IN_PROGRESS}
        if stopped:
            log.info("batches %s stopped (%s); dropping their lines", sorted(stopped),
                     {statuses[b] for b in stopped})
            self.held.remove(self.held.of_batches(stopped))
            self.drainer.drop(lambda work: work.batch_id in stopped)
            self._on_batches_touched(stopped)

    def is_idle(self) -> bool:
        """Nothing held, nothing queued, and the last claim found no candidate."""
        return not len(self.held) and not self.drainer.num_backlog and not self._found_work

    def run_round(self) -> bool:
        if not self._engine_alive():  # no heartbeats, claims or model announcements
            if not self.stopping:
                log.critical("the engine thread is dead: no more heartbeats or claims")
                self._on_engine_dead()
            return False
        if time.monotonic() - self._last_announce >= min(60.0, self.settings.model_ttl / 10):
            self.announce()
        heartbeat_every = self.settings.lease_seconds / 3
        if self._check_now.is_set() or time.monotonic() - self._last_check >= heartbeat_every:
            self._check_now.clear()
            self._last_check = time.monotonic()
            self.check()
        if (self._asked or self.has_room(is_job=False)
                or time.monotonic() - self._last_claim_poll >= BUSY_CLAIM_POLL_S):
            self._asked = False
            self._last_claim_poll = time.monotonic()
            while not self.stopping and self.claim_some():
                pass
        BACKLOG_LINES.set(self.drainer.num_backlog)
        return False
