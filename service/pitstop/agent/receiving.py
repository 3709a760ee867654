"""The arriving side of a move: receive images, verify them, restore the tree.

A restored tree is re-parented to this agent (a child subreaper), which pumps
its stdio into per-worker output files and collects its exit status, so that
`pitstop run` on the origin host keeps streaming output and exits with the
worker's code after the worker has moved (it reads both through its agent).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from pitstop import faults, nsinit
from pitstop.agent import containers, exitkeeper, peercred, reclaim, scope
from pitstop.agent.restore_kinds import PageFill, RestorePlan
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import LIVE_STATES, AgentState, Fill, Worker
from pitstop.agent.timeouts import OUTPUT_PUMP_DRAIN_S
from pitstop.criu import criu_ops, criufill, image_files, runtime
from pitstop.errors import Conflict, InvalidRequest, NotFound, PitstopError, RestoreFailed, Unavailable
from pitstop.gpu.checkpoint import GpuCheckpointer
from pitstop.memory import cowpages, lazy_pages, lazydelta, lazyrule, precopy
from pitstop.memory.dumpview import PAGE
from pitstop.network import workerns
from pitstop.proc import file_identity, proctree
from pitstop.transfer import dataport
from pitstop.transfer.manifest import Manifest, check_image_id
from pitstop.transfer.stream import FreeSpace, StreamReceiver, file_stats, verify_directory
from pitstop.undo import Undo

log = structlog.get_logger("pitstop.agent.restore")
LAZY_VIEW = "lazy"  # in a delta's slot: what a lazy restore of it reads (memory/lazydelta.py)
UNFILLED = "its memory could not be filled after a lazy restore: "  # a lost worker's reason

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Restored trees are orphaned when CRIU exits; as subreaper we inherit them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@dataclass
class Slot:
    image_id: str
    directory: Path
    receiver: StreamReceiver
    state: str = "receiving"  # receiving | complete | verified | failed
    started: float = 0.0
    finished: float = 0.0
    deadline: float = float("inf")  # time.monotonic() by which the reception must be complete
    # A restore in progress from this slot; set `abort` to have CRIU and its partial tree
    # killed (a rollback must never wait on, or compete with, a restore that hangs).
    abort: threading.Event = field(default_factory=threading.Event)
    idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))
    restored: str | None = None  # the worker a restore from this slot registered


def _set(e: threading.Event) -> threading.Event:
    e.set()
    return e


class DestinationSide:
    def __init__(self, settings: AgentSettings, state: AgentState) -> None:
        self.s = settings
        self.state = state
        self.slots: dict[str, Slot] = {}
        self.lock = threading.Lock()
        self.outputs = settings.state_dir / "output"
        self.gpu = GpuCheckpointer(settings.gpu_lock_timeout_s)
        self.outputs.mkdir(parents=True, exist_ok=True)
        self._criufill_logged = False

    # -- receiving -----------------------------------------------------------------------------
    def open_slot(self, image_id: str) -> Slot:
        """A reception starts (data port or HTTP): its directory, its space check and its deadline.
        Refused past `max_receptions` under way: each holds a thread, a 4 MiB buffer and, above all,
        a share of the image directory, which a peer with the token must not exhaust."""
        check_image_id(image_id)
        with self.lock:
            old = self.slots.get(image_id)
            if old and old.state in ("receiving", "complete"):
                raise Conflict(f"image {image_id} is already {old.state} here",
                               action="discard it first (DELETE /v1/images/{id})")
            under_way = sum(1 for s in self.slots.values() if s.state == "receiving")
            if under_way >= self.s.max_receptions:
                raise Unavailable(f"{self.s.name} already receives {under_way} image streams, its limit",
                                  code="too_many_receptions",
                                  action="the move fails and its source resumes; move fewer ranks to this "
                                         "agent at once, or raise PITSTOP_AGENT_MAX_RECEPTIONS on it")
            d = self.s.images / ("in-" + image_id)
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            d.chmod(0o700)
            space = FreeSpace(d, self.s.image_free_reserve_mb << 20, what=f"image {image_id} on {self.s.name}",
                              setting="PITSTOP_AGENT_IMAGE_FREE_RESERVE_MB")
            # The source streams while CRIU dumps, then allows the transfer its own timeout: so may this end
            now = time.monotonic()
            slot = Slot(image_id, d, StreamReceiver(d, space), started=now,
                        deadline=now + self.s.dump_timeout_s + self.s.transfer_timeout_s)
            self.slots[image_id] = slot
            return slot

    def fail_slot(self, slot: Slot) -> None:
        slot.receiver.close()
        slot.state = "failed"
        shutil.rmtree(slot.directory, ignore_errors=True)

    def slot(self, image_id: str) -> Slot:
        s = self.slots.get(image_id)
        if s is None:
            raise NotFound(f"no image {image_id!r} on this agent", action="send the images first")
        return s

    def discard(self, image_id: str, wait_s: float = 30.0, abandon: bool = True) -> None:
        """Drop a slot.  abandon (a rollback: the coordinator gave up on this move): a restore
        still running from it is killed first, and a worker it already registered is stopped,
        even one registered after the rollback looked for it: otherwise the rank would run
        here and on its source.  Not abandon: this agent is done with the images."""
        with self.lock:  # abort is set under the lock that restore_image reads it under
            s = self.slots.pop(image_id, None)
            if s and abandon:
                s.abort.set()
        if s:
            if abandon and not s.idle.wait(wait_s):
                log.error("a restore did not stop after it was abandoned", image=image_id)
            if abandon and s.restored:
                self.stop_abandoned(s.restored, "its move was rolled back after this agent restored it")
            s.receiver.close()
            if abandon:
                shutil.rmtree(s.directory, ignore_errors=True)
            else:  # done with: often while the job waits for this restore to return
                reclaim.later(s.directory)
        if not image_id.endswith(precopy.PRE_SUFFIX):  # the pre-copy it was a delta against goes with it
            self.discard(image_id + precopy.PRE_SUFFIX, abandon=False)

    def stop_abandoned(self, worker_id: str, why: str) -> None:
        """Stop a copy this agent restored for a move that did not commit."""
        w = self.state.workers.get(worker_id)
        if w is None or not w.restored or w.state not in LIVE_STATES:
            return
        self.state.update_worker(w, state="lost", reason=why + "; this copy was stopped (the source runs the rank)")
        proctree.discard_copy(w.root_pid)
        if w.container is not None:
            self._forget_container(w)
        log.warning("stopped a restored copy whose move was rolled back", worker=worker_id, reason=why)

    # -- restoring -----------------------------------------------------------------------------
    def verify_image(self, image_id: str) -> tuple[Manifest, float]:
        """Check the images at rest against the manifest, before the source is released.

        The receiver already hashed every byte as it wrote it and compared with the
        sender's manifest.  What can still go wrong is a change after that: any
        write, truncation or replacement changes a file's (size, mtime, inode), and
        then every file is read and hashed again.  A bad copy is refused while the
        source can still simply be resumed.
        """
        s = self.slot(image_id)
        if s.state not in ("complete", "verified"):
            raise Conflict(f"image {image_id} is {s.state}, not complete", action="send the images again")
        t0 = time.monotonic()
        m = Manifest.read(s.directory)
        if faults.value("image:corrupt"):
            _flip_a_byte(s.directory)
        if s.receiver.written_stat is None or file_stats(s.directory, m) != s.receiver.written_stat:
            try:
                m = verify_directory(s.directory)
            except PitstopError:
                self.discard(image_id)
                raise
            s.receiver.written_stat = file_stats(s.directory, m)
        s.state = "verified"
        return m, time.monotonic() - t0

    def take_verified(self, image_id: str) -> Path:
        """Hand a verified image's directory over to its keeper here (a snapshot's replica,
        agent/snapshots.py): the slot is forgotten and nothing of it is deleted."""
        self.verify_image(image_id)
        with self.lock:
            s = self.slots.pop(image_id)
        s.receiver.close()
        return s.directory

    def restore_image(self, image_id: str, netns: str | None = None) -> tuple[Worker, dict[str, float]]:
        """netns: the name its own network namespace takes here, where not the one it had (a
        recovered rank whose old host, cut off but alive, shares this machine's names: tests)."""
        s = self.slot(image_id)
        t0 = time.monotonic()
        m, _ = self.verify_image(image_id)  # cheap unless a file changed since it arrived
        if m.pre_copy_of:
            raise InvalidRequest(f"image {image_id} is a pre-copy, not a capture: it is restored as the parent "
                                 f"of image {m.pre_copy_of}", action=f"restore {m.pre_copy_of} instead")
        if m.container is not None:
            return self._restore_container(s, m, t0)
        plan = RestorePlan.of(m, self.s.lazy_restore)
        self._check_criu_reads(s, plan)
        t_view = time.monotonic()
        directory, index = self._restore_from(s, plan)
        t1 = time.monotonic()
        sub_phases: dict[str, float] = {"lazy_view": t1 - t_view} if directory != s.directory else {}
        faults.hit("restore:before_criu")
        wk = m.worker
        s.idle.clear()
        try:
            w, fill = self._restore(directory, worker_id=wk["id"], job=wk["job"], rank=int(wk["rank"]),
                                    stdio=[p.model_dump() for p in m.stdio], replace=True,
                                    output_base=m.output_base, gpu=m.gpu, phases=sub_phases,
                                    net={**m.net, "netns": netns} if m.net and netns else m.net,
                                    keep_peers=m.keep_peers, init_dir=wk.get("init_dir"), slurm_job=wk.get("slurm_job"),
                                    lazy=plan.lazy, abort=s.abort,
                                    pages_from=m.pages_from if plan.fill is PageFill.REMOTE else None,
                                    local_index=index, reopen=file_identity.Reopen.of(m.file_ids, m.host))
            with self.lock:
                s.restored = w.id
                abandoned = s.abort.is_set()  # discard() sets it under this lock
            if abandoned:  # a rollback discarded this move while CRIU restored it
                self.stop_abandoned(w.id, "its move was rolled back while it was being restored")
                if fill:  # only once the copy is gone: its unfilled pages would read as zeros
                    fill.kill()
                raise RestoreFailed(f"the restore of {image_id} was abandoned (its move was rolled back)",
                                    action="nothing to do: the source runs the worker")
        finally:
            s.idle.set()
        phases = {"verify": t1 - t0, "restore": time.monotonic() - t1, **sub_phases}
        if fill and faults.value("restore:kill_fill"):
            fill.proc.kill()
        if fill and fill.relay and faults.value("restore:kill_page_server"):
            fill.relay.kill()
        if fill:  # the images serve the fill: they go when it ends (_watch_fill)
            s.state = "filling"
            threading.Thread(target=self._watch_fill, args=(w, fill, image_id), daemon=True,
                             name=f"fill-{w.id}").start()
        else:
            self.discard(image_id, abandon=False)
        return w, phases

    def _restore_container(self, s: Slot, m: Manifest, t0: float) -> tuple[Worker, dict[str, float]]:
        """A container's checkpoint, restored by this host's container runtime (agent/containers.py):
        the container is re-created under its own id and name, and this agent keeps its record."""
        assert m.container is not None
        wk = m.worker
        t1 = time.monotonic()
        s.idle.clear()
        try:
            faults.hit("restore:before_criu")
            init, rec, phases = containers.restore(self.s, s.directory, m.container)
            uids = peercred.process_uids(init)
            w = Worker(id=wk["id"], job=wk["job"], rank=int(wk["rank"]), root_pid=init,
                       start_time=proctree.start_time(init) or 0, restored=True, container=rec,
                       launcher=containers.launcher_pid(init, rec), world=wk.get("world"),
                       slurm_job=wk.get("slurm_job"), snapshot_every_s=wk.get("snapshot_every_s"),
                       owner_uid=uids.pop() if len(uids) == 1 else 0, running_since=time.time())
            with self.state.lock:
                self.state.workers[w.id] = w
                self.state.save()
            with self.lock:
                s.restored = w.id
                abandoned = s.abort.is_set()
            if abandoned:
                self.stop_abandoned(w.id, "its move was rolled back while it was being restored")
                raise RestoreFailed(f"the restore of {s.image_id} was abandoned (its move was rolled back)",
                                    action="nothing to do: the source runs the worker")
        finally:
            s.idle.set()
        threading.Thread(target=self._watch_container, args=(w,), daemon=True, name=f"ctr-{w.id}").start()
        self.discard(s.image_id, abandon=False)
        log.info("restored a container", worker=w.id, container=rec.get("name"), pid=init)
        return w, {"verify": t1 - t0, "restore": time.monotonic() - t1, **phases}

    def _watch_container(self, w: Worker) -> None:
        """Until the restored container ends: its status is the container's, as its runtime says
        (its `pitstop run` reports it first, as a rule)."""
        while proctree.is_running(w.root_pid, w.start_time):
            time.sleep(0.5)
        if w.state != "running":
            return
        code = None
        try:
            rec = containers.podman(self.s).inspect((w.container or {}).get("id", ""))
            code = (rec or {}).get("State", {}).get("ExitCode")
        except PitstopError:
            pass
        if w.state == "running":
            self.state.update_worker(w, state="exited", exit_code=code, ended_at=time.time())
        log.info("restored container ended", worker=w.id, code=code)

    def _forget_container(self, w: Worker) -> None:
        try:
            containers.podman(self.s).remove((w.container or {}).get("id", ""))
        except PitstopError as e:
            log.warning("could not remove an abandoned container copy", worker=w.id, error=e.message)

    def _check_criu_reads(self, s: Slot, plan: RestorePlan) -> None:
        """An image whose children share pages with their parent (PE_COW, written by the CRIU pitstop
        carries, or by a pre-copy where it runs) restores only with that CRIU: a stock one would read
        those pages from the child's own pages file, where they are not, and restore garbage.
        Refused before CRIU runs."""
        rt = runtime.locate()
        if rt.carried:
            return
        ps = self.slots.get(plan.parent) if plan.parent else None
        tasks = sorted({pid for d in (s.directory, *([ps.directory] if ps else []))
                        for pid in cowpages.needs_carried_criu(d, rt.import_pycriu())})
        if tasks:
            raise RestoreFailed(f"image {s.image_id} was dumped by pitstop's CRIU: tasks {tasks} share pages with "
                                f"their parent (PE_COW), which this host's {rt.source} CRIU {rt.version_str} "
                                "cannot restore",
                                action="the move rolls back; run `pitstop provision-criu` on this host (it builds "
                                       "the carried CRIU; `pitstop doctor` says which CRIU runs), or move to a host "
                                       "that has it")

    def _restore_from(self, s: Slot, plan: RestorePlan) -> tuple[Path, Path | None]:
        """The directory CRIU restores from, and the local page server's index where a delta is
        filled lazily here: the slot itself, or a view of it that the plan's fill needs."""
        parent = self._link_parent(s, plan.parent) if plan.parent else None
        if plan.fill is not PageFill.LOCAL:
            return s.directory, None
        if parent is not None:
            return self._lazy_view(s, parent)
        return self._marked_view(s), None

    def _link_parent(self, s: Slot, parent_id: str) -> Path:
        """A delta's PE_PARENT pages are read from its pre-copy: CRIU follows `parent` in the images.
        The pre-copy's directory."""
        ps = self.slots.get(parent_id)
        if ps is None or ps.state not in ("complete", "verified"):
            raise RestoreFailed(f"image {s.image_id} is a delta against pre-copy {parent_id}, which is "
                                + ("not on this agent" if ps is None else f"{ps.state} here"),
                                action="the move rolls back; evacuate again (the pre-copy is sent again, "
                                       "or use `--no-pre-copy`)")
        self.verify_image(parent_id)
        link = s.directory / "parent"
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(ps.directory, s.directory))
        return ps.directory

    def _lazy_view(self, s: Slot, parent: Path) -> tuple[Path, Path]:
        """A delta restored lazily: CRIU's daemon cannot read its parent, so a local page server
        answers it (memory/lazydelta.py).  The view to restore from, and the server's index."""
        view = s.directory / LAZY_VIEW
        shutil.rmtree(view, ignore_errors=True)  # a restore tried before
        try:
            lazydelta.view(s.directory, parent, view)
        except OSError as e:
            raise RestoreFailed(f"cannot write the lazy view of image {s.image_id}: {e}",
                                action="the move rolls back; free space in the agent's image directory, or "
                                       "restore eagerly (PITSTOP_AGENT_LAZY_RESTORE=0)") from None
        return view, view / lazydelta.INDEX

    def _marked_view(self, s: Slot) -> Path:
        """A whole dump restored lazily from here: its pagemaps with pitstop's lazy marks, not
        CRIU's, which now and then mark nothing lazy (memory/lazyrule.py).  The view to restore from."""
        view = s.directory / LAZY_VIEW
        shutil.rmtree(view, ignore_errors=True)  # a restore tried before
        try:
            changed = lazyrule.view(s.directory, view, runtime.locate().import_pycriu())
        except OSError as e:
            raise RestoreFailed(f"cannot write the lazy view of image {s.image_id}: {e}",
                                action="the move rolls back; free space in the agent's image directory, or "
                                       "restore eagerly (PITSTOP_AGENT_LAZY_RESTORE=0)") from None
        if changed.made_lazy:
            log.info("pitstop marked pages lazy that CRIU did not", image=s.image_id,
                     made_lazy_bytes=changed.made_lazy * PAGE, made_eager_bytes=changed.made_eager * PAGE)
        return view

    def _watch_fill(self, w: Worker, fill: lazy_pages.LazyFill, image_id: str) -> None:
        """Until every page is in place the worker depends on the daemon: if it fails, stop the worker.

        A dead daemon's userfaultfd is dropped by the kernel and the pages it never filled would
        read as zeros: a rank computing on zeros is worse than a rank that is gone.  So the
        worker goes first, then the daemon.  A worker that ended while its fill failed (killed
        by the page relay, or crashed on a page that read as zero) is lost for the same reason.
        """
        ok, why = fill.wait(self.s.lazy_fill_timeout_s)
        if ok:
            log.info("memory filled", worker=w.id, seconds=round(fill.seconds, 3))
            self._fill_ended(w, "filled", seconds=fill.seconds)
            self.discard(image_id, abandon=False)
            return
        live = w.state in LIVE_STATES and proctree.exists(w.root_pid)
        if live:
            proctree.kill_tree(w.root_pid)
        fill.kill()
        if w.state in LIVE_STATES or (w.state == "exited" and w.exit_code != 0):
            code = "" if w.exit_code is None else f", exit code {w.exit_code}"
            ended = "" if live or w.state != "exited" else f" (it had already ended{code})"
            self.state.update_worker(w, state="lost",
                                     reason=UNFILLED + why + ended)
            log.error("restored worker stopped: its memory could not be filled", worker=w.id, reason=why + ended,
                      action="the move had committed; the job's own recovery takes over from here "
                             f"(see {fill.images / lazy_pages.LOG} before the images go)")
        else:
            log.warning("the lazy fill failed after the worker had ended on its own", worker=w.id, reason=why)
        self._fill_ended(w, "failed", seconds=fill.seconds, reason=why)
        self.discard(image_id, abandon=False)

    def _fill_ended(self, w: Worker, state: str, seconds: float | None = None, reason: str | None = None) -> None:
        if w.fill is not None:
            self.state.update_worker(w, fill=w.fill.model_copy(update={
                "state": state, "reason": reason, "ended": round(time.time(), 3),
                "seconds": round(seconds if seconds is not None else time.time() - w.fill.started, 3)}))

    def _criu_restore(self, directory: Path, inherit: dict[str, int], net_fd: int | None, lazy: bool,
                      abort: threading.Event | None, phases: dict[str, float] | None) -> tuple[int, float]:
        """CRIU's restore, its memory filled by UFFDIO_COPY where that is on and available
        (criu/criufill.py); the bytes it filled so go into the phases."""
        rt = runtime.locate()
        fill = self.s.restore_uffd_fill and not lazy
        why = criufill.unavailable(rt) if fill else ""
        if why and not self._criufill_logged:
            self._criufill_logged = True
            log.warning("restores fill memory at CRIU's page-fault rate: the UFFDIO_COPY fill is unavailable",
                        reason=why)
        with contextlib.ExitStack() as stack:
            command, report = stack.enter_context(criufill.preloaded(rt, self.s.state_dir)) if fill and not why \
                else (None, None)
            pid, secs = criu_ops.restore(directory, inherit, net_fd=net_fd, lazy=lazy, rt=rt,
                                         timeout_s=self.s.restore_timeout_s, abort=abort, command=command)
            if phases is not None:
                phases["criu_restore"] = secs
                if report is not None:
                    copied, left, threads = criufill.read_report(report)
                    phases["uffd_fill_bytes"] = float(copied)
                    phases["uffd_fill_left_bytes"] = float(left)
                    phases["uffd_fill_threads"] = float(threads)
        return pid, secs

    def restore_dir(self, directory: Path, *, worker_id: str, job: str, rank: int,
                    stdio: list[dict[str, Any]], replace: bool = False,
                    output_base: dict[str, int] | None = None, gpu: dict[str, Any] | None = None,
                    net: dict[str, str] | None = None, init_dir: str | None = None,
                    reopen: file_identity.Reopen | None = None) -> Worker:
        """Restore whole images in `directory` (a rollback on the source); register the worker."""
        return self._restore(directory, worker_id=worker_id, job=job, rank=rank, stdio=stdio, replace=replace,
                             output_base=output_base, gpu=gpu, net=net, init_dir=init_dir, reopen=reopen)[0]

    def _restore(self, directory: Path, *, worker_id: str, job: str, rank: int,
                 stdio: list[dict[str, Any]], replace: bool = False, slurm_job: str | None = None,
                 output_base: dict[str, int] | None = None, gpu: dict[str, Any] | None = None,
                 phases: dict[str, float] | None = None, net: dict[str, str] | None = None,
                 keep_peers: list[str] | None = None, lazy: bool = False,
                 abort: threading.Event | None = None,
                 pages_from: dict[str, Any] | None = None,
                 local_index: Path | None = None,
                 init_dir: str | None = None,
                 reopen: file_identity.Reopen | None = None) -> tuple[Worker, lazy_pages.LazyFill | None]:
        """Restore images in `directory`; register the result as a worker of this agent.

        lazy: restore post-copy, memory filled by a lazy-pages daemon after the worker runs
        again; the running daemon is returned for the caller to watch.  pages_from: the lazy
        pages are on the source (post-copy over the network): the daemon fetches them there.
        local_index: a delta and its pre-copy here, served to the daemon by a local page server.
        reopen: the files the dump found, which every path CRIU reopens here must still be
        (proc/file_identity.py); without it, paths through a symbolic link are still refused.
        """
        with self.state.lock:
            old = self.state.workers.get(worker_id)
            if old and old.state in LIVE_STATES and not replace:
                raise Conflict(f"worker {worker_id} already runs here", action="this would run it twice")
        # CRIU reopens these as root: none may have become a link or another's file since the dump
        (reopen or file_identity.Reopen({}, "")).check(image_files.reopened(directory), self.s.name)
        try:  # its namespace's init works there: CRIU restores that working directory (nsinit.py)
            nsinit.ensure(init_dir)
        except (ValueError, OSError) as e:
            raise RestoreFailed(f"cannot make the worker's init directory: {e}",
                                action="check that this agent may create the directory the worker's "
                                       "launcher chose (PITSTOP_INIT_DIRS on the source host)") from None
        inherit: dict[str, int] = {}
        ours: list[tuple[int, str, int]] = []  # (our fd, stream name, their fd number)
        theirs: list[int] = []
        for p in stdio:
            r, wfd = os.pipe()
            if p["writable"]:
                inherit[p["key"]] = wfd
                theirs.append(wfd)
                ours.append((r, "stderr" if p["fd"] == 2 else "stdout", p["fd"]))
            else:
                inherit[p["key"]] = r
                theirs.append(r)
                os.close(wfd)  # the worker reads EOF: stdin is never forwarded
        # Each step that leaves something behind pushes its way back; a failure unwinds them all
        # (pitstop/undo.py): the pipes, a namespace made here, the fill, a restored copy.
        undo = Undo(resumed_by="")

        def close_pipes(e: BaseException) -> None:
            for fd in theirs + [o[0] for o in ours]:
                os.close(fd)
            theirs.clear()

        undo.push("pipes", close_pipes)
        wn = workerns.from_dict(net)
        nft = runtime.locate().nft if wn else None
        net_fd = None
        try:
            if wn:  # the worker's address, here, locked until its sockets exist again
                if workerns.exists(wn):
                    workerns.lock(wn, nft)  # a rollback on the source: its namespace is still here
                else:
                    workerns.create(wn, self.s.worker_link, locked=True, nft=nft)
                    undo.push("network", lambda e: workerns.destroy(wn))
                net_fd = os.open(wn.path, os.O_RDONLY)
            t_fill = time.monotonic()
            fill = self._start_fill(directory, pages_from, local_index) if lazy else None
            if fill:
                undo.push("fill", lambda e: fill.kill())
                if phases is not None:
                    phases["fill_start"] = time.monotonic() - t_fill
            with nsinit.pinned(init_dir):
                pid, secs = self._criu_restore(directory, inherit, net_fd, fill is not None, abort, phases)
            if fill and faults.value("restore:kill_fill"):  # held, so that it cannot finish first
                os.kill(fill.pid, signal.SIGSTOP)
            gone = fill.guard(pid) if fill else None
            if gone:  # the source stopped serving while the tree was restored: it must not run
                proctree.kill_tree(pid)
                raise RestoreFailed(f"the source stopped serving this worker's memory during its restore: {gone}",
                                    action="the move rolls back and the worker runs on from the source's "
                                           "full dump; check the source agent and the link, then retry")
            undo.push("copy", lambda e: proctree.discard_copy(pid))  # a copy without its GPU memory must never run
            for fd in theirs:  # the restored tree holds its ends now
                os.close(fd)
            theirs.clear()
            if gpu:
                timings = self.gpu.resume_restored(pid, gpu)
                if phases is not None:
                    phases.update(timings)
        except PitstopError as e:
            undo.unwind(e)
            raise
        finally:
            if net_fd is not None:
                os.close(net_fd)
        if wn:
            reset = workerns.reset_unrelated(wn, keep_peers) if keep_peers is not None else 0
            workerns.announce(wn)
            workerns.unlock(wn, nft)
            log.info("worker address up here", worker=worker_id, address=wn.address, reset_connections=reset)
        running = time.time()  # restored and reachable: its pause is over (the ledger's rank_pause_s)
        for stream in ("stdout", "stderr"):  # a fresh file: offsets are relative to output_base
            (self.outputs / f"{worker_id}.{stream}").unlink(missing_ok=True)
        pumps = [_start_pump(fd, self.outputs / f"{worker_id}.{stream}") for fd, stream, _ in ours]
        started = proctree.start_time(pid) or 0
        # its exit status, should this agent restart (agent/exitkeeper.py)
        keeper = exitkeeper.start(worker_id, pid, started, owner=str(self.s.state_dir))
        # its own cgroup where systemd runs the host, pumps and keeper included (agent/scope.py)
        scope.place(worker_id, pid, more=tuple(p.pid for p in pumps) + ((keeper.pid,) if keeper else ()))
        if fill:  # the worker's memory depends on it: an agent restart must not take it down
            scope.place(worker_id + "-fill", fill.pid, more=fill.pids[1:])
        faults.hit("restore:before_register")  # the worker runs; a rollback may look for it meanwhile
        uids = peercred.process_uids(pid)  # the restored tree's owner, as the local socket checks callers
        # what the record held of its launcher and scheduler where it ran here before (a rollback):
        # the launcher still ends it, the Slurm job still owns it
        was = self.state.workers.get(worker_id)
        w = Worker(id=worker_id, job=job, rank=rank, root_pid=pid, start_time=started,
                   launcher=was.launcher if was else None, world=was.world if was else None,
                   slurm_job=slurm_job or (was.slurm_job if was else None),
                   snapshot_every_s=was.snapshot_every_s if was else None,
                   protected_by=was.protected_by if was else None,
                   owner_uid=uids.pop() if len(uids) == 1 else 0,
                   restored=True, output_base=output_base or {}, net=net, init_dir=init_dir, running_since=running,
                   keeper=keeper.to_dict() if keeper else None,
                   fill=Fill(source=(pages_from or {}).get("url"), images=str(directory)) if fill else None)
        with self.state.lock:
            self.state.workers[worker_id] = w
            self.state.save()
        threading.Thread(target=self._reap, args=(w, pumps), daemon=True, name=f"reap-{worker_id}").start()
        log.info("restored", worker=worker_id, pid=pid)
        return w, fill

    def _start_fill(self, directory: Path, pages_from: dict[str, Any] | None,
                    local_index: Path | None = None) -> lazy_pages.LazyFill:
        if not pages_from:
            return lazy_pages.start(directory, local_index=local_index,
                                    page_idle_timeout_s=self.s.lazy_page_idle_timeout_s)
        try:
            host = httpx.URL(str(pages_from["url"])).host
            sock = dataport.open_pages(host, int(pages_from["data_port"]), str(pages_from["image_id"]),
                                       self.s.cluster_token)
        except (KeyError, ValueError, OSError, PitstopError) as e:
            raise RestoreFailed(f"cannot reach the source that serves this worker's memory "
                                f"({pages_from.get('url')}, data port {pages_from.get('data_port')}): "
                                f"{getattr(e, 'message', None) or e!r}",
                                action="the move rolls back; check the source agent's data port, or move "
                                       "without post-copy (`pitstop evacuate --no-post-copy`)") from None
        try:
            return lazy_pages.start(directory, page_socket=sock, page_idle_timeout_s=self.s.lazy_page_idle_timeout_s)
        finally:
            sock.close()  # the daemon holds its own copy

    def _reap(self, w: Worker, pumps: list[subprocess.Popen]) -> None:
        try:
            _, status = os.waitpid(w.root_pid, 0)
            code: int | None = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            # Not our child (restore raced with CRIU's exit): poll until it is gone.
            while proctree.exists(w.root_pid):
                time.sleep(0.2)
            code = self._kept_status(w)
        for p in pumps:  # its last output is in the files before anyone hears it exited
            try:
                p.wait(OUTPUT_PUMP_DRAIN_S)
            except subprocess.TimeoutExpired:
                log.warning("an output pump outlived its worker", worker=w.id, pump=p.pid)
        self._ended(w, code)

    def _ended(self, w: Worker, code: int | None, reason: str | None = None) -> None:
        if w.state in ("running",):
            self.state.update_worker(w, state="exited", exit_code=code, reason=reason)
        if w.state == "exited":  # by itself, or killed by the agent, which said why first (agent/handles.py)
            nsinit.remove_unused(w.init_dir)  # its init removes it at a normal end, not when the tree is killed
            wn = workerns.from_dict(w.net)
            if wn:
                workerns.destroy(wn)
        exitkeeper.stop(exitkeeper.Keeper.from_dict(w.keeper))
        log.info("restored worker exited", worker=w.id, code=code, state=w.state)

    @staticmethod
    def _kept_status(w: Worker) -> int | None:
        k = exitkeeper.Keeper.from_dict(w.keeper)
        return exitkeeper.exit_status(k) if k else None

    def remove_stale_slots(self) -> list[str]:
        """At start: images an earlier run of this agent was receiving or restoring from.

        Slots live in memory, so every `in-*` directory found now belongs to a move that died
        with that process; its operation has failed and rolled back on the source.  One still
        in use (a lazy-pages daemon filling a worker it restored works in it) is kept."""
        busy = _dirs_in_use(self.s.images)
        gone = []
        for d in self.s.images.glob("in-*"):
            if not d.is_dir():
                continue
            if d in busy:  # a fill that outlived the previous agent: its images go when it ends
                threading.Thread(target=self._remove_when_unused, args=(d,), daemon=True,
                                 name=f"fill-images-{d.name}").start()
                continue
            self._settle_fills(d)
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
        for w in list(self.state.workers.values()):  # a fill whose images are gone ended too
            if w.fill and w.fill.state == "filling" and not Path(w.fill.images).exists():
                self._settle_fills(Path(w.fill.images))
        if gone:
            log.info("removed images of moves that died with the previous agent", slots=gone)
        return gone

    def _settle_fills(self, d: Path) -> None:
        """Record how the fills that worked in `d` ended, which nobody watched: the previous
        agent started them and the restart lost their daemons' exit status (lazy_pages.ended_unwatched)."""
        for w in list(self.state.workers.values()):
            if not (w.fill and w.fill.state == "filling" and d in (Path(w.fill.images), Path(w.fill.images).parent)):
                continue  # a delta's fill works in its slot's lazy view (_lazy_view)
            alive = proctree.is_running(w.root_pid, w.start_time)
            ok, why = lazy_pages.ended_unwatched(Path(w.fill.images), alive)
            if ok is False and w.state in ("running", "exited"):  # the relay stopped it, or it read zeros
                if alive:
                    proctree.kill_tree(w.root_pid)
                self.state.update_worker(w, state="lost", reason=UNFILLED + why)
            self._fill_ended(w, {True: "filled", False: "failed", None: "unknown"}[ok],
                             reason=why or "it ended while the agent was restarting")
            log.info("a fill that outlived the previous agent has ended", worker=w.id, state=w.fill.state,
                     reason=w.fill.reason)

    def _remove_when_unused(self, d: Path, every_s: float = 2.0) -> None:
        """Nobody watches a fill the previous agent started: its daemon (and page relay) end on
        their own, the relay stopping the worker if the source fails; then the images go."""
        log.info("a lazy fill outlived the previous agent; its images go when it ends", slot=d.name)
        while d.exists() and d in _dirs_in_use(self.s.images):
            time.sleep(every_s)
        self._settle_fills(d)
        shutil.rmtree(d, ignore_errors=True)
        log.info("removed the images of a fill that outlived the previous agent", slot=d.name)

    def adopt(self) -> None:
        """After this agent restarted: watch the workers an earlier run of it restored.

        They outlived it (their own scope, KillMode=process, output pumps of their own), but
        they are no longer its children: their exit status is read through the pidfd their
        keeper holds (agent/exitkeeper.py), also for one that ended while no agent ran.  Where
        the kernel cannot do that (before Linux 6.15) they are reported as exited with the
        status unknown."""
        for w in list(self.state.workers.values()):
            if w.restored and w.state == "running":
                watch = self._watch_container if w.container is not None else self._watch_adopted
                threading.Thread(target=watch, args=(w,), daemon=True, name=f"adopted-{w.id}").start()

    def _watch_adopted(self, w: Worker) -> None:
        while proctree.is_running(w.root_pid, w.start_time):
            time.sleep(0.2)
        code = self._kept_status(w)
        time.sleep(0.5)  # its pumps drain the last output
        if code is not None:
            self._ended(w, code)
        else:
            self._ended(w, None, reason="it ended while its agent was restarting: its exit status is unknown")

    def forget_output(self, w: Worker) -> None:
        """A restored worker that ended long ago is forgotten (AgentState.prune): its output goes too."""
        if w.restored:
            for stream in ("stdout", "stderr"):
                (self.outputs / f"{w.id}.{stream}").unlink(missing_ok=True)

    def read_output(self, worker_id: str, stream: str, offset: int, limit: int = 1 << 20) -> bytes:
        p = self.outputs / f"{worker_id}.{stream}"
        w = self.state.workers.get(worker_id)
        base = (w.output_base.get(stream, 0) if w else 0)
        if not p.exists() or offset < base:
            return b""
        with open(p, "rb") as f:
            f.seek(offset - base)
            return f.read(limit)


