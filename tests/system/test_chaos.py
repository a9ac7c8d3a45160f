"""A short seeded chaos run (bench/chaos.py): one minute of batches and jobs of every endpoint
(an adapter's too) from three tenants over two APIs while workers are SIGKILLed and SIGSTOPped,
an API SIGKILLed, PostgreSQL and Redis restarted, S3 taken away and the database link slowed
and stalled; then the auditors find 0 violations over every batch, job, webhook, tenant and
expired file."""

from __future__ import annotations

import pytest

from bench.chaos import run
from bench.chaos_audit import Audit, audit_timestamps, legal_changes
from bench.chaos_faults import KINDS, schedule
from tests.figures import record

# One minute (the suite's time), and a seed whose schedule has every kind of fault in it.
SEED = 7
MEAN_GAP_S = 5.0
RUN_MINUTES = 1.0
TABLE = "Chaos run: faults from a seeded schedule, then the auditor (fake engine)"


def test_schedule_replays_from_its_seed():
    def draw(seed: int):
        return schedule(seed, run_s=60 * RUN_MINUTES, mean_gap_s=MEAN_GAP_S,
                        workers=("w1", "w2"),
                        apis=("api", "api2"), max_outage_s=8)

    assert draw(SEED) == draw(SEED) != draw(SEED + 1)
    assert {f.kind for f in draw(SEED)} == set(KINDS)  # every kind in the run
    assert all(f.outage_s <= 8 for f in draw(SEED))
    assert {f.target for f in draw(SEED) if f.kind == "api_sigkill"} <= {"api", "api2"}


def test_auditor_flags_illegal_changes_and_disordered_timestamps():
    assert legal_changes(["validating", "in_progress", "finalizing", "completed"])
    assert legal_changes(["in_progress", "cancelling", "cancelled"])  # a look missed one
    assert not legal_changes(["in_progress", "finalizing", "in_progress", "completed"])
    assert not legal_changes(["completed", "expired"])
    at = dict.fromkeys(("in_progress_at", "finalizing_at", "completed_at", "failed_at",
                        "expired_at", "cancelling_at", "cancelled_at"))
    good = {**at, "id": "b", "status": "completed", "created_at": 1, "in_progress_at": 2,
            "finalizing_at": 3, "completed_at": 3}
    bad = [{**good, "finalizing_at": 4},  # finalizing after completed
           {**good, "expired_at": 5},  # two final timestamps
           {**good, "status": "cancelled", "cancelled_at": 4}]  # cancelled, never cancelling
    audit = Audit()
    for batch in (good, *bad):
        audit_timestamps(audit, batch)
    assert audit.checked["timestamps ordered"] == 4 and len(audit.violations) == 3


def test_short_chaos_run_has_no_violations():
    try:
        chaos = run(SEED, RUN_MINUTES, mean_gap_s=MEAN_GAP_S, max_outage_s=8.0, every_kind=True)
    except RuntimeError as exc:
        if "not installed" in str(exc):
            pytest.skip(str(exc))
        raise
    print(chaos.table)
    audit = chaos.audit
    record(TABLE, seed=SEED, minutes=RUN_MINUTES, faults=sum(chaos.injected.values()),
           batches=audit.checked["terminal after drain"],
           checks=sum(audit.checked.values()), violations=len(audit.violations))
    assert audit.violations == [], chaos.table
    assert set(chaos.injected) == set(KINDS), chaos.table
    assert audit.checked["each custom_id exactly once"] >= 10, chaos.table  # 15 batches a run
    assert audit.checked["job terminal after drain"] >= 5, chaos.table
    assert audit.checked["webhook delivered and verified"] >= 5, chaos.table
    assert audit.checked["expired file's bytes gone from S3"] >= 1, chaos.table
