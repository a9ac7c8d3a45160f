"""What the scale benchmark measures besides the API's answers: PostgreSQL's view of one database
(backends waiting on locks, connections, commits) sampled from another connection, the CPU time
of that database's backend processes read from /proc, the machine's CPU from /proc/stat, and the
claim counters on the API's /metrics.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

import psycopg
from sqlalchemy.engine import make_url

CLAIM_ATTEMPTS = "boxcar_shard_claim_attempts_total"
CLAIMS = "boxcar_shard_claims_total"
# Contention (worker.claims.num_lost): absent from workers older than these counters.
CLAIM_STATEMENTS = "boxcar_shard_claim_statements_total"
CLAIMS_LOST = "boxcar_shard_claims_lost_total"
CLAIM_STATEMENTS_CONTENDED = "boxcar_shard_claim_statements_contended_total"


def libpq_url(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` as psycopg's own connect() takes it."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(
        hide_password=False)


def process_cpu_s(pid: int) -> float | None:
    """utime + stime of a process in seconds; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After "pid (comm)": state is field 3, utime 14 and stime 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """utime + stime of the live processes of process group ``pgid`` (a process started with
    ``start_new_session`` and its children), in seconds."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # pgrp is field 5 (proc(5))
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; idle and iowait are not busy."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    total = sum(values[:8])  # guest time is already inside user and nice
    return total - values[3] - values[4], total


def cpu_busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def commits(server_url: str, database: str) -> int:
    """The database's committed transactions so far (pg_stat_database)."""
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                           (database,)).fetchone()
    if row is None:
        raise RuntimeError(f"pg_stat_database has no row for {database}")
    return int(row[0])


def free_connections(server_url: str) -> int:
    """Connections the server has left: max_connections less those open now."""
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('max_connections')::int - "
                           "(SELECT count(*) FROM pg_stat_activity)").fetchone()
    assert row is not None
    return int(row[0])


def claim_counters(metrics_text: str) -> tuple[float, float] | None:
    """(attempts, claims) summed over workers from a /metrics page; None when the page has no
    such counters (code from before they existed)."""
    sums = summed_counters(metrics_text, (CLAIM_ATTEMPTS, CLAIMS))
    if CLAIM_ATTEMPTS not in sums or CLAIMS not in sums:
        return None
    return sums[CLAIM_ATTEMPTS], sums[CLAIMS]


@dataclass(frozen=True)
class Contention:
    """Claim statements that ran, those that lost a wanted shard to another worker, and the
    shards lost, summed over workers."""

    statements: float
    contended: float
    lost: float


def claim_contention(metrics_text: str) -> Contention | None:
    """From a /metrics page; None when its workers export no such counters."""
    names = (CLAIM_STATEMENTS, CLAIM_STATEMENTS_CONTENDED, CLAIMS_LOST)
    sums = summed_counters(metrics_text, names)
    if any(name not in sums for name in names):
        return None
    return Contention(*(sums[name] for name in names))


