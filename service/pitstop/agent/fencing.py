"""A host that may have been cut off from its coordinator keeps out of the way of the copies a
recovery restores elsewhere (docs/architecture.md, "Unplanned failures").

Two steps, each of this agent alone, because the coordinator may be unreachable:
- isolate: the coordinator has not answered for PITSTOP_AGENT_SELF_FENCE_S.  Ranks of jobs with
  snapshots stop, and their namespaces drop all traffic, until it answers again (`rejoin`).
- fence: the coordinator says the job was recovered elsewhere meanwhile (an epoch).  Its ranks here
  end for good, and the epoch is kept in this agent's state, so a rank of the job registered
  here under an older epoch is never taken for a live one again.

Why apart from the snapshots: nothing here reads or writes a snapshot; a fence concerns the job's
ranks on this host, whatever the snapshots hold."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import structlog

from pitstop import nsinit
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState
from pitstop.agent.timeouts import FENCED_INIT_DIR_KEEP_S
from pitstop.criu import runtime
from pitstop.network import workerns
from pitstop.proc import proctree

log = structlog.get_logger("pitstop.agent.fencing")


class Fencing:
    def __init__(self, settings: AgentSettings, state: AgentState) -> None:
        self.s, self.state = settings, state
        self.fences_file = settings.state_dir / "fences.json"
        self.isolated: set[str] = set()  # workers stopped and cut off while the coordinator was out of reach

    def fences(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads(self.fences_file.read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def fence(self, job: str, epoch: int, reason: str) -> dict[str, Any]:
        """The job was recovered on other hosts while this one was away (epoch: that recovery).
        Its workers here are killed, first thing, and recorded lost with why; the epoch stays in
        this agent's state, so a worker of the job registered here under an older epoch is never
        taken for a live rank again."""
        why = f"fenced: job {job} was recovered elsewhere (recovery {epoch}) while this host was away" + (
            f"; {reason}" if reason else "")
        killed = []
        for w in [w for w in self.state.workers.values() if w.job == job]:
            if w.state in ("running", "paused", "capturing", "stopped"):
                proctree.kill_and_wait(w.root_pid)
                killed.append(w.id)
            if w.state not in ("exited", "moved"):
                self.state.update_worker(w, state="lost", reason=why, fenced_epoch=epoch)
            else:
                self.state.update_worker(w, fenced_epoch=epoch)
            net = workerns.from_dict(w.net)
            if net:
                workerns.destroy(net)
        # its init's directory: empty now, removed once nothing works in it (not at once: on a machine
        # whose hosts share /run, the rank's copy on the spare is being restored into that very path)
        for w in [w for w in self.state.workers.values() if w.job == job and w.init_dir]:
            t = threading.Timer(FENCED_INIT_DIR_KEEP_S, nsinit.remove_unused, args=(w.init_dir,))
            t.daemon = True
            t.start()
        fences = self.fences()
        fences[job] = max(epoch, fences.get(job, 0))
        tmp = self.fences_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(fences))
        os.replace(tmp, self.fences_file)
        log.warning("job fenced on this host", job=job, epoch=epoch, killed=killed)
        return {"job": job, "epoch": fences[job], "killed": killed}

    def isolate(self, silent_s: float) -> bool:
        """The coordinator has not answered for `silent_s`: this host may be the one cut off, and
        the jobs with snapshots may be recovered elsewhere meanwhile.  Their ranks here stop
        (SIGSTOP) and their namespaces drop all traffic, so a copy restored on a spare never meets
        this one on the network.  Whether any was isolated now."""
        nft = runtime.locate().nft
        done = False
        for w in list(self.state.workers.values()):
            if w.snapshot_every_s and w.state == "running" and w.id not in self.isolated:
                net = workerns.from_dict(w.net)
                if net:
                    workerns.lock(net, nft)
                proctree.stop(proctree.tree(w.root_pid))
                self.state.update_worker(w, state="paused", paused_at=time.time(),
                                           reason=f"isolated: the coordinator did not answer for {silent_s:g} s")
                self.isolated.add(w.id)
                done = True
        if done:
            log.warning("the coordinator is out of reach: ranks of jobs with snapshots isolated until it answers",
                        workers=sorted(self.isolated), silent_s=silent_s)
        return done

    def rejoin(self, fences: dict[str, int]) -> None:
        """The coordinator answers again: ranks of a job it fenced meanwhile end (the job runs
        elsewhere now); the others run on where they stopped."""
        nft = runtime.locate().nft
        for wid in sorted(self.isolated):
            w = self.state.workers.get(wid)
            if w is None:
                continue
            if w.job in fences:
                self.fence(w.job, fences[w.job], "found isolated when the coordinator answered again")
                continue
            if w.state == "paused":
                proctree.resume(proctree.tree(w.root_pid))
                net = workerns.from_dict(w.net)
                if net:
                    workerns.unlock(net, nft)
                self.state.update_worker(w, state="running", running_since=time.time(), reason=None)
        log.info("the coordinator answers again; isolated ranks ended or resumed", workers=sorted(self.isolated),
                 fenced=sorted(fences))
        self.isolated.clear()
