"""A host's life around evacuations: cordoned, returned to service, given another role, or forgotten.

Why: an evacuated host is `drained` (or `draining` while its moved workers' memory still
follows from it) and is never a destination again by itself (planner.OUT_OF_SERVICE): the
operator emptied it for a reason.  A cordoned host is kept out of the spare pool the same way
without anything moving off it (a host due for maintenance that still runs its jobs, a spare
whose hardware is suspect): never the destination of an evacuation or a recovery, never kept as
a spare for a snapshot's replicas.  These are the operator's ways in and back, each refused with
the reason where it would take a host from under a running operation or lose track of a worker.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pitstop.coordinator.planner import OUT_OF_SERVICE, healthy
from pitstop.coordinator.store import LIVE, BaseStore
from pitstop.errors import Conflict, FailedPrecondition, NotFound
from pitstop.wire.store_rows import StoredHost

Role = Literal["active", "spare"]


def _host(store: BaseStore, name: str) -> StoredHost:
    h = store.host(name)
    if h is None:
        raise NotFound(f"no host named {name!r}", action="list hosts with `pitstop hosts`")
    return h


def _not_busy(name: str, busy: dict[str, str]) -> None:
    if name in busy:
        raise Conflict(f"host {name} is part of operation {busy[name]}", code="host_busy",
                       action=f"wait for it (`pitstop ops {busy[name]}`), or cancel it")


def cordon(store: BaseStore, name: str, reason: str, requested_by: str) -> dict[str, Any]:
    """Keep a host out of the spare pool, moving nothing.  Cordoning a cordoned host keeps when
    it was first cordoned and takes the new reason."""
    h = _host(store, name)
    since = (h.cordoned or {}).get("since") or time.time()
    store.set_cordon(name, {"reason": reason, "since": since, "requested_by": requested_by})
    return _host(store, name).public()


def uncordon(store: BaseStore, name: str, busy: dict[str, str], requested_by: str = "") -> dict[str, Any]:
    """Let a cordoned host back into the spare pool; return an evacuated host to service: a spare
    again if its agent offers itself as one (`--spare`), otherwise active."""
    h = _host(store, name)
    if h.cordoned and h.role not in OUT_OF_SERVICE:
        store.set_cordon(name, None)  # nothing moves and no role changes: an operation under way may go on
        return _host(store, name).public()
    _not_busy(name, busy)
    if h.role == "draining":
        raise Conflict(f"host {name} is still draining: moved workers' memory is being fetched from it",
                       code="host_draining", action="wait until its evacuation is done, then uncordon it")
    if h.role not in OUT_OF_SERVICE:
        raise FailedPrecondition(f"host {name} is {h.role}, neither cordoned nor out of service",
                                 code="host_in_service",
                                 action="nothing to do; `pitstop hosts set-role` changes an in-service role")
    role = "spare" if h.offers_spare else "active"
    store.set_role(name, role, {"reason": "returned to service (uncordon)", "requested_by": requested_by})
    store.set_cordon(name, None)
    return _host(store, name).public()


def set_role(store: BaseStore, name: str, role: Role, busy: dict[str, str], requested_by: str = "") -> dict[str, Any]:
    """Make an in-service host a spare (it then takes evacuated workers) or active."""
    h = _host(store, name)
    _not_busy(name, busy)
    if h.role in OUT_OF_SERVICE:
        raise FailedPrecondition(f"host {name} is {h.role}", code="host_out_of_service",
                                 action=f"return it to service first: `pitstop hosts uncordon {name}`")
    if role == "spare" and any(w.state in LIVE for w in store.workers(host=name)):
        raise FailedPrecondition(f"host {name} runs workers; a spare is a host with room for a leaving host's",
                                 code="host_runs_workers", action="evacuate it first, or keep it active")
    if role != h.role:
        store.set_role(name, role, {"reason": f"set {role} (set-role)", "requested_by": requested_by})
    return _host(store, name).public()


def remove(store: BaseStore, name: str, busy: dict[str, str], heartbeat_timeout_s: float) -> dict[str, Any]:
    """Forget a host that is gone (decommissioned, or dead with nothing left on it)."""
    h = _host(store, name)
    _not_busy(name, busy)
    if healthy(h, heartbeat_timeout_s):
        raise FailedPrecondition(f"host {name} is still heartbeating (last {h.age_s:.0f} s ago): it would "
                                 "register again at its next report", code="host_alive",
                                 action="stop its agent first (systemctl stop pitstop-agent), then remove it")
    live = [w.id for w in store.workers(host=name) if w.state in LIVE]
    if live:
        raise FailedPrecondition(f"host {name} last reported live workers ({', '.join(live[:8])}): removing it "
                                 "would forget where they run", code="host_has_workers",
                                 action="stop their jobs, or wait until its agent reports them ended",
                                 details={"workers": live})
    store.remove_host(name)
    return {"name": name, "removed": True}
