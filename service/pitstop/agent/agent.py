"""The agent process's state: what both of its HTTP doors (agent/api.py) serve.

One `Agent` per process, built once by agent/server.py and reached by every route through the
app's state (`AgentDep`), so that the routes can be declared once, at module level, and the
same router serve both doors where they answer alike.
"""

from __future__ import annotations

import shutil
import time
from typing import Annotated

import structlog
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pitstop import __version__, safepath, shimctl
from pitstop.agent import imagefs, reclaim
from pitstop.agent.capturing import SourceSide
from pitstop.agent.fencing import Fencing
from pitstop.agent.handles import Handles
from pitstop.agent.leftovers import Leftovers
from pitstop.agent.receiving import DestinationSide, Slot
from pitstop.agent.settings import AgentSettings
from pitstop.agent.snapshots import Snapshots
from pitstop.agent.state import LIVE_STATES, AgentState, Capture, Worker
from pitstop.agent.terms import Terms
from pitstop.agent.timeouts import SHIM_LOOK_EVERY_S
from pitstop.criu import runtime
from pitstop.errors import Conflict, PitstopError, TransferFailed
from pitstop.network import workerns
from pitstop.proc import caps, proctree

log = structlog.get_logger("pitstop.agent")

                         # for a job that snapshots protect, whose rank may park on a peer's failure

COUNT_SUFFIXES = ("_bytes", "_threads", "_rounds", "_processes")
"""Phase entries that count something rather than time it (capturing.py, receiving.py)."""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.captures = Counter("pitstop_agent_captures_total", "Captures by result", ["result"], registry=r)
        self.restores = Counter("pitstop_agent_restores_total", "Restores by result", ["result"], registry=r)
        self.phase = Histogram("pitstop_agent_phase_duration_seconds", "Duration of capture/restore phases",
                               ["phase"], registry=r, buckets=(.01, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120))
        self.sent = Counter("pitstop_agent_sent_bytes_total", "Image bytes sent to peers", registry=r)
        self.received = Counter("pitstop_agent_received_bytes_total", "Image bytes received", registry=r)
        self.term = Gauge("pitstop_agent_coordinator_term", "The highest coordinator term this agent has seen "
                          "(agent/terms.py)", registry=r)
        self.stale_terms = Counter("pitstop_agent_stale_term_refusals_total", "Calls refused because they carried "
                                   "the term of a coordinator that no longer leads", registry=r)
        Gauge("pitstop_build_info", "pitstop's version (always 1)", ["version", "service"],
              registry=r).labels(__version__, "agent").set(1)

    def phases(self, phases: dict[str, float]) -> None:
        """Durations only: a capture's phases also carry counts (bytes, threads, rounds, processes)."""
        for k, v in phases.items():
            if not k.endswith(COUNT_SUFFIXES):
                self.phase.labels(k).observe(v)


