"""In-memory snapshots of a job's workers on this host, their replicas for other hosts, and the
restores a recovery asks for (docs/architecture.md, "Unplanned failures").

Why it is apart from capturing.py: a snapshot never ends the worker.  CRIU dumps with
`leave_running` (the tree stays as it was: stopped by the coordinator's pause), the images are
kept, not streamed to a spare, and the only undo of a failed snapshot is deleting its images.

Layout, under the agent's image directory (its huge-page tmpfs):
  snapshots/<job>/<number>/own/<worker id>/       this host's workers, dumped here
  snapshots/<job>/<number>/replica/<worker id>/   another host's workers, kept for it (its buddy)
Every part holds CRIU's images and `manifest.json` (transfer/manifest.py: the worker's id, job,
rank, pipes and address), so a part restores here (own) or anywhere it is sent (replica) through
the same restore as a move.  A part is complete when its `manifest.json` exists: it is written
last, after the dump (own) or after the copy was verified (replica), so a snapshot cut short by
a crash of this agent is never taken for a complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from pitstop import faults, shimctl
from pitstop.agent.dumper import manifest
from pitstop.agent.part_tracking import PartTracking
from pitstop.agent.restore_kinds import RestoreOptions
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Worker
from pitstop.criu import criu_ops, criutrack, image_files, runtime, seal
from pitstop.errors import (
    CaptureFailed,
    Conflict,
    FailedPrecondition,
    IntegrityError,
    InvalidRequest,
    NotFound,
    PitstopError,
    TransferFailed,
)
from pitstop.network import workerns
from pitstop.proc import file_identity, proctree, written_files
from pitstop.transfer.manifest import MANIFEST, Manifest, check_image_id, verify
from pitstop.transfer.stream import DirectoryTail
from pitstop.undo import Undo
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.agent_requests import JOB_PATTERN, WORKER_PATTERN

if TYPE_CHECKING:
    from pitstop.agent.capturing import SourceSide
    from pitstop.agent.receiving import DestinationSide

log = structlog.get_logger("pitstop.agent.snapshots")

OWN, REPLICA = "own", "replica"
PARENT = "parent"  # a part's link to the part it is a delta against (CRIU's --prev-images-dir)
META = "snapshot.json"  # {"parent": number or null, "depth": deltas down to a whole part}
CHAIN_MAX = 8  # deltas on one whole part; then a whole one again, so that a chain (and a restore) stays short
PAGE = 4096
FILES = "files.json"  # the regular files the worker writes, as of the snapshot (proc/written_files.py)
_DUMPED = Exception("the part is dumped")  # why a part's undo stack is unwound once its dump is over: always


class Laps:
    """Where a part's time in the pause goes, step by step (seconds, rounded): each call ends the
    step it names.  Kept in the part's answer, so that an operator (and bench/snapshot_workers.py)
    sees which step grows with a rank's processes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def __call__(self, step: str) -> None:
        t = time.monotonic()
        self.seconds[step] = round(t - self._t, 4)
        self._t = t


