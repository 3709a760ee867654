"""The coordinator's state: hosts, workers, operations, idempotency keys, snapshots, fences, and
which coordinator leads (coordinator/leadership.py).

Two databases hold the same records through one schema and one ordered list of migrations:
SQLite (`sqlitestore.Store`, the embedded default: one coordinator on one host, `make demo`) and PostgreSQL
(`pgstore.PostgresStore`: several coordinators, one leading, on a database that outlives any of
their hosts); coordinator/database.py picks one by the URL given to --db.  Everything here is
written once, in the SQL both understand (`?` placeholders, ON CONFLICT upserts, RETURNING); a
backend supplies only its connection, transactions, error mapping, and where it keeps its schema
version.

One connection, serialised by a lock.  Every operation phase is written here *before* it starts,
which is what lets a restarted coordinator (or a standby that takes over) reconcile
(operations.Operations.reconcile).

Liveness is kept in memory and written in batches (coordinator/liveness.py): a beat touches
memory, `flush()` writes every changed last_seen in one transaction about once a second.  Full
reports (workers, inventory) still go to the database at once: the planner needs them.

A database that cannot be written (a full or failing file system, a PostgreSQL server that is
down or out of reach) is reported as StoreUnavailable, a value with what to do (503 in the API),
never as the driver's own exception: the driver tells it from an agent's failure and undoes what
it can no longer record (evacuation_run.OpRun.rollback), and an operator is told what to fix.

Where coordinators share the database, every write of the leader is fenced by its term: the
transaction first reads the lease's term, and a coordinator whose term is no longer the one there
(a standby took over while it was cut off or stalled) writes nothing (NotLeader).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pitstop.coordinator.liveness import Liveness
from pitstop.coordinator.schema import MIGRATIONS, SCHEMA
from pitstop.errors import FailedPrecondition, PitstopError, Unavailable
from pitstop.wire.snapshot_record import SnapshotRecord, SnapshotState, StoredSnapshot
from pitstop.wire.store_rows import StoredFence, StoredHost, StoredOp, StoredWorker

REPORT_NOT_KEPT = ("name", "url", "spare", "role", "offers_spare", "cordoned", "role_since", "role_why", "last_seen",
                   "age_s", "workers", "generation")
"""Keys of a stored report that are the hosts table's own columns (or not the report's): never
taken from it."""

LIVE = ("running", "paused", "capturing", "stopped")  # "released": the process is gone
CLAIMED = "claimed"  # a rank an agent is about to register (Store.claim_worker), until its report says more

Row = Mapping[str, Any]


@dataclass(frozen=True)
class JobOwner:
    """The user a job's ranks belong to (the uid that registered them; root's are anyone's)."""

    uid: int


class StoreUnavailable(Unavailable):
    """The coordinator's database cannot be written (or read) now: a full or failing file system,
    a database server that is down or out of reach."""

    code = "database_unavailable"


class NotLeader(StoreUnavailable):
    """This coordinator does not lead (any more): it writes nothing and calls no agent.  A kind of
    StoreUnavailable, so that every path that already copes with a database that refuses a write
    (the driver's rollback kept in memory, a recovery run again later) copes with this too; the
    coordinator that leads now reconciles what this one left."""

    code = "not_leader"


def _is_left_behind(reported: dict[str, Any], host: str, left_behind: str | None) -> bool:
    """Whether `host` reports the very copy of a worker that it left when the worker moved away
    (same process, by pid and start time): old news, however late it arrives."""
    if not left_behind:
        return False
    left = json.loads(left_behind)
    return left.get("host") == host and (reported.get("root_pid"), reported.get("start_time")) == \
        (left.get("pid"), left.get("start_time"))