class Agent:
    """Everything one agent process holds; shared by both listeners."""

    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings
        # before anything is read from or written to them: nobody else may be able to change them
        safepath.private_dir(settings.state_dir, mode=0o755, what="the agent's state directory")
        safepath.private_dir(settings.images, what="the agent's image directory")
        self.state = AgentState(settings.state_dir)
        self.terms = Terms(settings.state_dir / "coordinator-term.json")  # the fence against a deposed leader
        self.dest = DestinationSide(settings, self.state)
        self.state.on_forget = self.dest.forget_output
        self.source = SourceSide(settings, self.state, self.dest)
        self.precopies = self.source.precopies  # the routes' and the server's way to them
        self.pages = self.source.pages
        self.metrics = Metrics()
        self.source.on_finished = self._count_capture
        reclaim.sweep(settings.images)
        self.source.reconcile()
        Leftovers(settings, self.state).remove_stale_slots()
        self.image_fs = imagefs.prepare(settings.images, enabled=settings.image_mount, size=settings.image_mount_size)
        self.dest.adopt()
        self.handles = Handles(settings, self.state)
        self.snapshots = Snapshots(settings, self.state, self.source, self.dest)
        self.fencing = Fencing(settings, self.state)
        self.coordinator_seen = time.monotonic()  # the last answer of the coordinator (agent/heartbeat.py)
        self.handles.adopt()
        self.started = time.time()
        self.data_port: int | None = None  # set by the server once transfer/dataport.py listens
        self.net_owners: dict[str, int] = {}  # worker id -> uid that prepared its network (local socket)
        self._shim_looked: dict[str, float] = {}  # worker id -> when its shim blocks were last read
        self._shim_seen: dict[str, bool] = {}  # worker id -> whether that look found any (a gloo job's: none)

    def _count_capture(self, c: Capture) -> None:
        """Called once per capture, when its dump and stream are over (sent, dumped or failed)."""
        self.metrics.captures.labels("failed" if c.state == "failed" else "ok").inc()
        self.metrics.sent.inc(c.bytes_sent)
        self.metrics.phases(c.phases)

    def storage_error(self, slot: Slot, e: OSError) -> TransferFailed:
        """A write of a received image failed (ENOSPC above all): say where and how much."""
        free = shutil.disk_usage(self.s.images).free
        return TransferFailed(
            f"cannot store image {slot.image_id} on {self.s.name}: {e.strerror} in {self.s.images} "
            f"after {slot.receiver.received} bytes ({free // 2**20} MiB free there now)",
            code="destination_storage", http_status=507,
            action="the copy is discarded and the source resumed; free space in the "
                   "destination's image directory or pick another spare")

    def finish_slot(self, slot: Slot) -> dict:
        slot.state = "complete"
        slot.finished = time.monotonic()
        rx = slot.receiver
        self.metrics.received.inc(rx.received)
        m = rx.manifest
        return {"image_id": slot.image_id, "bytes": rx.received, "files": len(m.files) if m else 0,
                "seconds": slot.finished - slot.started}

    def info(self) -> dict:
        try:
            rt = runtime.locate()
            criu = {"path": rt.binary, "version": rt.version_str, "source": rt.source, "patches": list(rt.patches)}
        except PitstopError as e:
            criu = {"error": e.message}
        return {"name": self.s.name, "url": self.s.url, "spare": self.s.spare, "version": __version__,
                "data_port": self.data_port, "cap_bnd": f"{caps.bounding_set():x}",
                "post_copy": self.pages.support(), "image_fs": self.image_fs.describe(),
                "criu": criu, "workers": len([w for w in self.state.workers.values()
                                              if w.state in LIVE_STATES]),
                "coordinator_term": self.terms.view()}

    def admit_term(self, term: int, leader: str = "") -> None:
        """A call (or an announcement) of a coordinator's term: refused where an agent has seen a
        newer one (agent/terms.py), as 409 stale_term naming that term and its leader."""
        if self.terms.admit(term, leader):
            self.metrics.term.set(self.terms.seen)
            return
        self.metrics.stale_terms.inc()
        v = self.terms.view()
        log.warning("refused a call of a coordinator that no longer leads", term=term, seen=v["term"],
                    leader=v["leader"])
        raise Conflict(f"coordinator term {term} is over: this agent has seen term {v['term']}"
                       + (f" ({v['leader']} leads)" if v["leader"] else ""), code="stale_term",
                       action="nothing: a coordinator that no longer leads may not act; the one that leads "
                              "finishes or undoes its operations",
                       details={"seen": v["term"], "leader": v["leader"]})

    def refresh(self, w: Worker, needs: bool = True) -> Worker:
        """needs: also read what capabilities its tree holds (every process's status): for
        listings, not for a pause, whose time the job waits on.  A running or paused worker whose
        tree is gone ended (a paused one killed, `pitstop kill`): it never reads paused again."""
        if w.state in ("running", "paused") and not w.restored and (
                not proctree.is_running(w.root_pid, w.start_time)):
            self.state.update_worker(w, state="exited" if w.exit_code is not None else "lost",
                                     ended_at=time.time())
            self.drop_net(w)
        if w.state == "running" and needs:
            try:
                w.caps = f"{caps.needs(w.root_pid):x}"
            except OSError:
                pass  # it is exiting; the next listing says so
            self._look_at_shim(w)
        return w

    def _look_at_shim(self, w: Worker) -> None:
        """The worker's NCCL shim blocks, headers and notes only: what it saw that cannot be moved
        (once said it stays said: the shim's counts only grow), a peer's failure it holds back for
        the job's recovery, and the snapshot protection it should know (written where a block
        differs: a process that made its first communicator since, a block restored from an older
        snapshot, a rank moved here).  Every few seconds (each look reads every process's memory
        map); every beat for a rank with a shim block in a job that snapshots protect, so that one
        parked on a peer's failure is reported before the recovery ends it."""
        now = time.monotonic()
        often = bool(w.protected_by) and self._shim_seen.get(w.id, True)
        if not often and now - self._shim_looked.get(w.id, -SHIM_LOOK_EVERY_S) < SHIM_LOOK_EVERY_S:
            return
        self._shim_looked[w.id] = now
        hs = shimctl.headers(w.root_pid)
        self._shim_seen[w.id] = bool(hs)
        if not w.unmovable:
            w.unmovable = shimctl.unmovable(w.root_pid, hs)
        w.peer_lost = shimctl.peer_lost(hs)
        shimctl.protect(hs, w.protected_by or 0)

    def resume_overdue(self) -> list[str]:
        """Workers paused with a deadline that has passed while nobody resumed them: the caller that
        paused them (a coordinator's snapshot or move) is gone, and a job must never stay stopped
        for good.  Each is continued, its network lock lifted, and said so; ranks this agent
        isolated itself (the coordinator out of reach) are not: they wait for the coordinator.
        The ids resumed."""
        now = time.time()
        nft = None
        out = []
        for w in list(self.state.workers.values()):
            if w.state != "paused" or not w.pause_until or now < w.pause_until or w.id in self.fencing.isolated:
                continue
            net = workerns.from_dict(w.net)
            if net:
                nft = nft or runtime.locate().nft
                workerns.unlock(net, nft)
            proctree.resume(proctree.tree(w.root_pid))
            self.state.update_worker(w, state="running", running_since=now, pause_until=None,
                                     reason="resumed by its agent: its pause outlived its deadline and nothing "
                                            "resumed it (the coordinator that paused it is gone)")
            out.append(w.id)
        if out:
            log.warning("paused workers resumed by their agent: their pause outlived its deadline", workers=out)
        return out

    def drop_net(self, w: Worker) -> None:
        """A worker that ended takes its address with it."""
        wn = workerns.from_dict(w.net)
        if wn and w.state in ("exited", "lost"):
            workerns.destroy(wn)


async def current(request: Request) -> Agent:
    """The agent behind the app that received the request (async: resolved on the event loop,
    without a hop to the thread pool on the pause path)."""
    agent: Agent = request.app.state.agent
    return agent


AgentDep = Annotated[Agent, Depends(current)]