def _meta(d: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((d / META).read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def files_of(d: Path) -> list[written_files.WrittenFile]:
    """The files a part's worker writes, as the snapshot recorded them (none for a part without)."""
    try:
        return written_files.load(json.loads((d / FILES).read_text()))
    except FileNotFoundError:
        return []


def checked(job: str, wid: str | None = None) -> None:
    """A job's name and a worker's id as the routes take them (agent_requests.JOB_PATTERN,
    WORKER_PATTERN): they name directories here, so `..` or a slash must never reach a path."""
    if not re.fullmatch(JOB_PATTERN, job) or len(job) > 128:
        raise InvalidRequest(f"bad job name {job!r}", action="name jobs with letters, digits, '.', '-' and '_', "
                                                              "beginning with a letter or digit")
    if wid is not None and (not re.fullmatch(WORKER_PATTERN, wid) or len(wid) > 200):
        raise InvalidRequest(f"bad worker id {wid!r}", action="a worker's id is its job's name, a dot and its rank")


def image_id(job: str, number: int, wid: str) -> str:
    """A part as an image id on the wire: letters, digits, '-' and '_' only, and one per part (a
    readable prefix and a digest of the job and worker exactly: `a.b` and `a_b` never share one)."""
    checked(job, wid)
    digest = hashlib.blake2b(f"{job}/{wid}".encode(), digest_size=6).hexdigest()
    out = f"snap-{re.sub(r'[^A-Za-z0-9]', '_', wid)[:48]}-{number}-{digest}"
    check_image_id(out)
    return out


@dataclass
class Replication:
    """This host's parts of one snapshot on their way to its buddy."""

    buddy: str
    done: threading.Event = field(default_factory=threading.Event)
    parts: dict[str, str] = field(default_factory=dict)  # worker id -> sending, replicated, failed
    error: str | None = None
    seconds: float | None = None
    bytes: int = 0


class Snapshots:
    def __init__(self, settings: AgentSettings, state: AgentState, source: "SourceSide",
                 dest: "DestinationSide") -> None:
        """The agent's settings and workers; its source side dumps and sends a part as a capture's
        would, its destination side restores one."""
        self.s, self.state, self.source, self.dest = settings, state, source, dest
        self.root = settings.images / "snapshots"
        self.lock = threading.Lock()
        self.replications: dict[tuple[str, int], Replication] = {}
        self.tracking = PartTracking()  # what each worker wrote since its last part
        self.dumping: dict[str, threading.Event] = {}  # worker -> set when its snapshot dump under way ends

    # -- where parts live ----------------------------------------------------------------------
    def _dir(self, job: str, number: int, side: str, wid: str | None = None) -> Path:
        checked(job, wid)
        d = self.root / job / str(number) / side
        return d / wid if wid else d

    def _workers(self, job: str, ids: list[str]) -> list[Worker]:
        ws = [self.state.worker(wid) for wid in dict.fromkeys(ids)]
        bad = [f"{w.id} belongs to job {w.job}" for w in ws if w.job != job]
        if bad:
            raise Conflict("; ".join(bad), action="name only the job's own workers")
        return ws

    @staticmethod
    def _own_net(w: Worker, cut: bool = False) -> workerns.WorkerNet | None:
        """The worker's own network namespace.  Required unless the job is parked at the NCCL shim's
        cut: its communicators are destroyed then, and the worker's other connections are its own
        affair on one host (restored where they can be, as a move does)."""
        net = workerns.from_dict(w.net)
        if net is None and not cut:
            raise FailedPrecondition(
                f"worker {w.id} shares its host's network: its connections could not be restored on another "
                "host, nor locked alone while every rank is dumped", code="snapshot_needs_address",
                action="start the job's ranks with `pitstop run --address` to take snapshots of it")
        return net

    def check(self, job: str, ids: list[str], cut: bool = False) -> None:
        """What makes a snapshot of these workers impossible, said before the job pauses."""
        for w in self._workers(job, ids):
            if w.state not in ("running", "paused"):
                raise Conflict(f"worker {w.id} is {w.state}", action="snapshots are taken of running workers")
            if w.container is not None:  # its runtime checkpoints it, and only whole (agent/containers.py)
                raise FailedPrecondition(
                    f"worker {w.id} is container {w.container.get('name') or w.container.get('id', '')[:12]}: "
                    "pitstop takes no snapshots of containers (a container moves; its recovery from a lost host "
                    "is not built)", code="snapshot_of_container",
                    action="run the job's ranks on the host (`pitstop run --address`) to have snapshots, or rely "
                           "on the job's own checkpoints for lost hosts")
            self._own_net(w, cut)
        self._check_budget(job, self._workers(job, ids))
        for w in self._workers(job, ids):
            try:
                self.track(w)
            except OSError as e:  # the tracking is a saving, never a condition
                log.warning("write tracking for snapshots failed; its parts are whole", worker=w.id, error=repr(e))

    def budget(self) -> int:
        """Bytes snapshots may hold here."""
        if self.s.snapshot_budget_mb:
            return self.s.snapshot_budget_mb << 20
        return shutil.disk_usage(self.s.images).total // 2

    def usage(self) -> int:
        """Bytes the snapshots hold here now (own parts and replicas)."""
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    continue
        return total

    def _estimate(self, job: str, w: Worker) -> int:
        """What the worker's next part will take: a whole dump holds every resident page of each
        process (a forked child's copy-on-write pages once more); a delta, about what the last one did."""
        at = self.tracking.last_part(w, job)
        if at is not None:
            last = _meta(self._dir(job, at, OWN, w.id))
            if last:
                return max(64 << 20, 2 * int(last.get("pages_written", 0)) * PAGE)
        return sum(proctree.rss_bytes(p) for p in proctree.tree(w.root_pid))

    def _check_budget(self, job: str, ws: list[Worker]) -> None:
        need = sum(self._estimate(job, w) for w in ws)
        used, budget = self.usage(), self.budget()
        if used + need > budget:
            raise FailedPrecondition(
                f"a snapshot of job {job} would take about {need >> 20} MiB on {self.s.name}, which holds "
                f"{used >> 20} MiB of snapshots already: over its budget of {budget >> 20} MiB",
                code="snapshot_budget", action="raise PITSTOP_AGENT_SNAPSHOT_BUDGET_MB on that host (the image "
                "directory must have the room), snapshot less often, or give the job hosts with more memory")

    # -- taking one ----------------------------------------------------------------------------
    def lock_net(self, job: str, ids: list[str], locked: bool, cut: bool = False) -> None:
        """Nothing in or out of the workers' namespaces: locked on every host before the first dump
        and lifted after the last, so that no byte is acknowledged by a rank already dumped and
        missing from the sender's images (or the reverse).  Never lifted under a dump under way."""
        if not locked:
            self.wait_dumps(ids, self.s.dump_timeout_s)
        nft = runtime.locate().nft
        for w in self._workers(job, ids):
            net = self._own_net(w, cut)
            if net is None:
                continue
            if locked:
                workerns.lock(net, nft)
            else:
                workerns.unlock(net, nft)

    def take(self, job: str, number: int, ids: list[str], buddy_url: str | None, cut: bool = False,
             whole: bool = False) -> dict[str, Any]:
        """Dump each worker, stopped by the coordinator's pause, leaving it as it was; then (after
        this returns and the job resumes) send the parts to the buddy.  A failure deletes this
        snapshot's parts here and raises: the job is resumed by the coordinator either way.
        whole: no part is a delta (the coordinator asks it when the buddy changed: a new buddy
        holds none of the parts a delta is against, and would refuse it)."""
        ws = self._workers(job, ids)
        for w in ws:
            if w.state != ("running" if cut else "paused"):  # parked at the cut, or stopped
                raise Conflict(f"worker {w.id} is {w.state}", action="the coordinator pauses the job first")
            self._own_net(w, cut)
        with self.lock:
            for w in ws:
                self.dumping.setdefault(w.id, threading.Event())
        try:
            return self._take(job, number, ws, buddy_url, cut, whole)
        finally:
            with self.lock:
                for w in ws:
                    ev = self.dumping.pop(w.id, None)
                    if ev is not None:
                        ev.set()

    def wait_dumps(self, ids: list[str], timeout_s: float) -> list[str]:
        """Wait (up to timeout_s) until no snapshot dump of these workers is under way; the ids still
        being dumped then.  Why: a resume or an unlock while CRIU holds a worker (a coordinator
        that restarted resumes the job of a snapshot it had begun) would let the worker run with its
        sockets in TCP repair mode, where every read fails (EPERM: seen, a gloo rank died of it)."""
        end = time.monotonic() + timeout_s
        for wid in dict.fromkeys(ids):
            with self.lock:
                ev = self.dumping.get(wid)
            if ev is not None:
                ev.wait(max(0.0, end - time.monotonic()))
        with self.lock:
            return [w for w in ids if w in self.dumping]

    def _take(self, job: str, number: int, ws: list[Worker], buddy_url: str | None, cut: bool,
              whole: bool) -> dict[str, Any]:
        base = self._dir(job, number, OWN)
        if base.exists():
            raise Conflict(f"snapshot {number} of job {job} already exists here", action="take the next number")
        base.mkdir(parents=True, mode=0o700)
        t0 = time.monotonic()
        results: dict[str, Any] = {}
        errors: list[BaseException] = []

        def one(w: Worker) -> None:
            try:
                results[w.id] = self._dump(w, base / w.id, job, number, whole)
            except BaseException as e:  # noqa: BLE001 - reported with the others
                if not isinstance(e, PitstopError):
                    log.exception("a snapshot's dump failed", worker=w.id)
                errors.append(e)

        threads = [threading.Thread(target=one, args=(w,), name=f"snap-{w.id}") for w in ws]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            shutil.rmtree(self.root / job / str(number), ignore_errors=True)
            e = errors[0]
            raise e if isinstance(e, PitstopError) else CaptureFailed(f"snapshot failed: {e!r}",
                                                                      action="see the agent's log")
        out = {"job": job, "number": number, "seconds": round(time.monotonic() - t0, 4), "parts": results}
        if buddy_url:
            rep = Replication(buddy=buddy_url, parts={w.id: "sending" for w in ws})
            with self.lock:
                self.replications[(job, number)] = rep
            threading.Thread(target=self._replicate, args=(job, number, ws, rep), daemon=True,
                             name=f"replicate-{job}-{number}").start()
        log.info("snapshot taken", job=job, number=number, workers=len(ws), seconds=out["seconds"])
        return out

    def _dump(self, w: Worker, d: Path, job: str, number: int, whole: bool = False) -> dict[str, Any]:
        """One worker's part, through the agent's one dump path (agent/dumper.py): CRIU's
        incremental dump against the part the tracking was last reset at, where the whole tree is
        tracked and the chain is short enough (and `whole` was not asked); else whole.  Then the
        tracking is reset (the job is still paused), so the next part holds what is written from
        now on.  The GPUs' suspension is an undo step: they run again whatever the dump did."""
        lap = Laps()
        pids = proctree.tree(w.root_pid)
        stdio = [p.__dict__ for p in proctree.stdio_pipes(pids)]
        parent, command = (None, None) if whole else self._parent_for(w, job, number)
        lap("tree")
        gpu = self.source.gpu.suspend(pids, rescan=lambda: proctree.tree(w.root_pid))
        lap("gpu")
        undo = Undo(resumed_by="the snapshot's dump (CRIU leaves the tree as it found it)")
        if gpu:
            undo.push("gpu", lambda e: self.source.gpu.resume_in_place(gpu.record()))
        try:
            faults.hit("snapshot:before_dump")
            res, parent = self._dump_part(w, d, parent, command)
            lap("criu")
            self.tracking.reset(w, number, pids)
            lap("track_reset")
            sealed = seal.take(d)  # a stat of each file, no byte read: checked before any restore of the part
            ids = file_identity.identities(pids)
            lap("seal_and_files")
        finally:
            undo.unwind(_DUMPED)
        (d / META).write_text(json.dumps({"parent": parent[0] if parent else None,
                                          "depth": parent[1] + 1 if parent else 0,
                                          "pages_written": res.pages_written, "pages_in_parent": res.pages_in_parent,
                                          "seal": sealed}))
        (d / FILES).write_text(json.dumps([f.to_dict() for f in written_files.written_files(pids)]))
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        manifest(w, d.name, host=self.s.name, stdio=stdio, output_base=self.source.output_end(w),
                 gpu=gpu.record() if gpu else {}, file_ids=ids, snapshot=True).write(d)  # last: the part is complete
        lap("manifest")
        return {"bytes": size, "dump_s": round(res.seconds, 4), "frozen_s": round(res.frozen_s, 4),
                "parent": parent[0] if parent else None, "bytes_in_parent": res.pages_in_parent * PAGE,
                "processes": len(pids), "steps": lap.seconds}

    def _dump_part(self, w: Worker, d: Path, parent: tuple[int, int] | None,
                   command: runtime.CriuCommand | None) -> tuple[criu_ops.DumpResult, tuple[int, int] | None]:
        """The dump itself; (its result, (the part it is against, that part's depth) or None)."""
        dumper = self.source.dumper
        # whole: with the dump's time recorded where a delta may follow it (CRIU's pid-reuse check)
        tracked = criutrack.command()[0] if self.tracking.tracked(w) else None
        whole = dumper.options(w, leave_running=True, track_mem=tracked is not None, command=tracked)
        if parent is None:
            return dumper.dump(w, d, whole), None
        d.mkdir(mode=0o700, exist_ok=True)
        os.symlink(f"../../../{parent[0]}/{OWN}/{w.id}", d / PARENT)  # from <job>/<n>/own/<wid>
        res, incremental = dumper.incremental_else_whole(
            w, d, dumper.options(w, leave_running=True, parent=PARENT, command=command), whole,
            overlap=True, log_name=f"snapshot-incremental-{w.id}.log")
        return res, parent if incremental else None

    # -- what changed since the last part (agent/part_tracking.py) -----------------------------
    def track(self, w: Worker) -> None:
        if self.source.precopies.track_writes():
            self.tracking.track(w)

    def _parent_for(self, w: Worker, job: str, number: int) -> tuple[tuple[int, int] | None, runtime.CriuCommand | None]:
        """((the part to dump against, its depth), the CRIU that can) where an incremental dump is
        right: the tracking was reset at that very part, which is still here and complete, and the
        chain is shorter than CHAIN_MAX.  Else (None, None).  A process not tracked (the namespace's
        init, a child forked since) reads as written throughout (native/criutrack.c): dumped whole."""
        at = self.tracking.last_part(w, job)
        if at is None or at >= number:
            return None, None
        prev = self._dir(job, at, OWN, w.id)
        if not (prev / MANIFEST).exists():
            return None, None
        depth = _meta(prev).get("depth", 0)
        if depth + 1 >= CHAIN_MAX:
            return None, None
        command, _ = criutrack.command()
        return ((at, depth), command) if command else (None, None)

    def _replicate(self, job: str, number: int, ws: list[Worker], rep: Replication) -> None:
        t0 = time.monotonic()
        for w in ws:
            try:
                faults.hit("snapshot:before_replicate")
                rep.bytes += self._send(self._dir(job, number, OWN, w.id), rep.buddy,
                                        image_id(job, number, w.id), keep=(job, number, w.id))
                rep.parts[w.id] = "replicated"
            except PitstopError as e:
                rep.parts[w.id] = "failed"
                rep.error = f"{w.id}: {e.message}"
                log.warning("a snapshot part was not replicated", job=job, number=number, worker=w.id,
                            buddy=rep.buddy, error=e.message)
                break
        rep.seconds = round(time.monotonic() - t0, 4)
        rep.done.set()

    def _send(self, d: Path, dest_url: str, iid: str, keep: tuple[str, int, str] | None = None) -> int:
        """Stream a complete part to another agent as image `iid`; with `keep`, that agent keeps it
        as a replica, else it stays there as an image to restore."""
        m = Manifest.read(d)
        tail = DirectoryTail(d)
        tail.manifest_base = m.model_copy(update={"files": []})
        tail.finished.set()
        errors: list[BaseException] = []
        done = [0.0]
        self.source.sender.send(dest_url, iid, tail, errors, done)
        if errors:
            e = errors[0]
            raise e if isinstance(e, PitstopError) else TransferFailed(repr(e), action="check the peer agent")
        with AgentClient(dest_url, self.s.cluster_token, timeout=self.s.transfer_timeout_s) as peer:
            peer.verify(iid)
            if keep:
                peer.keep_replica(iid, *keep)
        return tail.manifest.total_bytes if tail.manifest else 0

    def keep_replica(self, iid: str, job: str, number: int, wid: str) -> dict[str, Any]:
        """A verified image from a peer becomes that peer's replica here."""
        if iid != image_id(job, number, wid):
            raise Conflict(f"image {iid} is not part {wid} of snapshot {number} of job {job}",
                           action="name the image the part was sent as")
        src = self.dest.take_verified(iid)
        size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
        if self.usage() + size > self.budget():
            shutil.rmtree(src, ignore_errors=True)
            raise FailedPrecondition(f"{self.s.name} cannot keep a {size >> 20} MiB replica: it holds {self.usage() >> 20} "
                                     f"MiB of snapshots, and its budget is {self.budget() >> 20} MiB",
                                     code="snapshot_budget",
                                     action="raise PITSTOP_AGENT_SNAPSHOT_BUDGET_MB on that host, or add a spare")
        parent = _meta(src).get("parent")
        if parent is not None and not (self._dir(job, int(parent), REPLICA, wid) / MANIFEST).exists():
            shutil.rmtree(src, ignore_errors=True)
            raise FailedPrecondition(f"part {wid} of snapshot {number} is a delta against snapshot {parent}, whose "
                                     "replica is not here", code="replica_parent_missing",
                                     action="the next snapshot is taken whole")
        dst = self._dir(job, number, REPLICA, wid)
        shutil.rmtree(dst, ignore_errors=True)
        dst.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.rename(src, dst)
        if parent is not None:
            os.symlink(f"../../../{parent}/{REPLICA}/{wid}", dst / PARENT)
        return {"job": job, "number": number, "worker": wid, "kept": True}

    # -- what is here --------------------------------------------------------------------------
    def listing(self, job: str | None = None) -> list[dict[str, Any]]:
        """Every snapshot this host holds a part of, complete parts only, and its replications."""
        out = []
        for jd in sorted(self.root.glob("*")) if self.root.exists() else []:
            if job and jd.name != job:
                continue
            for nd in sorted(jd.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else -1):
                if not nd.name.isdigit():
                    continue
                number = int(nd.name)
                sides = {side: sorted(p.name for p in (nd / side).glob("*") if (p / MANIFEST).exists())
                         for side in (OWN, REPLICA)}
                rep = self.replications.get((jd.name, number))
                out.append({"job": jd.name, "number": number, **sides,
                            "replication": None if rep is None else {
                                "buddy": rep.buddy, "parts": dict(rep.parts), "done": rep.done.is_set(),
                                "error": rep.error, "seconds": rep.seconds, "bytes": rep.bytes}})
        return out

    def chain(self, job: str, number: int) -> set[int]:
        """`number` and every snapshot a part of it here is a delta against, down to whole parts."""
        out, todo = set(), [number]
        while todo:
            n = todo.pop()
            if n in out:
                continue
            out.add(n)
            for side in (OWN, REPLICA):
                for d in self._dir(job, n, side).glob("*"):
                    p = _meta(d).get("parent")
                    if p is not None:
                        todo.append(int(p))
        return out

    def drop(self, job: str, keep: int | None = None) -> list[int]:
        """Delete the job's snapshots here (own and replicas), all but `keep` and the parts it is a
        delta against, if given.  The coordinator keeps the job's committed snapshot, so `keep` is
        also what covers the job's ranks here from now on (None: nothing): their shims are told."""
        checked(job)
        self.protect(job, keep)
        jd = self.root / job
        dropped = []
        kept = self.chain(job, keep) if keep is not None and jd.exists() else set()
        for nd in list(jd.glob("*")) if jd.exists() else []:
            if nd.name.isdigit() and int(nd.name) not in kept:
                shutil.rmtree(nd, ignore_errors=True)
                dropped.append(int(nd.name))
                with self.lock:
                    self.replications.pop((job, int(nd.name)), None)
        if keep is None:
            shutil.rmtree(jd, ignore_errors=True)
        return sorted(dropped)

    def protect(self, job: str, number: int | None) -> None:
        """Tell the job's live ranks here which committed snapshot covers them (None: none): a rank
        whose collective fails on a peer's failure then waits in its NCCL shim for the recovery that
        rolls it back, instead of ending (shim/ctl.h `protect`; a worker without the shim, or one
        whose shim predates it, ends as before).  Written now; the agent's look at each worker's
        blocks writes it again where a block differs (a process made since, a rank restored)."""
        for w in [w for w in self.state.workers.values() if w.job == job]:
            if w.protected_by == number:
                continue
            self.state.update_worker(w, protected_by=number)
            if w.state in ("running", "paused"):
                try:
                    shimctl.protect(shimctl.headers(w.root_pid), number or 0)
                except OSError as e:  # the look writes it again
                    log.warning("could not tell a rank's NCCL shim of its snapshot", worker=w.id, error=repr(e))

    # -- recovery ------------------------------------------------------------------------------
    def _part(self, job: str, number: int, side: str, wid: str) -> Path:
        d = self._dir(job, number, side, wid)
        if not (d / MANIFEST).exists():
            raise NotFound(f"no complete {side} part of worker {wid} in snapshot {number} of job {job} here",
                           code="snapshot_part_missing",
                           action="the job cannot be rolled back to this snapshot; restart it from its own checkpoint")
        return d

    def stop(self, job: str, ids: list[str], why: str) -> list[str]:
        """End the job's workers here for a rollback (or a fence): each tree is killed and its
        namespace dropped, recorded first as `stopped`, so that its launcher follows the copy
        restored next instead of reporting the rank's end."""
        stopped = []
        for wid in dict.fromkeys(ids):
            w = self.state.workers.get(wid)
            if w is None or w.job != job:
                continue
            if w.state in ("running", "paused", "capturing", "stopped"):
                self.state.update_worker(w, state="stopped", reason=why)
                proctree.kill_and_wait(w.root_pid)
                stopped.append(wid)
            self.tracking.end(wid)
            net = workerns.from_dict(w.net)
            if net:
                workerns.destroy(net)
        return stopped

    def _verify(self, job: str, number: int, side: str, wid: str) -> None:
        """A part and every part it is a delta against are as they were written: own parts by the
        seal taken as CRIU finished (a stat of each file), replicas byte for byte against the
        digests they were received with.  Raised as IntegrityError before anything is stopped."""
        n: int | None = number
        while n is not None:
            d = self._part(job, n, side, wid)
            meta = _meta(d)
            try:
                if side == OWN and meta.get("seal") is not None:
                    seal.check(d, meta["seal"], ignore=(META, FILES, MANIFEST))
                elif side == REPLICA:
                    verify(d, Manifest.read(d))
            except IntegrityError as e:
                raise IntegrityError(f"part {wid} of snapshot {n} of job {job} ({side}) changed since it was "
                                     f"written: {e.message}", action="the job cannot be rolled back to this snapshot "
                                     "here; restart it from its own checkpoint, and find what wrote to the agent's "
                                     "image directory (only root can)", details=e.details) from None
            n = None if meta.get("parent") is None else int(meta["parent"])

    def check_files(self, job: str, number: int, ids: list[str], side: str) -> dict[str, Any]:
        """Whether the files these parts' workers write can be cut back to the snapshot (nothing is cut)."""
        out = {}
        for wid in dict.fromkeys(ids):
            self._verify(job, number, side, wid)
            d = self._part(job, number, side, wid)
            # what CRIU will reopen, checked now too: here for an own part; for a replica on its keeper (the
            # job's files are at the same paths on every host of the job), and again where it is restored
            m = Manifest.read(d)
            reopen = file_identity.Reopen.of(m.file_ids, m.host)
            try:
                out[wid] = written_files.cut_back(files_of(d), apply=False, same_host=side == OWN)
            except FailedPrecondition as e:
                more = reopen.problems(image_files.reopened(d), self.s.name)
                raise FailedPrecondition("; ".join([e.message, *more]), code=e.code, action=e.action) from None
            reopen.check(image_files.reopened(d), self.s.name)
        return {"workers": out}

    def restore(self, job: str, number: int, ids: list[str], side: str = OWN) -> dict[str, Any]:
        """Roll the job's workers back to snapshot `number` here, from this host's own parts or from
        replicas kept (or just received) here: every part and the files its worker writes checked
        first, then each running copy ended, its files cut back and its part restored, stopped as
        it was dumped (the coordinator resumes every rank of the job at once)."""
        parts = {wid: self._part(job, number, side, wid) for wid in dict.fromkeys(ids)}
        for wid, d in parts.items():
            self._verify(job, number, side, wid)
            written_files.cut_back(files_of(d), apply=False, same_host=side == OWN)
        self.stop(job, list(parts), f"rolled back to snapshot {number}")
        out = {}
        for wid, d in parts.items():
            cut = written_files.cut_back(files_of(d), same_host=side == OWN)
            out[wid] = {**self._restore_dir(d, fresh_net=side == REPLICA, protected_by=number), "files_cut_back": cut}
        return {"workers": out}

    def _restore_dir(self, d: Path, fresh_net: bool, protected_by: int | None = None) -> dict[str, Any]:
        """fresh_net: its network namespace gets a name of its own here (a lost host's rank on a
        spare), so that nothing of the old host's, should it come back, ever acts on it by name.
        protected_by: the committed snapshot it is restored from, which still covers the job (its
        shim's block, as dumped, says the one before)."""
        m = Manifest.read(d)
        wk = m.worker
        t0 = time.monotonic()
        faults.hit("snapshot:before_restore")
        net = m.net
        wn = workerns.from_dict(net)
        if wn and fresh_net:
            net = {**wn.to_dict(), "netns": f"{workerns.netns_name(str(wk['id']))}-{secrets.token_hex(3)}"}
        w = self.dest.restore_dir(d, RestoreOptions.of_manifest(m, net=net))
        if wk.get("snapshot_every_s"):
            self.state.update_worker(w, snapshot_every_s=float(wk["snapshot_every_s"]))
        if protected_by is not None:
            self.state.update_worker(w, protected_by=protected_by)
            shimctl.protect(shimctl.headers(w.root_pid), protected_by)
        self.paused(w)
        return {"pid": w.root_pid, "seconds": round(time.monotonic() - t0, 4)}

    def paused(self, w: Worker) -> None:
        """A restored part runs nothing until the coordinator resumes the whole job: it was dumped
        stopped and CRIU restores it so; its record says paused so that the job's resume reaches it."""
        self.state.update_worker(w, state="paused", paused_at=time.time())

    def send_replicas(self, job: str, number: int, ids: list[str], dest_url: str) -> dict[str, Any]:
        """Send the replicas of these workers to a spare, which keeps them as replicas and restores
        them: each part with the parts it is a delta against, the oldest first."""
        parts = {wid: self._part(job, number, REPLICA, wid) for wid in dict.fromkeys(ids)}
        out = {}
        for wid, d in parts.items():
            t0 = time.monotonic()
            chain = [number]
            while (p := _meta(self._dir(job, chain[-1], REPLICA, wid)).get("parent")) is not None:
                chain.append(int(p))
            n = 0
            for k in reversed(chain):
                n += self._send(self._part(job, k, REPLICA, wid), dest_url, image_id(job, k, wid), keep=(job, k, wid))
            out[wid] = {"bytes": n, "parts": len(chain), "seconds": round(time.monotonic() - t0, 4)}
        return {"workers": out}
