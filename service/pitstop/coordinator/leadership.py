"""One coordinator leads; the others stand by.  Leadership is a lease in the database (the
`leadership` row, coordinator/store.py) with a term that only grows.

Why a lease row and not an advisory lock: the lock lives as long as a connection, and a leader cut
off from the database keeps believing it holds the lock until its TCP connection is declared dead
(minutes), while the server has already let another coordinator take it.  A lease has an expiry
both sides can reason about: the database times it by its own clock, and the leader stops acting
before that expiry by its own, counting from *before* it sent its last renewal.  It also works the
same on SQLite (one coordinator on one host, whose term then grows at every restart).

The deadline (PITSTOP_COORDINATOR_LEASE_S, 3 s by default; renewed every third of it):
- long enough that two renewals in a row may be lost or slow (a PostgreSQL checkpoint, a loaded
  2-core host, a database that restarts in a second) without a needless change of leader: a
  change costs every operation in flight its rollback;
- short enough that a standby takes over (lease expired + its next look, every 0.5 s) before the
  agents' own deadlines fire: an agent that hears from no leader for PITSTOP_AGENT_SELF_FENCE_S
  (6 s) isolates its ranks of jobs with snapshots, and hosts are declared failed after
  PITSTOP_COORDINATOR_FAILURE_DEADLINE_S (10 s).  A failover of about 3-4 s pauses nothing.

The leader that cannot renew in time (cut off from the database, stalled) stops acting at its own
deadline: every write is refused (the store's term check), every call to an agent too (this
object is the AgentClient's fence), and the process starts again as a standby (server.py), so that
no thread of its old term lives on.  A leader that is stalled past its deadline and wakes up before
noticing is stopped by the others: its writes carry a term the database no longer holds, and its
calls a term lower than the one the agents have seen since (the new leader announces its term to
every agent before it acts).

On SQLite (`exclusive`) the database is one host's, and the coordinator on it alone by
configuration: it takes the lease with the next term at every start (the agents then refuse its
previous life's calls) and keeps renewing it, but a renewal the database refuses (a full disk) does
not end its lead: it goes on undoing on the agents what it can no longer record, as it always did.
Only a lease taken by another coordinator (a second one pointed at the same file) ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from pitstop.coordinator.store import BaseStore, NotLeader, StoreUnavailable
from pitstop.coordinator.timeouts import DEADLINE_LOOK_S, LEASE_THREAD_JOIN_S, STANDBY_LOOK_S

log = structlog.get_logger("pitstop.coordinator.leadership")



class Leadership:
    """This coordinator's side of the lease: whether it leads, in which term, until when."""

    def __init__(self, records: BaseStore, store: BaseStore, me: str, ttl_s: float,
                 on_lead: Callable[[int, float], None], on_lose: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, exclusive: bool = False) -> None:
        """records: the store every other part of the coordinator writes through, fenced by this
        lease's term from here on; store: one of its own for the lease (its own connection: a slow
        request elsewhere must not hold the renewals back); me: this coordinator's URL, its
        identity in the lease; on_lead(term, seconds no coordinator led): called once, on a thread of
        its own, when a standby takes the lease (`try_acquire` at the start is the caller's to act
        on); on_lose(why): called once, when it stops leading; exclusive: a database no other
        coordinator shares (SQLite; see above)."""
        self.records = records
        records.fenced = True  # from here on, a write without this coordinator's term is refused
        self.store = store
        self.me = me
        self.ttl_s = ttl_s
        self.renew_every_s = ttl_s / 3
        self.margin_s = max(0.1, 0.05 * ttl_s)  # clocks run at slightly different rates
        self._on_lead, self._on_lose = on_lead, on_lose
        self.clock = clock
        self.exclusive = exclusive
        self.term: int | None = None
        self.since: float | None = None  # when this coordinator took the lease (database clock, unix time)
        self.valid_until = 0.0  # clock(): past it this coordinator does not act, renewed or not
        self.gap_s = 0.0  # how long no coordinator led before this one took the lease
        self.lost: str | None = None  # why it stopped leading (it never leads again in this process)
        self.seen: dict[str, Any] = {}  # the lease as last read: who leads, term, since (for standbys)
        self.term_changes = 0  # new terms this coordinator has seen (its own included)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- what the rest of the coordinator asks -----------------------------------------------------
    def leading(self) -> bool:
        return self.term is not None and self.lost is None and self.clock() < self.valid_until

    def stopping(self) -> bool:
        """Told to stop (stop() ran): the lease is given up, or about to be."""
        return self._stop.is_set()

    def current(self) -> int:
        """The term to send with a call to an agent; NotLeader where this coordinator may not act."""
        term = self.term
        if term is None or not self.leading():
            raise NotLeader("this coordinator does not lead: it calls no agent", code="not_leader",
                            action="nothing: the coordinator that leads finishes or undoes what this one began")
        return term

    def stale(self, seen: int) -> None:
        """An agent refused a call of this term: it has seen `seen`.  Either another coordinator
        took over (this one stops now), or the database was replaced by one holding a lower term
        (the lease moves above `seen`: `raise_above`)."""
        threading.Thread(target=self.raise_above, args=(seen,), name="stale-term", daemon=True).start()

    def raise_above(self, seen: int) -> None:
        """An agent has seen term `seen`, newer than this coordinator's: move the lease above it where
        it is still ours (the database lost its history), else stop leading."""
        with self._lock:
            term = self.term
            if term is None or self.lost or seen <= term:
                return  # nothing newer than this coordinator's own term
            try:
                got = self.store.raise_term(self.me, term, above=seen)
            except StoreUnavailable as e:
                log.warning("could not raise the term above one an agent has seen", error=e.message)
                return
            if got is None:
                self._lose_locked(f"an agent has seen term {seen}, and the lease is no longer this coordinator's")
                return
            log.warning("an agent had seen a higher term than the database holds (a new or restored "
                        "database): the lease moves above it", old=term, new=got, seen=seen)
            self.term = got
            self.records.fence_term = got
            self.term_changes += 1

    def view(self) -> dict[str, Any]:
        """Who leads and since when, as this coordinator knows it (`GET /v1/leader`)."""
        s = self.seen
        lead = self.leading()
        return {"leader": self.me if lead else s.get("url"), "term": self.term if lead else s.get("term"),
                "since": self.since if lead else s.get("since"), "this": self.me,
                "role": "leader" if lead else "standby" if self.lost is None else "stepping down",
                "lease_s": self.ttl_s, "term_changes": self.term_changes,
                **({"lost": self.lost} if self.lost else {})}

    # -- the loops -----------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._run, "leadership"), (self._deadline, "leadership-deadline")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, release: bool = True) -> None:
        """A coordinator that stops: the loops end, and the lease is given up at once (a standby
        takes over without waiting for it to expire)."""
        self._stop.set()
        term = self.term
        if release and term is not None and self.lost is None:
            self.lost = "this coordinator stopped"
            self.records.fence_term = None  # nothing more is written in its term
            try:
                self.store.release_lease(self.me, term)
            except StoreUnavailable:
                pass  # it expires by itself
        for t in self._threads:
            t.join(LEASE_THREAD_JOIN_S)

    def try_acquire(self) -> bool:
        """One attempt at the lease (a standby's look); True where this coordinator leads now."""
        if self.lost is not None:
            return False
        before = self.store.lease()
        self._saw(before)
        t0 = self.clock()
        got = self.store.acquire_lease(self.me, self.me, self.ttl_s)
        if got is None:
            return False
        with self._lock:
            self.term = int(got["term"])
            self.since = float(got["since"])
            self.valid_until = float("inf") if self.exclusive else t0 + self.ttl_s - self.margin_s
            self.records.fence_term = self.term
            self.term_changes += 1
            self.seen = {"term": self.term, "url": self.me, "since": self.since}
        # since the previous leader's last renewal, no coordinator heard any host
        previous = before.get("renewed") if before.get("term") else None
        self.gap_s = max(0.0, self.since - float(previous)) if previous is not None else 0.0
        log.info("this coordinator leads", term=self.term, previous=before.get("url"),
                 previous_term=before.get("term"), leaderless_s=round(self.gap_s, 3))
        return True

    def _saw(self, lease: dict[str, Any]) -> None:
        term = lease.get("term")
        if term and term != self.seen.get("term"):
            self.term_changes += 1 if self.seen else 0
        self.seen = {"term": term, "url": lease.get("url"), "since": lease.get("since"),
                     "expires_in_s": round(float(lease["expires"]) - float(lease["now"]), 3)
                     if lease.get("expires") is not None and lease.get("now") is not None else None}

    def _run(self) -> None:
        while not self._stop.is_set() and self.lost is None:
            if self.term is None:
                try:
                    if self.try_acquire():
                        threading.Thread(target=self._on_lead, args=(self.term, self.gap_s), name="take-over",
                                         daemon=True).start()
                        continue
                except StoreUnavailable as e:
                    log.debug("could not read the lease", error=e.message)
                except Exception as e:  # noqa: BLE001 - a standby keeps looking
                    log.warning("taking the lease failed; will look again", error=repr(e)[:200])
                self._stop.wait(STANDBY_LOOK_S)
                continue
            self._renew()
            self._stop.wait(self.renew_every_s)

    def _renew(self) -> None:
        term = self.term
        assert term is not None
        t0 = self.clock()
        try:
            expires = self.store.renew_lease(self.me, term, self.ttl_s)
        except StoreUnavailable as e:
            if self.exclusive:
                log.debug("could not renew the lease (a database of this coordinator's alone: it leads on)",
                          error=e.message)
            else:
                log.warning("could not renew the lease; this coordinator stops acting at its deadline unless a "
                            "renewal passes", error=e.message, left_s=round(self.valid_until - self.clock(), 2))
            return
        except Exception as e:  # noqa: BLE001 - counted as a missed renewal
            log.warning("renewing the lease failed", error=repr(e)[:200])
            return
        with self._lock:
            if expires is None:
                self._lose_locked(f"another coordinator took the lease (term {term} is over)")
            elif self.lost is None and self.term == term:
                self.valid_until = max(self.valid_until, t0 + self.ttl_s - self.margin_s)

    def _deadline(self) -> None:
        """Independent of the renewals, which may hang on a link that went silent: the moment the
        deadline passes, this coordinator stops."""
        while not self._stop.wait(DEADLINE_LOOK_S):
            if self.term is not None and self.lost is None and self.clock() >= self.valid_until:
                with self._lock:
                    if self.lost is None and self.clock() >= self.valid_until:
                        self._lose_locked(f"the lease of term {self.term} was not renewed within {self.ttl_s:g} s "
                                          "(the database out of reach, or this process stalled)")
            if self.lost is not None:
                return

    def _lose_locked(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        self.records.fence_term = None
        log.error("this coordinator no longer leads; it stops acting at once", why=why, term=self.term)
        threading.Thread(target=self._on_lose, args=(why,), name="step-down", daemon=True).start()
