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
from pitstop.agent import containers, exitkeeper, leftovers, peercred, reclaim, restore_views, scope
from pitstop.agent.restore_kinds import PageFill, RestoreOptions, RestorePlan
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import LIVE_STATES, AgentState, Fill, Worker
from pitstop.agent.timeouts import OUTPUT_PUMP_DRAIN_S
from pitstop.criu import criu_ops, criufill, image_files, runtime
from pitstop.errors import Conflict, InvalidRequest, NotFound, PitstopError, RestoreFailed, Unavailable
from pitstop.gpu.checkpoint import GpuCheckpointer
from pitstop.memory import lazy_pages, precopy
from pitstop.network import workerns
from pitstop.proc import file_identity, proctree
from pitstop.transfer import dataport
from pitstop.transfer.manifest import Manifest, check_image_id
from pitstop.transfer.stream import FreeSpace, StreamReceiver, file_stats, verify_directory
from pitstop.undo import Undo

log = structlog.get_logger("pitstop.agent.restore")

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
            containers.forget(self.s, w, "its move was rolled back")
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
            opts = RestoreOptions.of_manifest(
                m, net={**m.net, "netns": netns} if m.net and netns else m.net, keep_peers=m.keep_peers,
                slurm_job=wk.get("slurm_job"), lazy=plan.lazy,
                pages_from=m.pages_from if plan.fill is PageFill.REMOTE else None, local_index=index)
            w, fill = self._restore(directory, opts, abort=s.abort, phases=sub_phases)
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
            w = containers.restored_worker(init, rec, wk, owner_uid=uids.pop() if len(uids) == 1 else 0)
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
        threading.Thread(target=containers.watch, args=(self.s, self.state, w), daemon=True,
                         name=f"ctr-{w.id}").start()
        self.discard(s.image_id, abandon=False)
        log.info("restored a container", worker=w.id, container=rec.get("name"), pid=init)
        return w, {"verify": t1 - t0, "restore": time.monotonic() - t1, **phases}

    def _check_criu_reads(self, s: Slot, plan: RestorePlan) -> None:
        ps = self.slots.get(plan.parent) if plan.parent else None
        restore_views.check_criu_reads(s.image_id, [s.directory, *([ps.directory] if ps else [])])

    def _restore_from(self, s: Slot, plan: RestorePlan) -> tuple[Path, Path | None]:
        """The directory CRIU restores from, and the local page server's index where a delta is
        filled lazily here: the slot itself, or a view of it that the plan's fill needs."""
        parent = self._link_parent(s, plan.parent) if plan.parent else None
        if plan.fill is not PageFill.LOCAL:
            return s.directory, None
        if parent is not None:
            return restore_views.lazy_delta_view(s.image_id, s.directory, parent)
        return restore_views.marked_view(s.image_id, s.directory), None

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
            self.state.end_fill(w, "filled", seconds=fill.seconds)
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
                                     reason=leftovers.UNFILLED + why + ended)
            log.error("restored worker stopped: its memory could not be filled", worker=w.id, reason=why + ended,
                      action="the move had committed; the job's own recovery takes over from here "
                             f"(see {fill.images / lazy_pages.LOG} before the images go)")
        else:
            log.warning("the lazy fill failed after the worker had ended on its own", worker=w.id, reason=why)
        self.state.end_fill(w, "failed", seconds=fill.seconds, reason=why)
        self.discard(image_id, abandon=False)

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

    def restore_dir(self, directory: Path, opts: RestoreOptions) -> Worker:
        """Restore whole images in `directory` (a rollback on the source, a snapshot's part);
        register the worker."""
        return self._restore(directory, opts)[0]

    def _restore(self, directory: Path, opts: RestoreOptions, *, abort: threading.Event | None = None,
                 phases: dict[str, float] | None = None) -> tuple[Worker, lazy_pages.LazyFill | None]:
        """Restore images in `directory`; register the result as a worker of this agent.  With
        `opts.lazy`, the running lazy-pages daemon is returned for the caller to watch."""
        with self.state.lock:
            old = self.state.workers.get(opts.worker_id)
            if old and old.state in LIVE_STATES and not opts.replace:
                raise Conflict(f"worker {opts.worker_id} already runs here", action="this would run it twice")
        # CRIU reopens these as root: none may have become a link or another's file since the dump
        (opts.reopen or file_identity.Reopen({}, "")).check(image_files.reopened(directory), self.s.name)
        try:  # its namespace's init works there: CRIU restores that working directory (nsinit.py)
            nsinit.ensure(opts.init_dir)
        except (ValueError, OSError) as e:
            raise RestoreFailed(f"cannot make the worker's init directory: {e}",
                                action="check that this agent may create the directory the worker's "
                                       "launcher chose (PITSTOP_INIT_DIRS on the source host)") from None
        pipes = _Pipes(opts.stdio)
        # Each step that leaves something behind pushes its way back; a failure unwinds them all
        # (pitstop/undo.py): the pipes, a namespace made here, the fill, a restored copy.
        undo = Undo(resumed_by="")
        undo.push("pipes", lambda e: pipes.close())
        try:
            pid, fill = self._bring_back(directory, opts, pipes, undo, abort, phases)
        except PitstopError as e:
            undo.unwind(e)
            raise
        wn = workerns.from_dict(opts.net)
        if wn:
            reset = workerns.reset_unrelated(wn, opts.keep_peers) if opts.keep_peers is not None else 0
            workerns.announce(wn)
            workerns.unlock(wn, runtime.locate().nft)
            log.info("worker address up here", worker=opts.worker_id, address=wn.address, reset_connections=reset)
        return self._register(pid, directory, opts, pipes, fill), fill

    def _bring_back(self, directory: Path, opts: RestoreOptions, pipes: "_Pipes", undo: Undo,
                    abort: threading.Event | None, phases: dict[str, float] | None) -> tuple[int, lazy_pages.LazyFill | None]:
        """The worker's address (locked until its sockets exist again), its fill, CRIU's restore,
        its GPUs: each with its way back on `undo`.  The restored tree's pid, and its fill."""
        wn = workerns.from_dict(opts.net)
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
            fill = self._start_fill(directory, opts.pages_from, opts.local_index) if opts.lazy else None
            if fill:
                undo.push("fill", lambda e: fill.kill())
                if phases is not None:
                    phases["fill_start"] = time.monotonic() - t_fill
            with nsinit.pinned(opts.init_dir):
                pid, _ = self._criu_restore(directory, pipes.inherit, net_fd, fill is not None, abort, phases)
            if fill and faults.value("restore:kill_fill"):  # held, so that it cannot finish first
                os.kill(fill.pid, signal.SIGSTOP)
            gone = fill.guard(pid) if fill else None
            if gone:  # the source stopped serving while the tree was restored: it must not run
                proctree.kill_tree(pid)
                raise RestoreFailed(f"the source stopped serving this worker's memory during its restore: {gone}",
                                    action="the move rolls back and the worker runs on from the source's "
                                           "full dump; check the source agent and the link, then retry")
            undo.push("copy", lambda e: proctree.discard_copy(pid))  # a copy without its GPU memory must never run
            pipes.handed_over()
            if opts.gpu:
                timings = self.gpu.resume_restored(pid, opts.gpu)
                if phases is not None:
                    phases.update(timings)
            return pid, fill
        finally:
            if net_fd is not None:
                os.close(net_fd)

    def _register(self, pid: int, directory: Path, opts: RestoreOptions, pipes: "_Pipes",
                  fill: lazy_pages.LazyFill | None) -> Worker:
        """The restored tree runs: its output pumped, its exit status kept, its cgroup, its record."""
        wid = opts.worker_id
        running = time.time()  # restored and reachable: its pause is over (the ledger's rank_pause_s)
        for stream in ("stdout", "stderr"):  # a fresh file: offsets are relative to output_base
            (self.outputs / f"{wid}.{stream}").unlink(missing_ok=True)
        pumps = [_start_pump(fd, self.outputs / f"{wid}.{stream}") for fd, stream in pipes.ours]
        started = proctree.start_time(pid) or 0
        # its exit status, should this agent restart (agent/exitkeeper.py)
        keeper = exitkeeper.start(wid, pid, started, owner=str(self.s.state_dir))
        # its own cgroup where systemd runs the host, pumps and keeper included (agent/scope.py)
        scope.place(wid, pid, more=tuple(p.pid for p in pumps) + ((keeper.pid,) if keeper else ()))
        if fill:  # the worker's memory depends on it: an agent restart must not take it down
            scope.place(wid + "-fill", fill.pid, more=fill.pids[1:])
        faults.hit("restore:before_register")  # the worker runs; a rollback may look for it meanwhile
        uids = peercred.process_uids(pid)  # the restored tree's owner, as the local socket checks callers
        # what the record held of its launcher and scheduler where it ran here before (a rollback):
        # the launcher still ends it, the Slurm job still owns it
        was = self.state.workers.get(wid)
        w = Worker(id=wid, job=opts.job, rank=opts.rank, root_pid=pid, start_time=started,
                   launcher=was.launcher if was else None, world=was.world if was else None,
                   slurm_job=opts.slurm_job or (was.slurm_job if was else None),
                   snapshot_every_s=was.snapshot_every_s if was else None,
                   protected_by=was.protected_by if was else None,
                   owner_uid=uids.pop() if len(uids) == 1 else 0,
                   restored=True, output_base=opts.output_base, net=opts.net, init_dir=opts.init_dir,
                   running_since=running, keeper=keeper.to_dict() if keeper else None,
                   fill=Fill(source=(opts.pages_from or {}).get("url"), images=str(directory)) if fill else None)
        with self.state.lock:
            self.state.workers[wid] = w
            self.state.save()
        threading.Thread(target=self._reap, args=(w, pumps), daemon=True, name=f"reap-{wid}").start()
        log.info("restored", worker=wid, pid=pid)
        return w

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

    def adopt(self) -> None:
        """After this agent restarted: watch the workers an earlier run of it restored.

        They outlived it (their own scope, KillMode=process, output pumps of their own), but
        they are no longer its children: their exit status is read through the pidfd their
        keeper holds (agent/exitkeeper.py), also for one that ended while no agent ran.  Where
        the kernel cannot do that (before Linux 6.15) they are reported as exited with the
        status unknown."""
        for w in list(self.state.workers.values()):
            if w.restored and w.state == "running":
                if w.container is not None:
                    threading.Thread(target=containers.watch, args=(self.s, self.state, w), daemon=True,
                                     name=f"adopted-{w.id}").start()
                else:
                    threading.Thread(target=self._watch_adopted, args=(w,), daemon=True,
                                     name=f"adopted-{w.id}").start()

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


class _Pipes:
    """The restored tree's stdio: a fresh pipe for each pipe it had, its ends handed to CRIU
    (inherit_fd), ours pumped into the worker's output files.  stdin is never forwarded: the
    worker reads EOF."""

    def __init__(self, stdio: list[dict[str, Any]]) -> None:
        self.inherit: dict[str, int] = {}  # CRIU's key -> the fd the restored tree gets
        self.ours: list[tuple[int, str]] = []  # (our read end, stream name)
        self._theirs: list[int] = []
        for p in stdio:
            r, wfd = os.pipe()
            if p["writable"]:
                self.inherit[p["key"]] = wfd
                self._theirs.append(wfd)
                self.ours.append((r, "stderr" if p["fd"] == 2 else "stdout"))
            else:
                self.inherit[p["key"]] = r
                self._theirs.append(r)
                os.close(wfd)

    def handed_over(self) -> None:
        """The restored tree holds its ends now: ours of theirs close."""
        for fd in self._theirs:
            os.close(fd)
        self._theirs.clear()

    def close(self) -> None:
        """Undo: the restore failed; every end closes."""
        for fd in self._theirs + [o[0] for o in self.ours]:
            os.close(fd)
        self._theirs.clear()
        self.ours.clear()


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
