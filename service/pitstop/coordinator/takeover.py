"""What a coordinator does when it takes the lease (coordinator/leadership.py): at its own start, or
as a standby whose leader was lost.  The same path in both cases, and the same reconcile a
restarted coordinator has always run (operations.Operations.reconcile, snapshots.reconcile): every
evacuation past its commit point is finished, every other rolled back, every recovery run again
from its start, a snapshot left under way undone.

Before any of that, two things a single restarted coordinator never needed:
- the agents the operations in flight touch are told the new term first (POST
  /v1/coordinator:term), so that from then on they refuse the old leader's calls, should it still
  be alive somewhere and wake up; every other agent learns it from its next heartbeat's answer;
- the time no coordinator led (from the old leader's last renewal to now) is not counted against
  any host: nobody was listening to their beats, and a host must not be declared failed, nor its
  jobs recovered, because the coordinator changed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

import structlog

from pitstop.coordinator.fanout import in_parallel
from pitstop.coordinator.timeouts import ANNOUNCE_TIMEOUT_S
from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient

if TYPE_CHECKING:
    from pitstop.coordinator.driver import Driver
    from pitstop.coordinator.leadership import Leadership
    from pitstop.coordinator.operations import Operations
    from pitstop.coordinator.settings import CoordinatorSettings
    from pitstop.coordinator.snapshots import Snapshots
    from pitstop.coordinator.store import BaseStore
    from pitstop.wire.agent_client import Fence

log = structlog.get_logger("pitstop.coordinator.takeover")



class Leader(Protocol):
    """What a takeover works with: the coordinator that took the lease (coordinator/service.py),
    named here by what it has rather than imported (the service calls this module)."""

    settings: "CoordinatorSettings"
    store: "BaseStore"
    lead: "Leadership | None"
    fence: "Fence | None"
    driver: "Driver"
    snapshots: "Snapshots"
    operations: "Operations"


def take_over(c: Leader, term: int, gap_s: float) -> list[str]:
    """The operations resumed (their ids)."""
    c.store.load_generations()  # the reports the last leader took: beats are taken at once
    c.store.excuse_silence(gap_s)
    told, untold = announce(c, term)
    log.info("took the lease; resuming the operations in flight", term=term, leaderless_s=round(gap_s, 3),
             agents_told=told, agents_not_answering=untold)
    me = c.lead.me if c.lead is not None else "this coordinator"
    c.driver.reconcile_cleanups()
    # a snapshot the last coordinator left under way: its job resumed off the start's path (a host's
    # answer may wait for its dump under way to end), before the recoveries run again
    undo = threading.Thread(target=c.snapshots.reconcile, name="reconcile-snapshots", daemon=True)
    undo.start()
    return c.operations.reconcile(by=f"coordinator {me} (term {term})", snapshots_undone=undo)


def in_flight_hosts(c: Leader) -> set[str]:
    """Every host an operation in flight may act on: its node and destination, and every host of
    the jobs it concerns (an evacuation's peers, a recovery's survivors)."""
    hosts: set[str] = set()
    for op in c.store.ops(running_only=True):
        hosts |= {h for h in (op.node, op.dest) if h}
        md = op.metadata
        jobs = list(md.get("jobs") or []) + ([md["job"]] if md.get("job") else [])
        for job in jobs:
            hosts |= {w.host for w in c.store.workers(job=job)}
        hosts |= set((md.get("peers") or {}).values())
    return hosts


def announce(c: Leader, term: int) -> tuple[int, int]:
    """Tell the agents the new term: those of the operations in flight now, before anything is
    resumed; the others in the background (their heartbeats' answers carry it too).  (told,
    not answering) of the first group."""
    urls = {h.name: h.url for h in c.store.hosts()}
    first = sorted(in_flight_hosts(c) & urls.keys())
    me = c.lead.me if c.lead is not None else ""

    def tell(host: str) -> bool:
        try:
            with AgentClient(urls[host], c.settings.cluster_token, timeout=ANNOUNCE_TIMEOUT_S, fence=c.fence) as a:
                a.announce_term(term, me)
            return True
        except PitstopError as e:
            log.info("an agent was not told the new term; it learns it from its next heartbeat", host=host,
                     error=e.message[:200])
            return False

    got = in_parallel(tell, first)
    rest = sorted(urls.keys() - set(first))
    if rest:
        threading.Thread(target=in_parallel, args=(tell, rest), name="announce-term", daemon=True).start()
    return sum(got), len(got) - sum(got)