def summed_counters(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The samples named ``names`` on a /metrics page, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


_SPACES = re.compile(r"\s+")
_VERB = re.compile(r"^(?:WITH\b.*?\)\s*)?(SELECT|INSERT INTO|UPDATE|DELETE FROM|COPY)\s+(\w+)",
                   re.IGNORECASE)
_FROM = re.compile(r"\bFROM\s+(\w+)", re.IGNORECASE)
_SET = re.compile(r"\bSET\s+(\w+)", re.IGNORECASE)
_CONFLICT = re.compile(r"\bON CONFLICT\b", re.IGNORECASE)


def statement_label(query: str | None) -> str:
    """A short name for a statement that groups its executions: its verb, its table and, for an
    UPDATE, the first column it sets (``UPDATE shards SET lease_expires_at``), whatever the
    parameters; the first 40 characters of anything else."""
    text = _SPACES.sub(" ", query or "").strip()
    found = _VERB.match(text)
    if found is None:
        return text[:40] or "(none)"
    verb, table = found.group(1).upper(), found.group(2)
    if verb == "SELECT":
        source = _FROM.search(text)
        return f"SELECT FROM {source.group(1) if source else table}"
    if verb == "UPDATE":
        column = _SET.search(text)
        return f"UPDATE {table} SET {column.group(1)}" if column else f"UPDATE {table}"
    if verb == "INSERT INTO" and _CONFLICT.search(text):
        return f"INSERT INTO {table} ON CONFLICT"
    return f"{verb} {table}"


@dataclass
class PgActivity:
    num_samples: int = 0  # looks at pg_stat_activity
    backends: int = 0  # backend samples: one per backend of the database per look
    non_idle: int = 0  # of those, not 'idle' (active, or idle in a transaction)
    active: int = 0  # backend samples in state 'active'
    # Active samples waiting on their own client (ClientRead during pipelined writes): busy
    # in name only, they inflate a share taken over active samples.
    client_waits: int = 0
    lock_waits: int = 0  # active samples waiting on a lock (a row or a relation)
    peak_connections: int = 0
    backend_cpu_s: float = 0.0
    # Active samples that were waiting, by (wait_event_type, wait_event, statement_label): what
    # the lock-wait share is made of, and the other waits (I/O, lightweight locks) beside it.
    waits: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    @property
    def lock_wait_share(self) -> float | None:
        """Lock samples over active ones (the figure before issue 31; see the two below)."""
        return self.lock_waits / self.active if self.active else None

    @property
    def lock_share_of_backends(self) -> float | None:
        """Lock samples over every backend sample."""
        return self.lock_waits / self.backends if self.backends else None

    @property
    def lock_share_of_non_idle(self) -> float | None:
        """Lock samples over the samples of backends that were not idle."""
        return self.lock_waits / self.non_idle if self.non_idle else None


class PgSampler:
    """Samples pg_stat_activity for ``database`` every ``interval`` seconds on a thread of its
    own, from a connection to another database (so its own queries count in neither the
    database's commits nor its backends), and adds up the CPU time of every backend process it
    saw: from its value at ``start()`` for those already there, from zero for later ones."""

    def __init__(self, server_url: str, database: str, *, interval: float = 0.05,
                 cpu_every: int = 10) -> None:
        self.url = libpq_url(server_url)
        self.database = database
        self.interval = interval
        self.cpu_every = cpu_every  # /proc reads are costlier than the query: every 10th sample
        self.activity = PgActivity()
        self._baseline: dict[int, float] = {}
        self._last_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        self.error: BaseException | None = None

    def start(self) -> PgSampler:
        self._conn = psycopg.connect(self.url, autocommit=True)
        for pid in self._sample():
            cpu = process_cpu_s(pid)
            if cpu is not None:
                self._baseline[pid] = self._last_cpu[pid] = cpu
        self._thread = threading.Thread(target=self._run, name="pg-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> PgActivity:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        try:
            self._read_cpu(list(self._last_cpu))
        finally:
            if self._conn is not None:
                self._conn.close()
        if self.error is not None:
            raise RuntimeError(f"sampling pg_stat_activity failed: {self.error}") from self.error
        self.activity.backend_cpu_s = sum(
            cpu - self._baseline.get(pid, 0.0) for pid, cpu in self._last_cpu.items())
        return self.activity

    def _run(self) -> None:
        try:
            n = 0
            while not self._stop.wait(self.interval):
                pids = self._sample()
                n += 1
                if n % self.cpu_every == 0:
                    self._read_cpu(pids)
        except BaseException as exc:  # reported by stop(): a figure would be wrong without it
            self.error = exc

    def _sample(self) -> list[int]:
        assert self._conn is not None
        rows = self._conn.execute(
            "SELECT pid, state, wait_event_type, wait_event, query FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()", (self.database,)).fetchall()
        act = self.activity
        act.num_samples += 1
        act.peak_connections = max(act.peak_connections, len(rows))
        act.backends += len(rows)
        for _, state, wait_type, wait_event, query in rows:
            act.non_idle += state is not None and state != "idle"
            if state == "active":
                act.active += 1
                act.lock_waits += wait_type == "Lock"
                act.client_waits += wait_type == "Client"
                if wait_type is not None:
                    act.waits[(wait_type, wait_event or "", statement_label(query))] += 1
        pids = [int(r[0]) for r in rows]
        for pid in pids:
            self._last_cpu.setdefault(pid, 0.0)  # first seen after start(): born in the run
        return pids

    def _read_cpu(self, pids: list[int]) -> None:
        for pid in pids:
            cpu = process_cpu_s(pid)
            if cpu is not None:  # gone: keep its last reading
                self._last_cpu[pid] = cpu



@dataclass
class TableStats:
    """One table's writes and size (pg_stat_user_tables, pg_relation_size)."""

    num_updates: int
    num_hot_updates: int  # updates that wrote no index entry: the new version in the same page
    heap_bytes: int
    index_bytes: int
    mean_row_bytes: float

    @property
    def hot_share(self) -> float | None:
        return self.num_hot_updates / self.num_updates if self.num_updates else None


def table_stats(database_url: str, table: str) -> TableStats:
    """``table``'s update counts and size in the database of ``database_url``."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd, pg_relation_size(relid), "
            "pg_indexes_size(relid) FROM pg_stat_user_tables WHERE relname = %s",
            (table,)).fetchone()
        width = conn.execute(
            f'SELECT coalesce(avg(pg_column_size(t.*)), 0) FROM "{table}" t').fetchone()
    if row is None or width is None:
        raise RuntimeError(f"pg_stat_user_tables has no row for {table}")
    return TableStats(int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(width[0]))
