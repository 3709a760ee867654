"""`pitstop slurm-watch`: operators drain nodes in Slurm, and the ranks move by themselves.

One watcher per cluster polls Slurm's nodes and the coordinator's hosts, and:

- **A drained node's ranks move.**  When a node that runs ranks of a pitstop job is drained (all
  drains, or only those whose reason starts with `--reason-prefix`), it asks the coordinator to
  evacuate the node's host, and writes the move's progress into the node's reason after the
  operator's own: `maintenance | pitstop: moving its ranks (operations/ID, phase restore)`, then
  `... | pitstop: moved its ranks to spare-1 (operations/ID, 0.61 s pause)` or
  `... | pitstop: cannot move its ranks: <why>; they run here still`.  A drain pitstop cannot act on
  (no agent is that node, nothing runs there) says so the same way.
- **Node to host**, never guessed from addresses (several nodes may share one): `pitstop_host=NAME`
  in the node's Extra= or Comment=, else the host whose agent reports that Slurm node name
  (`pitstop agent --slurm-node`, default the short host name).
- **Undrain during a move**: the operation is cancelled.  Before its commit point it rolls back
  and the ranks stay on the node; past it the move finishes, and the node, back in service, is
  empty of them.
- **Spares are held back** in a Slurm reservation (`--reservation`, default `pitstop_spares`) that
  the watcher keeps equal to the spares' nodes plus the nodes that run ranks a move put there:
  ordinary jobs are not placed on them.
- **Freeing the node** (`--release-nodes`): once a node's ranks moved, the node is taken out of
  the allocations of the Slurm jobs those ranks belong to, so it drains fully and may reboot.
  Slurm then ends those jobs' tasks on it (the launchers; the moved ranks outlive them) and the
  job's `srun` reports them killed.  Off by default: it trades the job's exit status for the node.
- **The spare joins the job.**  Once ranks of a Slurm job moved to a spare that is a Slurm node,
  the node is added to the job's allocation (Slurm's job expansion, from the spares' reservation)
  and each moved rank gets a step of the job there, `pitstop hold JOB.RANK`, which takes up the
  rank's handle on the spare (agent/handles.py): `squeue` lists the spare as the job's, the job's
  accounting counts it, and `scancel` ends the step and with it the rank.  Slurm 22.05 without
  slurmdbd takes one resize of a job: a job already resized (a second move, or a node freed with
  `--release-nodes` and then a spare added is fine, but not a third change) keeps the spare held in
  the reservation instead, and the node's reason says so.  Order: the node is freed first, then
  the spare added, because Slurm refuses a shrink after an expansion but not the reverse.
- **A Slurm job that ends ends its moved ranks** (scancel, a time limit), whose launchers may be
  gone with the node they left.
- **Health to Slurm**: a host the coordinator's health policy finds degraded is drained in Slurm
  with the policy's reasons (`pitstop health: ...`), so that Slurm stops placing work there; the
  coordinator's own policy moves its ranks, so such a drain does not start a second move.

The watcher keeps no state that matters across restarts: a move's operation is found again by
its idempotency key (the node and the time of its drain) or among the host's running operations.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import structlog

from pitstop.errors import Conflict, PitstopError
from pitstop.slurm import slurmctl
from pitstop.slurm.slurmctl import Job, Node

log = structlog.get_logger("pitstop.slurm.watch")

OURS = " | pitstop: "  # what separates the operator's reason from pitstop's note on it
HEALTH_PREFIX = "pitstop health:"
HOST_KEY = "pitstop_host="
LIVE = ("running", "paused", "capturing", "stopped")
HOLD_STEP = "pitstop-hold-"  # a moved rank's step on the spare: pitstop-hold-JOB.RANK
HOLD_START_S = 20.0  # a hold step, from srun to listed by Slurm (or refused)
HOLD_SETTLE_S = 1.0  # a listed hold step still runs this long after: it took up the handle


class Slurm(Protocol):
    def nodes(self) -> list[Node]: ...
    def jobs(self) -> list[Job]: ...
    def drain(self, node: str, reason: str) -> None: ...
    def shrink(self, job: str, nodes: list[str]) -> None: ...
    def set_reservation(self, name: str, nodes: list[str]) -> None: ...
    def expand(self, job: str, node: str, reservation: str | None) -> None: ...
    def steps(self, job: str) -> list[str]: ...
    def start_step(self, job: str, node: str, name: str, cmd: list[str], env: dict[str, str],
                   out: IO[bytes]) -> Any: ...


class Coordinator(Protocol):
    def hosts(self) -> list[dict]: ...
    def jobs(self) -> list[dict]: ...
    def ops(self, node: str | None = None, done: bool | None = None, before: float | None = None,
            limit: int | None = None) -> list[dict]: ...
    def op(self, op_id: str) -> dict: ...
    def evacuate(self, node: str, to: str | None = None, idempotency_key: str | None = None,
                 reason: str | None = None, post_copy: bool | None = None, pre_copy: bool | None = None,
                 validate_only: bool = False) -> dict: ...
    def cancel(self, op_id: str) -> dict: ...
    def signal_job(self, job: str, sig: int) -> dict: ...


class SlurmCommands:
    """The real Slurm, through its commands (slurmctl.py)."""

    def nodes(self) -> list[Node]:
        return slurmctl.nodes()

    def jobs(self) -> list[Job]:
        return slurmctl.jobs()

    def drain(self, node: str, reason: str) -> None:
        slurmctl.drain(node, reason)

    def shrink(self, job: str, nodes: list[str]) -> None:
        slurmctl.shrink(job, nodes)

    def set_reservation(self, name: str, nodes: list[str]) -> None:
        slurmctl.set_reservation(name, nodes)

    def expand(self, job: str, node: str, reservation: str | None) -> None:
        slurmctl.expand(job, node, reservation)

    def steps(self, job: str) -> list[str]:
        return slurmctl.steps(job)

    def start_step(self, job: str, node: str, name: str, cmd: list[str], env: dict[str, str],
                   out: IO[bytes]) -> subprocess.Popen:
        return slurmctl.start_step(job, node, name, cmd, env, out)


def split_reason(reason: str) -> tuple[str, str | None]:
    """The operator's reason and pitstop's note on it (None: no note yet)."""
    if OURS in reason:
        own, note = reason.split(OURS, 1)
        return own, note
    return reason, None


def trusted_claims(workers: list[dict], jobs: list[Job]) -> list[dict]:
    """The workers, each one's Slurm job kept only where it could be its own: a rank's launcher says
    which Slurm job started it, and the watcher acts on that job's end (it ends the rank), so a
    claim counts only from root or from the Slurm job's own user.  Another user's claim is dropped
    here, never acted on: a rank registered by uid U naming a Slurm job of uid V != U."""
    users = {j.id: j.user_id for j in jobs}
    out = []
    for w in workers:
        sj, owner = w.get("slurm_job"), w.get("owner_uid")
        uid = users.get(sj) if sj else None
        if sj and owner not in (None, 0) and uid is not None and uid != owner:
            log.warning("a rank names a Slurm job of another user: its claim is ignored", worker=w.get("id"),
                        slurm_job=sj, rank_owner=owner, slurm_user=uid)
            w = {**w, "slurm_job": None}
        out.append(w)
    return out


@dataclass
class Move:
    op: str
    host: str
    reason: str            # the operator's, as the drain gave it
    said: str = ""         # the note last written


@dataclass
class Watcher:
    slurm: Slurm
    coordinator: Coordinator
    reason_prefix: str = ""
    reservation: str | None = "pitstop_spares"
    moves: dict[str, Move] = field(default_factory=dict)      # node -> its move under way
    handled: dict[str, str] = field(default_factory=dict)     # node -> the drain reason already acted on
    hosted: set[str] = field(default_factory=set)             # nodes reserved because they took moved ranks
    health_drained: set[str] = field(default_factory=set)     # nodes drained for their host's health
    release_nodes: bool = False                               # free a drained node from its jobs' allocations
    seen_running: set[str] = field(default_factory=set)       # Slurm jobs seen running
    ended: set[str] = field(default_factory=set)              # pitstop jobs ended because their Slurm job did
    workers: list[dict] = field(default_factory=list)         # the coordinator's, as of this step
    slurm_jobs: list[Job] = field(default_factory=list)       # Slurm's, as of this step
    hosts: list[dict] = field(default_factory=list)           # the coordinator's, as of this step
    node_of: dict[str, str] = field(default_factory=dict)     # host -> its Slurm node, as of this step
    join_spares: bool = True                                  # add the spare to the job, and a step per rank
    pitstop: list[str] = field(default_factory=lambda: [sys.executable, "-m", "pitstop.cli"])  # on every node
    holds: list[Any] = field(default_factory=list)            # the srun processes of hold steps, to reap
    reserved: list[str] = field(default_factory=list)         # the reservation's nodes, as last set

    def step(self) -> None:
        """One look at Slurm and the coordinator, and whatever follows from it."""
        nodes = self.slurm.nodes()
        hosts = self.hosts = self.coordinator.hosts()
        self.holds = [p for p in self.holds if p.poll() is None]
        self.workers = [w | {"job": j["job"]} for j in self.coordinator.jobs() for w in j["workers"]]
        live = {w["host"] for w in self.workers if w["state"] in LIVE}
        self.slurm_jobs = self.slurm.jobs()
        self.workers = trusted_claims(self.workers, self.slurm_jobs)
        self._end_with_slurm(self.slurm_jobs)
        host_of = self._hosts_by_node(nodes, hosts)
        self.node_of = {h: n for n, h in host_of.items()}
        self._reserve(nodes, hosts, host_of, live)
        self._drain_unhealthy(nodes, hosts, host_of)
        for n in nodes:
            try:
                self._look(n, host_of.get(n.name), live)
            except PitstopError as e:
                log.warning("could not act on a node", node=n.name, error=e.message)

    def run(self, interval_s: float = 1.0, until: Any = None) -> None:
        """Step every `interval_s` until `until()` says to stop; a step that fails is logged and
        the next one tries again (Slurm or the coordinator may be restarting)."""
        while not (until and until()):
            try:
                self.step()
            except PitstopError as e:
                log.warning("slurm-watch could not look", error=e.message, action=e.action)
            time.sleep(interval_s)

    # one node
    def _look(self, n: Node, host: str | None, live: set[str]) -> None:
        own, note = split_reason(n.reason)
        if not n.draining:
            self.handled.pop(n.name, None)
            if n.name in self.moves:
                self._undrained(n.name)
            return
        if n.name in self.moves:
            self._follow(n, own)
            return
        if self.handled.get(n.name) == own:
            return
        self.handled[n.name] = own
        if own.startswith(HEALTH_PREFIX) or not own.startswith(self.reason_prefix):
            return  # the coordinator's health policy moves its ranks; other drains are not ours
        if host is None:
            self._say(n, own, f"no pitstop agent is Slurm node {n.name}; nothing moved "
                              f"(set {HOST_KEY}HOST in its Extra= or run the agent with --slurm-node)")
            return
        if note is not None:  # a watcher before this one acted on this drain: follow what it started
            running = self.coordinator.ops(node=host, done=False)
            if running:
                self.moves[n.name] = Move(running[0]["name"], host, own, note)
            return
        if host not in live:
            self._say(n, own, f"no ranks of pitstop jobs run on {host}; nothing to move")
            return
        try:
            op = self.coordinator.evacuate(host, reason=f"Slurm drain of {n.name}: {own}"[:500],
                                           idempotency_key=f"slurm-watch-{n.name}-{n.reason_changed_at}")
        except PitstopError as e:
            self._say(n, own, f"cannot move its ranks: {e.message}; they run here still")
            return
        log.info("a drained node's ranks are moving", node=n.name, host=host, operation=op["name"])
        self.moves[n.name] = Move(op["name"], host, own)
        self._follow(n, own, op)

    def _follow(self, n: Node, own: str, op: dict | None = None) -> None:
        m = self.moves[n.name]
        op = op or self.coordinator.op(m.op)
        md = op.get("metadata", {})
        if not op.get("done"):
            self._say(n, own, f"moving its ranks ({m.op}, phase {md.get('phase')})", m)
            return
        del self.moves[n.name]
        if md.get("result") == "succeeded":
            pause = f", {md['downtime_s']:.2f} s pause" if md.get("downtime_s") is not None else ""
            moved, dest = set(md.get("workers") or ()), str(md.get("destination"))
            self.hosted.add(dest)  # held from now on, as the spare it was (the coordinator made it active)
            freed = self._release(n.name, m.host, moved) if self.release_nodes else ""
            joined = self._join(dest, moved) if self.join_spares else ""
            self._say(n, own, f"moved its ranks to {dest} ({m.op}{pause}){freed}{joined}", m)
        else:
            why = (op.get("error") or {}).get("message") or md.get("result")
            self._say(n, own, f"could not move its ranks ({m.op}): {why}; they run here still", m)

    def _undrained(self, node: str) -> None:
        """The node came back into service while its ranks moved: cancel.  Before the commit point
        the move rolls back and the ranks stay; past it the move finishes."""
        m = self.moves.pop(node)
        try:
            self.coordinator.cancel(m.op)
            log.info("a node was returned to service during its move: the move is cancelled", node=node,
                     operation=m.op)
        except Conflict as e:
            log.info("a node was returned to service during its move, past the point of no return: the move "
                     "finishes", node=node, operation=m.op, why=e.message)

    def _say(self, n: Node, own: str, note: str, m: Move | None = None) -> None:
        if m is not None and m.said == note:
            return
        self.slurm.drain(n.name, f"{own}{OURS}{note}")
        if m is not None:
            m.said = note

    # Slurm's jobs
    def _release(self, node: str, host: str, moved: set[str]) -> str:
        """Free the drained node from the allocations of the Slurm jobs whose ranks just left it,
        so that it drains fully and may reboot.  Slurm ends those jobs' tasks on it (the launchers:
        the moved ranks outlive them, agent/handles.py); a job's srun then reports those tasks
        killed.  A job's batch host cannot leave it (Slurm refuses), nor can its only node."""
        theirs = {w.get("slurm_job") for w in self.workers if w["id"] in moved and w.get("slurm_job")}
        said = []
        for j in self.slurm_jobs:
            if not j.running or node not in j.nodes or j.id not in theirs:
                continue
            if any(w.get("slurm_job") == j.id and w["host"] == host and w["state"] in LIVE for w in self.workers):
                said.append(f"job {j.id} still has ranks here")
            elif j.batch_host == node:
                said.append(f"job {j.id} keeps it (its batch host cannot leave it)")
            elif set(j.nodes) == {node}:
                said.append(f"job {j.id} keeps it (its only node)")
            else:
                self.slurm.shrink(j.id, [x for x in j.nodes if x != node])
                said.append(f"freed from job {j.id}")
                log.info("a drained node freed from a Slurm job whose ranks moved", node=node, slurm_job=j.id)
        return ("; " + ", ".join(said)) if said else ""

    def _join(self, host: str, moved: set[str]) -> str:
        """The spare `host` becomes part of the Slurm jobs whose ranks just moved there: its node is
        added to each job's allocation, and each moved rank gets a step of the job on it that holds
        the rank's handle (`pitstop hold`).  What could not be done is said, and the spare stays held
        in the reservation as before."""
        node = self.node_of.get(host)
        if node is None:
            return ""  # the spare is no Slurm node: the reservation cannot hold it either
        agent = next((f"unix:{h['socket']}" if h.get("socket") else h["url"] for h in self.hosts
                      if h["name"] == host), None)
        if self.reservation and node not in self.reserved:  # the step that saw the move let it go
            self.reserved = sorted({*self.reserved, node})
            self.slurm.set_reservation(self.reservation, self.reserved)
        said = []
        for j in self.slurm_jobs:
            ranks = sorted(w["id"] for w in self.workers if w["id"] in moved and w.get("slurm_job") == j.id)
            if not ranks or not j.running or agent is None:
                continue
            if node not in j.nodes:
                try:
                    self.slurm.expand(j.id, node, self.reservation)
                except PitstopError as e:
                    held = f"; held in reservation {self.reservation}" if self.reservation else ""
                    said.append(f"{node} not added to job {j.id} ({e.message}){held}")
                    log.warning("a spare could not be added to the Slurm job whose ranks it took", node=node,
                                slurm_job=j.id, error=e.message)
                    continue
                log.info("a spare added to the Slurm job whose ranks it took", node=node, slurm_job=j.id)
            failed = [f"{wid}: {why}" for wid in ranks if (why := self._hold(j.id, node, wid, agent))]
            said.append(f"{node} added to job {j.id}" + (f", but no step holds {'; '.join(failed)}" if failed else ""))
        return ("; " + ", ".join(said)) if said else ""

    def _hold(self, job: str, node: str, wid: str, agent: str) -> str | None:
        """Start the step of Slurm job `job` on `node` that holds moved rank `wid` (`pitstop hold`),
        unless it runs already; None once Slurm lists it, else why not."""
        name = f"{HOLD_STEP}{wid}"
        if name in self.slurm.steps(job):
            return None
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "SLURM_CONF") or k.startswith("LC_")}
        # The step prints only its own messages (--no-output: the rank's output stays with its agent,
        # for `pitstop attach`), so a file the srun keeps open stays small.
        with tempfile.TemporaryFile() as out:
            p = self.slurm.start_step(job, node, name, [*self.pitstop, "hold", wid, "--agent", agent, "--no-output"],
                                      env, out)
            end = time.monotonic() + HOLD_START_S
            listed_at: float | None = None
            while time.monotonic() < end:
                if p.poll() is not None:
                    out.seek(0)
                    said = out.read().decode(errors="replace").strip().splitlines()
                    return f"its step exited {p.returncode}: {' / '.join(said[-2:]) or 'no output'}"
                if listed_at is None and name in self.slurm.steps(job):
                    listed_at = time.monotonic()
                if listed_at is not None and time.monotonic() - listed_at >= HOLD_SETTLE_S:
                    self.holds.append(p)
                    log.info("a moved rank's handle is held by a step of its Slurm job", worker=wid, slurm_job=job,
                             node=node, step=name)
                    return None
                time.sleep(0.2)
            p.kill()
            return f"Slurm did not run its step within {HOLD_START_S:g} s"

    def _end_with_slurm(self, jobs: list[Job]) -> None:
        """A Slurm job that ended (scancel, its time limit) takes its moved ranks along: their
        launchers may be gone with the node they left, and nothing else would end them."""
        running = {j.id for j in jobs if j.running}
        by_job: dict[str, list[dict]] = {}
        for w in self.workers:
            if w["state"] in LIVE and w.get("slurm_job"):
                by_job.setdefault(w["job"], []).append(w)
        for job, ws in by_job.items():
            slurm_jobs = {w["slurm_job"] for w in ws}
            if job in self.ended or slurm_jobs & running or not slurm_jobs <= self.seen_running:
                continue
            self.ended.add(job)
            log.warning("a Slurm job ended: its ranks that still run are ended too", job=job,
                        slurm_jobs=sorted(slurm_jobs), ranks=[w["id"] for w in ws])
            self.coordinator.signal_job(job, int(signal.SIGKILL))
        self.seen_running |= running

    # the cluster
    @staticmethod
    def _hosts_by_node(nodes: list[Node], hosts: list[dict]) -> dict[str, str]:
        names = {h["name"] for h in hosts}
        by_report = {h["slurm_node"]: h["name"] for h in hosts if h.get("slurm_node")}
        out: dict[str, str] = {}
        for n in nodes:
            said = next((tok.removeprefix(HOST_KEY) for text in (n.extra, n.comment) for tok in text.split()
                         if tok.startswith(HOST_KEY)), None)
            if said is not None and said in names:
                out[n.name] = said
            elif n.name in by_report:
                out[n.name] = by_report[n.name]
        return out

    def _reserve(self, nodes: list[Node], hosts: list[dict], host_of: dict[str, str], live: set[str]) -> None:
        if not self.reservation:
            return
        role = {h["name"]: h["role"] for h in hosts}
        self.hosted = {h for h in self.hosted if h in live}  # ranks gone: the node may take jobs again
        self.reserved = [n.name for n in nodes if n.name in host_of and
                         (role.get(host_of[n.name]) == "spare" or host_of[n.name] in self.hosted)]
        self.slurm.set_reservation(self.reservation, self.reserved)

    def _drain_unhealthy(self, nodes: list[Node], hosts: list[dict], host_of: dict[str, str]) -> None:
        health = {h["name"]: h.get("health") or {} for h in hosts}
        for n in nodes:
            h = health.get(host_of.get(n.name, ""), {})
            if not h.get("degraded"):
                self.health_drained.discard(n.name)
                continue
            if n.draining or n.name in self.health_drained:
                continue
            reasons = "; ".join(h.get("reasons") or ["degraded"])
            self.slurm.drain(n.name, f"{HEALTH_PREFIX} {reasons}"[:250])
            self.health_drained.add(n.name)
            log.warning("a degraded host's node drained in Slurm", node=n.name, reasons=reasons)
