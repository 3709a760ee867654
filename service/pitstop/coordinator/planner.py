"""Which workers leave, which spare takes them, and why a request cannot be served.

All checks run before anything is paused: a request that cannot be served is
refused with the reason and changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pitstop.coordinator.store import LIVE, BaseStore
from pitstop.errors import Conflict, FailedPrecondition, InvalidRequest, NotFound
from pitstop.proc import caps
from pitstop.wire.store_rows import StoredHost, StoredWorker

OUT_OF_SERVICE = ("draining", "drained")
"""Roles of a host that was evacuated: never a destination until an operator returns it.  A
cordoned host (any role, `cordoned` set: lifecycle.cordon) is no destination either."""


def usable_spare(h: StoredHost) -> bool:
    """A spare the coordinator may send workers to (an evacuation's, a recovery's, a replica's)."""
    return h.role == "spare" and not h.cordoned


@dataclass
class Plan:
    node: StoredHost
    dest: StoredHost
    leaving: list[StoredWorker]                  # workers on the node
    peers: list[StoredWorker] = field(default_factory=list)  # other workers of the affected jobs
    jobs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Unfit:
    """Why a host cannot take the leaving workers, and what, beyond picking another, would fix it."""

    reason: str
    remedy: str = ""

    def __str__(self) -> str:
        return self.reason


def healthy(h: StoredHost, timeout_s: float) -> bool:
    return time.time() - h.last_seen <= timeout_s


def gpu_mismatch(src: StoredHost, dst: StoredHost, leaving: list[StoredWorker]) -> Unfit | None:
    """Why dst cannot host src's workers, GPU-wise; None when it can."""
    sm, sn = src.gpu_model, int(src.gpu_count or 0)
    dm, dn = dst.gpu_model, int(dst.gpu_count or 0)
    if not sn:
        return None  # CPU-only workers go anywhere
    if dm != sm:
        return Unfit(f"GPU model {dm or 'none'} differs from {src.name}'s {sm}")
    if dn < sn:
        return Unfit(f"{dn} GPUs, {src.name} has {sn}")
    return None


def caps_mismatch(dst: StoredHost, leaving: list[StoredWorker]) -> Unfit | None:
    """Why dst's agent could not give the leaving workers their capabilities back (proc/caps.py)."""
    if not dst.cap_bnd:
        return None  # an agent that does not report its set: CRIU's own error, if any, will say
    have = int(dst.cap_bnd, 16)
    for w in leaving:
        lack = caps.missing(int(w.caps or "0", 16), have)
        if lack:
            return Unfit(f"its agent cannot grant {', '.join(lack)}, which worker {w.id} holds "
                         "(the agent unit's CapabilityBoundingSet)",
                         remedy="widen that agent's CapabilityBoundingSet (systemd/pitstop-agent.service), "
                                "or launch the job without those capabilities")
    return None


def unmovable_workers(workers: list[StoredWorker]) -> list[StoredWorker]:
    """The live workers whose agent reported a reason they cannot be moved (agent: shimctl.unmovable)."""
    return [w for w in workers if w.unmovable and w.state in LIVE]


def plan(store: BaseStore, node: str, to: str | None, busy_hosts: dict[str, str], heartbeat_timeout_s: float) -> Plan:
    src = store.host(node)
    if src is None:
        raise NotFound(f"no host named {node!r}", action="list hosts with `pitstop hosts`")
    if node in busy_hosts:
        raise Conflict(f"host {node} is already being evacuated by operation {busy_hosts[node]}",
                       action=f"follow it with `pitstop ops {busy_hosts[node]}`",
                       details={"operation": busy_hosts[node]})
    leaving = [w for w in store.workers(host=node) if w.state in LIVE]
    if not leaving:
        raise FailedPrecondition(f"host {node} runs no workers: nothing to evacuate", code="nothing_to_do",
                                 action="check `pitstop jobs`; workers register through `pitstop run`")
    jobs = sorted({w.job for w in leaving})
    peers = [w for j in jobs for w in store.workers(job=j) if w.host != node and w.state in LIVE]
    stuck = unmovable_workers(leaving + peers)
    if stuck:  # the cut would destroy and re-create their communicators: refused before any pause
        raise FailedPrecondition(
            f"job(s) {', '.join(sorted({w.job for w in stuck}))} cannot be moved: "
            + "; ".join(f"{w.id} on {w.host}: {w.unmovable}" for w in stuck[:4]),
            code="unmovable_job", action="nothing was paused; the job keeps running where it is. Do what the "
                                         "reason says (every NCCL call must reach a libnccl the shim stands in "
                                         "front of), or stop the job before the host leaves",
            details={"workers": {w.id: w.unmovable for w in stuck}})
    if to is not None:
        if to == node:
            raise InvalidRequest(f"cannot evacuate {node} to itself", action="name another host, or omit 'to'")
        dst = store.host(to)
        if dst is None:
            raise NotFound(f"no host named {to!r}", action="list hosts with `pitstop hosts`")
        why = _unusable(dst, src, leaving, busy_hosts, heartbeat_timeout_s)
        if why:
            raise FailedPrecondition(f"cannot move {node}'s workers to {to}: {why}", code="no_compatible_spare",
                                     action="pick another host, or omit 'to' to let pitstop choose a spare"
                                            + (f"; or {why.remedy}" if why.remedy else ""))
        return Plan(src, dst, leaving, peers, jobs)
    reasons, remedies = [], []
    for h in store.hosts():
        if h.name == node:
            continue
        if h.role != "spare":
            continue
        why = _unusable(h, src, leaving, busy_hosts, heartbeat_timeout_s)
        if why is None:
            return Plan(src, h, leaving, peers, jobs)
        reasons.append(f"{h.name}: {why}")
        if why.remedy and why.remedy not in remedies:
            remedies.append(why.remedy)
    raise FailedPrecondition(
        f"no compatible spare for {node}" + (f" ({'; '.join(reasons)})" if reasons else ": no host is a spare"),
        code="no_compatible_spare",
        action="start an agent with --spare on a host matching this one, or name a host with 'to'"
               + "".join(f"; or {r}" for r in remedies),
        details={"candidates": reasons})


def _unusable(h: StoredHost, src: StoredHost, leaving: list[StoredWorker], busy: dict[str, str],
              timeout_s: float) -> Unfit | None:
    if not healthy(h, timeout_s):
        return Unfit(f"no heartbeat for {h.age_s:.0f} s")
    if h.name in busy:
        return Unfit(f"busy with operation {busy[h.name]}")
    if h.role in OUT_OF_SERVICE:  # emptied for maintenance: taken again only once returned to service
        return Unfit(f"{h.role}: it was evacuated and is out of service",
                     remedy=f"return it with `pitstop hosts uncordon {h.name}` once it may take workers again")
    if h.cordoned:  # kept out of the spare pool by an operator; nothing was moved off it
        return Unfit(f"cordoned ({h.cordoned.get('reason') or 'no reason given'})",
                     remedy=f"let it back with `pitstop hosts uncordon {h.name}` once it may take workers again")
    if h.health and h.health.get("degraded"):
        return Unfit("degraded: " + ", ".join(h.health.get("reasons", [])))
    return gpu_mismatch(src, h, leaving) or caps_mismatch(h, leaving)