def _dirs_in_use(root: Path) -> set[Path]:
    """Directories directly under `root` that some process works in or holds a file of."""
    out: set[Path] = set()
    top = str(root.resolve()) + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        # One link at a time: a busy process (a lazy-pages daemon filling, the very one looked
        # for) closes fds between the listing and the readlink, and one fd gone must not hide
        # its other files and its working directory.
        links = []
        for link in ["cwd", *(f"fd/{fd}" for fd in _listdir(f"/proc/{pid}/fd"))]:
            try:
                links.append(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                continue
        for ln in links:
            if ln.startswith(top):
                out.add(root / ln[len(top):].split("/", 1)[0])
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # the process has gone, or its fd table is not ours to read
        return []


def _start_pump(fd: int, path: Path) -> subprocess.Popen:
    """Copy one stdio pipe of a restored worker into its output file, in a process of its own.

    Why not a thread of the agent: the agent would hold the pipe's read end, and when the agent
    restarts the worker's next write would fail (EPIPE; a Python job dies of the
    BrokenPipeError).  `cat` ends when the worker closes the pipe, and lives in the worker's
    scope, not the agent's."""
    with open(path, "ab") as out:
        p = subprocess.Popen(["cat"], stdin=fd, stdout=out, stderr=subprocess.DEVNULL, close_fds=True,
                             start_new_session=True)
    os.close(fd)
    return p


def _flip_a_byte(directory: Path) -> None:
    """Fault hook (image:corrupt): damage the copy at rest, as a bad disk or a bug would."""
    pages = max(directory.glob("pages-*.img"), key=lambda p: p.stat().st_size, default=None)
    if pages is not None and pages.stat().st_size > 4096:
        with open(pages, "r+b") as f:
            f.seek(4096)
            b = f.read(1)
            f.seek(4096)
            f.write(bytes([b[0] ^ 0xFF]))
