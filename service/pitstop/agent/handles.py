"""A worker's job handle: what ends it, and where a signal for it goes.

Whatever started a rank (a shell, srun, torchrun) holds `pitstop run`, the launcher, and expects
it to behave like the rank.  The rules, wherever the rank runs:

- **A signal follows the rank.**  A signal for a worker (its launcher forwards what it receives;
  an operator sends one to a whole job through the coordinator) is delivered where the worker
  runs now: here, or by the agent it moved to, which this agent asks (`POST
  /v1/workers/{id}:signal`).  A worker in the middle of a move is not signalled: the call is
  refused as `moving`, and the launcher asks again until the move has ended one way or the other.
- **A launcher that dies ends its rank while the rank runs on the launcher's host.**  A launcher
  killed outright (SIGKILL, the OOM killer) cannot pass anything on, and nothing else would end
  the rank: the agent watches each launcher (a pidfd) and kills the worker's tree when its
  launcher is gone first.
- **The handle can be taken up where the rank runs now.**  A process on the rank's new host may
  take the launcher's place (`pitstop hold`, `POST /v1/workers/{id}:hold` on the local socket):
  from then on its end ends the rank as a launcher's would, and signals it receives reach the
  rank.  The Slurm watcher starts one as a step of the rank's Slurm job on the spare, so that the
  rank belongs to that job there (slurm/watch.py).
- **A rank that moved outlives its old launcher.**  An evacuated host is about to be rebooted
  or pulled: the launchers left on it die with it, and that must not end the job.  The moved rank
  is ended by a signal forwarded through its launcher while that still runs, by the operator
  (`pitstop stop|kill JOB`), or by the scheduler that holds the job.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import structlog

from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Worker
from pitstop.agent.timeouts import FORWARD_SIGNAL_TIMEOUT_S, SETTLE_EVERY_S
from pitstop.errors import Conflict, FailedPrecondition, PitstopError
from pitstop.proc import proctree, signals
from pitstop.wire.agent_client import AgentClient

log = structlog.get_logger("pitstop.agent.handles")


MOVING = ("capturing", "stopped", "released")
HERE = ("running", "paused")


class Handles:
    def __init__(self, settings: AgentSettings, state: AgentState) -> None:
        self.s = settings
        self.state = state
        self._watched: set[str] = set()
        self._lock = threading.Lock()

    # signals
    def signal(self, wid: str, sig: int) -> dict:
        """Deliver `sig` to the worker wherever it runs; what happened, for the caller to show."""
        w = self.state.worker(wid)
        if w.state == "moved" and w.moved_to:
            try:
                with AgentClient(w.moved_to["url"], self.s.cluster_token, timeout=FORWARD_SIGNAL_TIMEOUT_S) as a:
                    return a.signal(wid, sig)
            except PitstopError as e:
                raise e.__class__(f"worker {wid} moved to {w.moved_to.get('agent')}, whose agent did not take "
                                  f"the signal: {e.message}", action=e.action, code=e.code,
                                  http_status=e.http_status) from None
        if w.state in MOVING:
            raise Conflict(f"worker {wid} is being moved ({w.state}); it is signalled once the move has ended",
                           code="moving", action="send the signal again in a few seconds")
        delivered = w.state in HERE and proctree.is_running(w.root_pid, w.start_time) and \
            signals.send(w.root_pid, sig, under_init=bool(w.init_dir))
        if delivered:
            log.info("signalled", worker=wid, signal=signal.Signals(sig).name)
            if sig in signals.ASKS_FOR_END:  # `pitstop stop|kill`: its end is asked for, not a failure
                self.state.update_worker(w, end_asked=True)
                if w.state == "paused":  # stopped (a snapshot, a peer's move, isolated): it acts on it only running
                    proctree.resume(proctree.tree(w.root_pid))
                    self.state.update_worker(w, state="running", running_since=time.time(), pause_until=None,
                                             reason=f"continued so that it receives {signal.Signals(sig).name}")
        return {"worker": wid, "agent": self.s.name, "state": w.state, "delivered": bool(delivered)}

    # launchers
    def hold(self, wid: str, launcher: dict[str, int] | None) -> Worker:
        """`launcher` takes the place of the worker's launcher here: a worker that moved in has none
        on this host, and one that still runs here keeps it.  Refused for a worker that does not run
        here, or whose launcher here still runs (two handles would race on its end)."""
        if launcher is None:
            raise FailedPrecondition("the caller's process cannot be identified (no peer credentials)",
                                     code="no_peer", action="call over this host's agent socket (unix:...)")
        with self.state.lock:
            w = self.state.worker(wid)
            if w.state not in HERE or not proctree.is_running(w.root_pid, w.start_time):
                raise FailedPrecondition(f"worker {wid} does not run on this host ({w.state})", code="not_here",
                                         action="hold a worker on the host it runs on now (`pitstop jobs` says "
                                                "where)")
            old = w.launcher
            if old and old.get("pid") != launcher["pid"] and proctree.is_running(old["pid"], old["start"]):
                raise Conflict(f"worker {wid} already has a launcher on this host (pid {old['pid']})",
                               code="held", action="end that launcher first, or signal the worker through it")
            self.state.update_worker(w, launcher=launcher)
        log.info("a worker's handle was taken up here", worker=wid, launcher=launcher["pid"])
        self.watch(w)
        return w

    def watch(self, w: Worker) -> None:
        """Watch the worker's launcher, once per worker, for as long as it runs."""
        if not w.launcher:  # registered over TCP, or restored here having never run here before
            return
        with self._lock:
            if w.id in self._watched:
                return
            self._watched.add(w.id)
        threading.Thread(target=self._wait, args=(w.id, w.launcher["pid"], w.launcher["start"]), daemon=True,
                         name=f"launcher-{w.id}").start()

    def adopt(self) -> None:
        """After a restart: watch the launchers of the workers still here (some may be gone already)."""
        for w in list(self.state.workers.values()):
            if w.state in HERE + MOVING:
                self.watch(w)

    def _wait(self, wid: str, pid: int, start: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        try:
            if fd is not None and proctree.is_running(pid, start):
                select.select([fd], [], [])  # readable once the launcher has ended
        finally:
            if fd is not None:
                os.close(fd)
        try:
            self._launcher_gone(wid, pid)
        finally:
            with self._lock:
                self._watched.discard(wid)
        w = self.state.workers.get(wid)
        if w is not None and w.state in HERE + MOVING and (w.launcher or {}).get("pid") not in (None, pid):
            self.watch(w)  # its handle passed to another process while this one was watched (a rollback)

    def _launcher_gone(self, wid: str, pid: int) -> None:
        while True:
            w = self.state.workers.get(wid)
            if w is None or w.state not in HERE + MOVING:
                return  # ended, lost, or moved: a moved rank outlives its old launcher
            if (w.launcher or {}).get("pid") != pid:
                return  # another process holds the worker's handle here now (`pitstop hold`)
            if w.container is not None and pid == w.root_pid:
                return  # the container's init is its launcher: the container ended with it
            if w.state in HERE:
                break
            time.sleep(SETTLE_EVERY_S)  # a move under way commits or rolls back within its deadlines
        # Said before it is done: the reaper of a restored worker records only what it did not know.
        self.state.update_worker(w, state="exited", exit_code=128 + signal.SIGKILL,
                                 reason=f"its launcher (pid {pid}) ended before it; the worker was killed "
                                        "with it, as nothing else could end it")
        killed = proctree.kill_tree(w.root_pid)
        log.warning("a launcher ended before its worker: the worker was killed", worker=wid, launcher=pid,
                    processes=len(killed))