class BaseStore:
    """The records, over a backend's connection (sqlitestore.Store: SQLite; pgstore.PostgresStore).

    A backend implements `_execute`, `_executemany`, `_begin`, `_commit`, `_rollback`,
    `_translate` (its errors as StoreUnavailable, or None for a mistake in the SQL), `columns`,
    `_schema_version`/`_set_schema_version`, `_migration_lock` and `_now_sql`."""

    GREATEST = "max"  # the larger of two values: SQLite's two-argument max(); PostgreSQL's GREATEST
    where = "the coordinator's database"  # what an operator is told to look at

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live = Liveness()  # the beats, between the batches that write them (flush)
        # The leader's term, checked by every write (None: unfenced, one coordinator alone as in the
        # tests' own stores; set by coordinator/leadership.py once several may share the database)
        self.fence_term: int | None = None
        self.fenced = False  # True: writes need fence_term to be the lease's term (a standby: never)

    # -- what a backend supplies ------------------------------------------------------------------
    def _execute(self, sql: str, args: tuple = ()) -> list[Row]:
        raise NotImplementedError

    def _executemany(self, sql: str, rows: list[tuple]) -> None:
        raise NotImplementedError

    def _begin(self) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        raise NotImplementedError

    def _rollback(self) -> None:
        raise NotImplementedError

    def _translate(self, e: Exception) -> StoreUnavailable | None:
        raise NotImplementedError

    def columns(self, table: str) -> set[str]:
        raise NotImplementedError

    def _schema_version(self) -> int:
        raise NotImplementedError

    def _set_schema_version(self, version: int) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        yield

    def _now_sql(self) -> tuple[str, tuple]:
        """SQL for the database's clock (unix seconds) and its arguments: the lease is timed by one
        clock, whichever coordinator reads it."""
        return "?", (time.time(),)

    def close(self) -> None:
        raise NotImplementedError

    # -- the plumbing every record uses -----------------------------------------------------------
    def q(self, sql: str, args: tuple = ()) -> list[Row]:
        """One statement inside the transaction (or migration) under way: the caller holds the lock."""
        return self._execute(sql, args)

    def _open(self) -> None:
        """Schema and migrations; then the hosts' generations (a restarted coordinator still holds
        every host's last full report, so it takes their beats at once instead of asking 10,000
        agents for full reports in the same second)."""
        with self.lock, self._migration_lock():
            for stmt in filter(str.strip, SCHEMA.split(";")):
                self._execute(stmt)
            self.migrate()
        self.load_generations()

    def load_generations(self) -> None:
        rows = self._x("SELECT name, generation FROM hosts WHERE generation IS NOT NULL")
        self.live.load({r["name"]: r["generation"] for r in rows})

    def excuse_silence(self, gap_s: float) -> None:
        """No coordinator listened to the hosts for `gap_s` (a change of leader, a restart): that
        time is not counted against them.  Each host is taken as heard `gap_s` later than it last
        was (never later than now), in memory only: its record keeps what was heard."""
        if gap_s <= 0:
            return
        self.live.excuse({r["name"]: float(r["last_seen"]) for r in self._x("SELECT name, last_seen FROM hosts")}, gap_s)

    def migrate(self) -> int:
        """Bring a database written by any earlier release to this one's schema; the version reached.
        A database from a newer release is refused rather than written in a shape it does not know."""
        have = self._schema_version()
        if have > len(MIGRATIONS):
            raise FailedPrecondition(f"the coordinator's database is at schema version {have}, newer than this "
                                     f"pitstop ({len(MIGRATIONS)})", code="database_too_new",
                                     action="run the pitstop release that wrote it, or a newer one")
        for version, step in enumerate(MIGRATIONS[have:], start=have + 1):
            self._begin()
            try:
                step(self)
                self._set_schema_version(version)
                self._commit()
            except BaseException:
                with contextlib.suppress(Exception):
                    self._rollback()
                raise
        return len(MIGRATIONS)

    def _x(self, sql: str, args: tuple = ()) -> list[Row]:
        """One statement on its own: a read, or a write in a transaction of its own (fenced)."""
        if self.fenced and not sql.lstrip().upper().startswith("SELECT"):
            with self._tx():
                return self._execute(sql, args)
        with self.lock, self._guard():
            return self._execute(sql, args)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """The backend's errors of the database (not of pitstop's SQL) as StoreUnavailable, saying
        what to fix."""
        try:
            yield
        except PitstopError:
            raise
        except Exception as e:
            err = self._translate(e)
            if err is None:
                raise
            raise err from e

    @contextlib.contextmanager
    def _tx(self, fence: bool = True) -> Iterator[None]:
        """One transaction, under the lock; rolled back if anything in it fails.  Fenced (unless
        `fence` is False: the lease's own statements): its first statement checks that this
        coordinator still holds the lease's term (`_check_term`)."""
        with self.lock, self._guard():
            self._begin()
            try:
                if fence and self.fenced:
                    self._check_term()
                yield
                self._commit()
            except BaseException:
                self._rollback()
                raise

    def _check_term(self) -> None:
        """Inside a transaction: the lease's term is this coordinator's, and stays so until the
        transaction ends (the row is locked where the database can: FOR SHARE on PostgreSQL; SQLite
        serialises writers anyway).  NotLeader otherwise: nothing is written."""
        if self.fence_term is None:
            raise NotLeader("this coordinator is a standby: it writes nothing", code="not_leader",
                            action="send the request to the coordinator that leads (`pitstop doctor` names it)")
        r = self._execute("SELECT term FROM leadership WHERE id=1" + self._share_lock())
        if not r or int(r[0]["term"]) != self.fence_term:
            raise NotLeader(f"this coordinator's term {self.fence_term} is over (the database's is "
                            f"{r[0]['term'] if r else 'unknown'}): another coordinator leads", code="not_leader",
                            action="nothing: the coordinator that leads now finishes or undoes what this one began")

    def _share_lock(self) -> str:
        return ""

    # -- the lease (coordinator/leadership.py) ----------------------------------------------------
    def lease(self) -> dict[str, Any]:
        """The lease as the database has it, with the database's clock now (`now`)."""
        now, args = self._now_sql()
        r = self._x(f"SELECT term, holder, url, since, expires, renewed, {now} AS now FROM leadership WHERE id=1",
                    args)
        if not r:
            return {"term": 0, "holder": None, "url": None, "since": None, "expires": 0.0, "renewed": None,
                    "now": time.time()}
        return {k: r[0][k] for k in ("term", "holder", "url", "since", "expires", "renewed", "now")}

    def acquire_lease(self, holder: str, url: str, ttl_s: float) -> dict[str, Any] | None:
        """Take the lease with the next term, where it has expired (in the database's clock) or was
        this coordinator's own (`holder`: a restarted coordinator at the same address, whose last
        life ended); the lease taken (term, since, expires), or None where another holds it."""
        now, args = self._now_sql()
        with self._tx(fence=False):
            r = self._execute(
                f"UPDATE leadership SET term=term+1, holder=?, url=?, since={now}, renewed={now}, "
                f"expires={now}+? WHERE id=1 AND (expires < {now} OR holder=?) "
                "RETURNING term, since, expires", (holder, url, *args, *args, *args, ttl_s, *args, holder))
        return {k: r[0][k] for k in ("term", "since", "expires")} if r else None

    def renew_lease(self, holder: str, term: int, ttl_s: float) -> float | None:
        """Extend the lease of `term`, still this coordinator's; its new expiry (database clock), or
        None where the term is over (another coordinator took the lease)."""
        now, args = self._now_sql()
        with self._tx(fence=False):
            r = self._execute(f"UPDATE leadership SET expires={now}+?, renewed={now} WHERE id=1 AND term=? "
                              "AND holder=? RETURNING expires", (*args, ttl_s, *args, term, holder))
        return float(r[0]["expires"]) if r else None

    def release_lease(self, holder: str, term: int) -> bool:
        """Give the lease up at once (a coordinator that stops): a standby takes over without waiting
        for it to expire.  The term stays: the next holder's is higher."""
        with self._tx(fence=False):
            r = self._execute("UPDATE leadership SET expires=0 WHERE id=1 AND term=? AND holder=? RETURNING term",
                              (term, holder))
        return bool(r)

    def raise_term(self, holder: str, term: int, above: int) -> int | None:
        """Move this coordinator's own lease to a term above `above` (an agent has seen a higher term
        than this database holds: the database was replaced or restored from a backup), keeping the
        lease; the new term, or None where the term is no longer this coordinator's."""
        with self._tx(fence=False):
            r = self._execute("UPDATE leadership SET term=? WHERE id=1 AND term=? AND holder=? RETURNING term",
                              (above + 1, term, holder))
        return int(r[0]["term"]) if r else None

    def _one(self, sql: str, args: tuple = ()) -> Row | None:
        rows = self.q(sql, args)
        return rows[0] if rows else None

    # hosts and workers --------------------------------------------------------------------------
    def sync_workers(self, host: str, workers: list[dict[str, Any]]) -> None:
        """What the host's agent says it runs right now (fresher than its last heartbeat)."""
        h = self.host(host)
        if h is not None:
            self.heartbeat({**h.report(), "workers": workers}, touch=False)

    def claim_worker(self, host: str, wid: str, job: str, rank: int, max_age_s: float,
                     owner_uid: int | None = None, privileged: bool = False) -> "str | JobOwner | None":
        """A rank about to register on `host`: recorded there at once, unless another host whose
        agent was heard from within `max_age_s` already runs it (that host's name is returned), or
        the job's ranks belong to another user than `owner_uid` (the job's owner is returned;
        privileged: root, who may add to any job).  A job belongs to the user of its ranks that
        have not ended (a failed one's too, until it is recovered or dropped).  One transaction, so
        that two hosts claiming the same rank at once cannot both win, nor two users one job."""
        now = time.time()
        with self._tx():
            if not privileged:
                for r in self.q("SELECT state, info, updated FROM workers WHERE job=? AND state NOT IN (?, ?)",
                                         (job, "exited", "released")):
                    if r["state"] == CLAIMED and now - r["updated"] > max_age_s:
                        continue  # a claim whose registration never happened lapses
                    theirs = json.loads(r["info"]).get("owner_uid")
                    if theirs is not None and theirs != owner_uid:
                        return JobOwner(int(theirs))
            cur = self._one("SELECT host, state, updated FROM workers WHERE id=?", (wid,))
            if cur and cur["host"] != host:
                seen = self._one("SELECT last_seen FROM hosts WHERE name=?", (cur["host"],))
                last = self.live.last_seen(cur["host"], seen["last_seen"] if seen else 0.0)
                # a claim that its host's reports never confirmed (the registration failed there)
                # lapses after the same time as a silent host
                held = cur["state"] in LIVE or (cur["state"] == CLAIMED and now - cur["updated"] <= max_age_s)
                if held and now - last <= max_age_s:
                    return str(cur["host"])
            w = {"id": wid, "job": job, "rank": rank, "state": CLAIMED, "owner_uid": owner_uid}
            self.q(
                "INSERT INTO workers(id,job,rank,host,state,info,updated) VALUES(?,?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET job=excluded.job, rank=excluded.rank, host=excluded.host, "
                "state=excluded.state, info=excluded.info, updated=excluded.updated",
                (wid, job, rank, host, CLAIMED, json.dumps(w), now))
        return None

    def beat(self, name: str, generation: str) -> bool:
        """A beat (coordinator/liveness.py); False: ask the agent for a full report."""
        return self.live.beat(name, generation)

    def set_health(self, name: str, gpu_health: list, verdict: dict) -> None:
        self.live.set_health(name, gpu_health, verdict)

    def flush(self) -> int:
        """Write the beats and health readings gathered since the last flush, in one transaction."""
        rows = self.live.take()
        if not rows:
            return 0
        try:
            with self._tx():
                for name, _, health in rows:
                    if health is not None:
                        r = self._one("SELECT info FROM hosts WHERE name=?", (name,))
                        if r is not None:
                            info = json.loads(r["info"])
                            info["gpu_health"], info["health"] = health
                            self.q("UPDATE hosts SET info=? WHERE name=?", (json.dumps(info), name))
                self._executemany(f"UPDATE hosts SET last_seen={self.GREATEST}(last_seen, ?) WHERE name=?",
                                    [(seen, name) for name, seen, _ in rows if seen is not None])
        except BaseException:
            self.live.put_back(rows)  # written next time
            raise
        return len(rows)

    def heartbeat(self, hb: dict[str, Any], touch: bool = True) -> None:
        """A full report: the host's identity, inventory, health and every worker."""
        now = time.time()
        name = hb["name"]
        info = {k: v for k, v in hb.items() if k not in ("workers", "generation")}
        with self._tx():
            row = self._one("SELECT role FROM hosts WHERE name=?", (name,))
            # The coordinator owns a host's role once it has one (a consumed spare becomes active).
            role = row["role"] if row else ("spare" if hb.get("spare") else "active")
            if touch:
                self.q("INSERT INTO hosts(name,url,role,info,last_seen,generation,role_since) "
                                "VALUES(?,?,?,?,?,?,?) "
                                "ON CONFLICT(name) DO UPDATE SET url=excluded.url, info=excluded.info, "
                                "last_seen=excluded.last_seen, generation=excluded.generation",
                                (name, hb["url"], role, json.dumps(info), now, hb.get("generation"), now))
            fenced = {r["job"] for r in self.q("SELECT job FROM fences WHERE host=?", (name,))}
            for w in hb.get("workers", []):
                if w["job"] in fenced:  # recovered elsewhere while this host was away: never again from here
                    continue
                # Where a worker is: the host that reports it alive.  Its old host's "moved"
                # is no news, and an end state (exited, lost) counts only from its current host.
                cur = self._one("SELECT host, left_behind FROM workers WHERE id=?", (w["id"],))
                if w["state"] not in LIVE and (w["state"] == "moved" or (cur and cur["host"] != name)):
                    continue
                if cur and cur["host"] != name and _is_left_behind(w, name, cur["left_behind"]):
                    continue  # a report written before the move committed, read after: the copy it left
                if cur and cur["host"] != name and w.get("restored"):
                    # A copy restored here by a move or a recovery runs here once that operation
                    # records it (its commit, or the recovery's resume), never by a report: the
                    # spare's report of a copy that a rollback then discarded, read after the
                    # rollback, took the rank from the host that ran it again, for good (that
                    # host's next reports were only beats, and its rank's end no news).
                    continue
                self.q(
                    "INSERT INTO workers(id,job,rank,host,state,info,updated) VALUES(?,?,?,?,?,?,?) "
                    "ON CONFLICT(id) DO UPDATE SET host=excluded.host, state=excluded.state, "
                    "info=excluded.info, updated=excluded.updated",
                    (w["id"], w["job"], w["rank"], name, w["state"], json.dumps(w), now))
        if touch:
            self.live.reported(name, now, hb.get("generation"))

    def hosts(self) -> list[StoredHost]:
        return [self._host(r) for r in self._x("SELECT * FROM hosts ORDER BY name")]

    def host(self, name: str) -> StoredHost | None:
        r = self._x("SELECT * FROM hosts WHERE name=?", (name,))
        return self._host(r[0]) if r else None

    def _host(self, r: Row) -> StoredHost:
        info = json.loads(r["info"])
        name = r["name"]
        last_seen = self.live.last_seen(name, r["last_seen"])
        health = self.live.health(name)
        if health is not None:
            info["gpu_health"], info["health"] = health
        return StoredHost(name=name, url=r["url"], role=r["role"], offers_spare=bool(info.get("spare")),
                          cordoned=json.loads(r["cordon"]) if r["cordon"] else None, role_since=r["role_since"],
                          role_why=json.loads(r["role_why"]) if r["role_why"] else None, last_seen=last_seen,
                          age_s=round(time.time() - last_seen, 3),
                          **{k: v for k, v in info.items() if k not in REPORT_NOT_KEPT})

    def set_role(self, name: str, role: str, why: dict[str, Any] | None = None) -> None:
        """A host's new role, since now, and why (an evacuation's reason, its operation, who asked).
        The same role again changes neither (a new `why` replaces the old); `draining` becoming
        `drained` keeps both: the host left service when its evacuation committed."""
        with self._tx():
            r = self._one("SELECT role, role_since, role_why FROM hosts WHERE name=?", (name,))
            if r is None:
                return
            same = r["role"] == role or (r["role"], role) == ("draining", "drained")
            since = r["role_since"] if same else time.time()
            why_ = json.dumps(why) if why is not None else r["role_why"] if same else None
            self.q("UPDATE hosts SET role=?, role_since=?, role_why=? WHERE name=?", (role, since, why_, name))

    def set_cordon(self, name: str, cordon: dict[str, Any] | None) -> None:
        """Keep a host out of the spare pool (why, since, who asked), or None to let it back."""
        self._x("UPDATE hosts SET cordon=? WHERE name=?", (json.dumps(cordon) if cordon else None, name))

    def remove_host(self, name: str) -> None:
        """Forget a host and what it last reported (its agent, if it ever beats again, registers anew)."""
        with self._tx():
            self.q("DELETE FROM workers WHERE host=?", (name,))
            self.q("DELETE FROM hosts WHERE name=?", (name,))
        self.live.forget(name)

    def workers(self, host: str | None = None, job: str | None = None) -> list[StoredWorker]:
        q, a = "SELECT * FROM workers WHERE 1=1", []
        if host:
            q += " AND host=?"
            a.append(host)
        if job:
            q += " AND job=?"
            a.append(job)
        return [self._worker(r) for r in self._x(q + " ORDER BY job, rank", tuple(a))]

    @staticmethod
    def _worker(r: Row) -> StoredWorker:
        info = json.loads(r["info"])
        return StoredWorker(
            id=r["id"], job=r["job"], rank=r["rank"], host=r["host"], state=r["state"], updated=r["updated"],
            address=(info.get("net") or {}).get("address"), caps=info.get("caps"), unmovable=info.get("unmovable"),
            slurm_job=info.get("slurm_job"), snapshot_every_s=info.get("snapshot_every_s"), world=info.get("world"),
            exit_code=info.get("exit_code"), ended_at=info.get("ended_at"), end_asked=info.get("end_asked"),
            peer_lost=info.get("peer_lost"))

    def set_worker_host(self, wid: str, host: str, state: str = "running",
                        left: dict[str, Any] | None = None) -> None:
        """The worker runs on `host` now (a move committed, a recovery restored it).  left: the copy
        it left, {"host", "pid", "start_time"}, as the operation knows it: a report of that copy
        written before the commit and handled after it must not take the worker back (`jobs` then
        listed a moved rank on the host it had left until the new host's next beat, and an
        evacuation planned meanwhile would have missed it).  From the operation, not from the last
        report: the destination may have reported the restored copy before the commit."""
        if left is None:
            self._x("UPDATE workers SET host=?, state=?, updated=? WHERE id=?", (host, state, time.time(), wid))
        else:
            self._x("UPDATE workers SET host=?, state=?, updated=?, left_behind=? WHERE id=?",
                    (host, state, time.time(), json.dumps(left), wid))

    # snapshots, their policy, fences (coordinator/snapshots.py, recovery.py) -------------------
    def snapshot_policy(self, job: str) -> float | None:
        r = self._x("SELECT every_s FROM snapshot_policy WHERE job=?", (job,))
        return float(r[0]["every_s"]) if r else None

    def set_snapshot_policy(self, job: str, every_s: float | None) -> None:
        if every_s is None:
            self._x("DELETE FROM snapshot_policy WHERE job=?", (job,))
        else:
            self._x("INSERT INTO snapshot_policy(job, every_s, updated) VALUES(?,?,?) ON CONFLICT(job) DO UPDATE "
                    "SET every_s=excluded.every_s, updated=excluded.updated", (job, every_s, time.time()))

    def put_snapshot(self, job: str, number: int, state: SnapshotState, record: SnapshotRecord) -> None:
        self._x("INSERT INTO snapshots(job, number, state, created, info) VALUES(?,?,?,?,?) ON CONFLICT(job, number) "
                "DO UPDATE SET state=excluded.state, info=excluded.info",
                (job, number, state, time.time(), json.dumps(record.dump())))

    def update_snapshot(self, job: str, number: int, state: SnapshotState, record: SnapshotRecord) -> bool:
        """A snapshot's record, where it still exists: False where it was dropped meanwhile (a failed
        recovery, or the job's end, dropped the job's snapshots), which nothing may write back."""
        return bool(self._x("UPDATE snapshots SET state=?, info=? WHERE job=? AND number=? RETURNING number",
                            (state, json.dumps(record.dump()), job, number)))

    def snapshots(self, job: str) -> list[StoredSnapshot]:
        return [StoredSnapshot(job=r["job"], number=r["number"], state=r["state"], created=r["created"],
                               record=SnapshotRecord.load(json.loads(r["info"])))
                for r in self._x("SELECT * FROM snapshots WHERE job=? ORDER BY number", (job,))]

    def snapshot_jobs(self) -> list[str]:
        return [r["job"] for r in self._x("SELECT DISTINCT job FROM snapshots")]

    def forget_snapshots(self, job: str, keep: int | None) -> None:
        """Every record of the job's snapshots but `keep` (the committed one that counts)."""
        self._x("DELETE FROM snapshots WHERE job=? AND number != ?", (job, -1 if keep is None else keep))

    def fence(self, job: str, host: str, epoch: int) -> None:
        self._x("INSERT INTO fences(job, host, epoch, acked, created) VALUES(?,?,?,0,?) ON CONFLICT(job, host) DO UPDATE "
                "SET epoch=excluded.epoch, acked=0", (job, host, epoch, time.time()))

    def fences(self, host: str | None = None, unacked: bool = False) -> list[StoredFence]:
        q, a = "SELECT * FROM fences WHERE 1=1", []
        if host:
            q += " AND host=?"
            a.append(host)
        if unacked:
            q += " AND acked=0"
        return [StoredFence(job=r["job"], host=r["host"], epoch=r["epoch"], acked=bool(r["acked"]), created=r["created"])
                for r in self._x(q, tuple(a))]

    def clear_fence(self, job: str, host: str) -> None:
        """The job's ranks may run on that host again (a recovery restores them there)."""
        self._x("DELETE FROM fences WHERE job=? AND host=?", (job, host))

    def ack_fence(self, job: str, host: str) -> None:
        self._x("UPDATE fences SET acked=1 WHERE job=? AND host=?", (job, host))

    # operations ---------------------------------------------------------------------------------
    def create_op(self, op_id: str, node: str, dest: str | None, metadata: dict, idem: tuple[str, str] | None
                  ) -> None:
        now = time.time()
        with self._tx():
            self.q("INSERT INTO operations(id,node,dest,phase,metadata,created,updated) "
                            "VALUES(?,?,?,?,?,?,?)", (op_id, node, dest, "pending", json.dumps(metadata), now, now))
            if idem:
                self.q("INSERT INTO idempotency(key,body_hash,op_id,created) VALUES(?,?,?,?)",
                                (idem[0], idem[1], op_id, now))

    def idempotent(self, key: str) -> tuple[str, str] | None:
        r = self._x("SELECT body_hash, op_id FROM idempotency WHERE key=?", (key,))
        return (r[0]["body_hash"], r[0]["op_id"]) if r else None

    def op(self, op_id: str) -> StoredOp | None:
        r = self._x("SELECT * FROM operations WHERE id=?", (op_id,))
        return self._op(r[0]) if r else None

    def ops(self, running_only: bool = False, *, node: str | None = None, done: bool | None = None,
            before: float | None = None, limit: int | None = None) -> list[StoredOp]:
        """Operations, oldest first; or, with `limit`, the newest `limit` created before `before`
        (a page: the next one is asked with `before` = the oldest `created` of this one)."""
        q, a = "SELECT * FROM operations WHERE 1=1", list[Any]()
        if running_only or done is False:
            q += " AND done=0"
        elif done:
            q += " AND done=1"
        if node:
            q += " AND (node=? OR dest=?)"
            a += [node, node]
        if before is not None:
            q += " AND created<?"
            a.append(before)
        if limit is None:
            return [self._op(r) for r in self._x(q + " ORDER BY created", tuple(a))]
        rows = self._x(q + " ORDER BY created DESC LIMIT ?", (*a, limit))
        return [self._op(r) for r in reversed(rows)]

    def prune_ops(self, older_than_s: float) -> int:
        """Forget finished operations (and their idempotency keys) older than `older_than_s`."""
        cut = time.time() - older_than_s
        with self._tx():
            old = [r["id"] for r in self.q("SELECT id FROM operations WHERE done=1 AND updated<?", (cut,))]
            for op_id in old:
                self.q("DELETE FROM idempotency WHERE op_id=?", (op_id,))
                self.q("DELETE FROM operations WHERE id=?", (op_id,))
        return len(old)

    @staticmethod
    def _op(r: Row) -> StoredOp:
        return StoredOp(id=r["id"], node=r["node"], dest=r["dest"], done=bool(r["done"]), result=r["result"],
                        phase=r["phase"], cancel_requested=bool(r["cancel_requested"]),
                        metadata=json.loads(r["metadata"]), error=json.loads(r["error"]) if r["error"] else None,
                        response=json.loads(r["response"]) if r["response"] else None,
                        created=r["created"], updated=r["updated"])

    def update_op(self, op_id: str, *, phase: str | None = None, metadata: dict | None = None,
                  done: bool | None = None, result: str | None = None, error: dict | None = None,
                  response: dict | None = None, dest: str | None = None) -> None:
        sets: list[str] = ["updated=?"]
        args: list[Any] = [time.time()]
        for col, val in (("phase", phase), ("result", result), ("dest", dest)):
            if val is not None:
                sets.append(f"{col}=?")
                args.append(val)
        for col, doc in (("metadata", metadata), ("error", error), ("response", response)):
            if doc is not None:
                sets.append(f"{col}=?")
                args.append(json.dumps(doc))
        if done is not None:
            sets.append("done=?")
            args.append(int(done))
        self._x(f"UPDATE operations SET {', '.join(sets)} WHERE id=?", (*args, op_id))

    def request_cancel(self, op_id: str) -> None:
        self._x("UPDATE operations SET cancel_requested=1, updated=? WHERE id=?", (time.time(), op_id))
