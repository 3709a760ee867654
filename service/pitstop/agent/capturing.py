"""The leaving side of a move: capture a registered worker, stream it, then
commit (the source is killed for good) or roll back (the source runs again).

States of a capture and who moves it on:
  dumping  --dump+stream ok-->  sent (or dumped, without a destination)
  dumping  --any failure----->  failed       (source resumed here, by itself)
  sent     --release--------->  released     (source killed; images kept)
  sent     --rollback-------->  rolled_back  (network lock lifted, source resumed)
  released --rollback-------->  rolled_back  (source restored here from its images)
  sent/released --commit----->  committed    (source gone, lock lifted, images deleted)

Why "released" exists: with TCP connections restored in the same network
namespace, CRIU cannot re-create a connection whose four-tuple the stopped
source still holds ("Cannot assign requested address"), so the source must be
gone before the destination restores.  Its images stay here until commit, so a
failed restore rolls back by restoring them on this host: nothing is lost.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import structlog

from pitstop import faults, nsinit, tls
from pitstop.agent import containers, reclaim
from pitstop.agent.capture_kinds import (
    DELTA,
    PARENT,
    VIEW,
    CaptureKind,
    CriuIncremental,
    PostCopyView,
    PreCopyDelta,
    Whole,
)
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Capture, Worker
from pitstop.agent.timeouts import PRECOPY_DISCARD_TIMEOUT_S, PRECOPY_STREAM_STOP_WAIT_S, STREAM_STOP_WAIT_S
from pitstop.container import config as container_config
from pitstop.criu import criu_ops, criutrack, netlock, runtime, seal
from pitstop.errors import (
    CaptureFailed,
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    IntegrityError,
    NotFound,
    PitstopError,
    TransferFailed,
    Unavailable,
)
from pitstop.gpu.checkpoint import GpuCheckpointer  # noqa: F401 - the type of self.gpu
from pitstop.memory import page_server, postcopy, precopy, writetrack
from pitstop.memory.precopy import Basis
from pitstop.network import workerns
from pitstop.proc import file_identity, proctree, procwindow
from pitstop.transfer import compress, dataport
from pitstop.transfer.compress import Compression
from pitstop.transfer.manifest import Manifest, StdioPipe, check_image_id
from pitstop.transfer.stream import DirectoryTail
from pitstop.undo import Undo
from pitstop.wire.agent_client import AgentClient

if TYPE_CHECKING:
    from pitstop.agent.receiving import DestinationSide

log = structlog.get_logger("pitstop.agent.capture")

PRE_DIR_PREFIX = "pre-"  # a pre-copy's images here, while sent (and kept for its capture: criutrack.py)
MAX_BASES = 64  # pre-copies whose capture has not come yet (an operation that died): the oldest go
NO_LAZY_NOTICE_BYTES = 16 << 20  # a post-copy dump this big with no lazy page is odd: its CRIU log is kept
DIAGNOSTICS_KEPT = 8



class PageSource:
    """A capture whose lazy pages this agent serves until the destination's fill has ended."""

    def __init__(self, cap: Capture, split: postcopy.LazySplit) -> None:
        self.cap, self.split = cap, split
        # Serving is over, the fill complete or its daemon gone (it never reconnects): after the
        # commit nothing needs the dump any more; before it, a rollback still restores from it.
        self.done = threading.Event()
        self.busy = threading.Lock()  # one daemon at a time per capture

    def progress(self, served: page_server.Served) -> None:
        if self.cap.post_copy is not None:
            self.cap.post_copy["pages_served"] = served.pages


class _Sender:
    """The thread that streams one capture's images to its destination, and its way back."""

    def __init__(self, side: "SourceSide", cap: Capture, tail: DirectoryTail, t0: float) -> None:
        self.tail = tail
        self.errors: list[BaseException] = []
        self._done = [t0]
        self.thread = threading.Thread(target=side._send, args=(cap, tail, self.errors, self._done),
                                       name=f"send-{cap.id}", daemon=True)
        self.started = False
        self.dest = cap.dest_url
        self._abandoned = False  # it outlived the transfer's deadline: not waited for again

    @property
    def done(self) -> float:
        return self._done[0]

    def start(self) -> None:
        self.started = True
        self.thread.start()

    def finish(self, timeout_s: float) -> None:
        """Wait for the stream to end; raise what went wrong (its error, or the deadline)."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self._abandoned = True
            raise TransferFailed(f"transfer to {self.dest} did not finish within {timeout_s:.0f} s",
                                 action="check the destination agent and the network between the hosts")
        if self.errors:
            e = self.errors[0]
            raise e if isinstance(e, PitstopError) else TransferFailed(f"transfer to {self.dest} failed: {e!r}")

    def stop(self, error: BaseException) -> None:
        """Undo: the stream ends with an error frame (the destination discards what it got)."""
        self.tail.failure = error if isinstance(error, Exception) else Exception(str(error))
        if self.started and not self._abandoned and self.thread.is_alive():
            self.thread.join(STREAM_STOP_WAIT_S)


class SourceSide:
    def __init__(self, settings: AgentSettings, state: AgentState, restorer: "DestinationSide") -> None:
        self.s = settings
        self.state = state
        self.restorer = restorer  # ..receiving.DestinationSide, for rollback by local restore
        self.gpu: GpuCheckpointer = restorer.gpu  # one driver handle per agent
        self._threads: dict[str, threading.Thread] = {}
        self.on_finished: Callable[[Capture], None] | None = None  # metrics, once per capture
        self._cwd_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.data_port: int | None = None  # this agent's data port, where it serves lazy pages
        self.page_sources: dict[str, PageSource] = {}  # by image id
        self._exiting: dict[str, tuple[int, int | None]] = {}  # released captures' sources, still exiting
        self.bases: dict[str, Basis] = {}  # pre-copies sent, by the image id of the move they serve
        self._expiring: dict[str, tuple[weakref.ref[Basis], float]] = {}  # kept ones: when they go
        self._sweeper: threading.Thread | None = None
        self.precopies: dict[str, dict[str, Any]] = {}  # pre-copies under way, by image id: what was sent
        self._precopy_stops: dict[str, threading.Event] = {}  # by image id: set to stop that pre-copy
        self._write_tracking_unavailable: str | None = None  # why not ("" when it is), once asked
        self._tracking: dict[str, Basis] = {}  # by capture id: write tracking still open
        self._criu_parent_logged = False

    # -- capture -----------------------------------------------------------------------------
    def start(self, worker_id: str, dest_url: str | None, image_id: str | None,
              keep_peers: list[str] | None = None, post_copy: bool | None = None) -> Capture:
        remote = self.settle_post_copy(post_copy, dest_url)
        with self.state.lock:
            w = self.state.worker(worker_id)
            self._check_capturable(w)
            if w.container is not None and remote:
                log.info("a container travels whole: its runtime's restore takes no post-copy", worker=w.id)
                remote = False
            cid = "cap-" + uuid.uuid4().hex[:12]
            cap = Capture(id=cid, worker_id=w.id, image_dir=str(self.s.images / cid),
                          dest_url=dest_url, image_id=image_id or (cid if dest_url else None),
                          keep_peers=keep_peers, want_post_copy=remote,
                          source_pid=w.root_pid, source_start_time=w.start_time)
            self.state.captures[cid] = cap
            self.state.update_worker(w, state="capturing")
        t = threading.Thread(target=self._run_and_report, args=(cap, w), name=f"capture-{cid}", daemon=True)
        self._threads[cid] = t
        t.start()
        return cap

    def _check_capturable(self, w: Worker) -> None:
        if w.state != "running":
            raise Conflict(f"worker {w.id} is {w.state}, not running", code="worker_not_running",
                           action="wait for the operation that holds it to finish")
        if not proctree.is_running(w.root_pid, w.start_time):
            self.state.update_worker(w, state="lost")
            raise FailedPrecondition(f"worker {w.id} (pid {w.root_pid}) is no longer running",
                                     code="worker_gone", action="nothing to capture; the worker exited")

    def post_copy_support(self) -> dict[str, Any]:
        """Whether this agent can serve a capture's pages after the resume (None: it can; else why
        not).  A capability, not a policy: whether a move uses it is the coordinator's decision
        (its PITSTOP_COORDINATOR_POST_COPY, or the evacuation's request), asked before anything
        pauses."""
        why = None
        if tls.enabled():
            why = "this agent's data port uses TLS, which the page protocol does not carry"
        elif not self.s.data_stream or not self.data_port:
            why = "this agent has no plain data port (PITSTOP_AGENT_DATA_STREAM=0)"
        return {"unavailable": why}

    def settle_post_copy(self, want: bool | None, dest_url: str | None, strict: bool = True) -> bool:
        """Whether a move from here goes network post-copy: what the caller asked (None or False:
        no), if this agent can.  Asked for and impossible: refused where `strict` (before anything
        stops); a pre-copy (not strict) just goes on without it."""
        if not dest_url or not want:
            return False
        why = self.post_copy_support()["unavailable"]
        if not why:
            return True
        if strict:
            raise FailedPrecondition(f"post-copy over the network was asked for, but {why}",
                                     code="post_copy_unavailable",
                                     action="evacuate without post-copy (the images travel whole)")
        return False

    def precopy(self, worker_id: str, dest_url: str, image_id: str, post_copy: bool | None = None) -> dict[str, Any]:
        """Send the running worker's memory to the destination ahead of its move (memory/precopy.py).

        Nothing pauses: the worker runs while its pages are read.  The capture of the move that
        follows (same image id) then sends only the pages that changed.  Skipped, not refused,
        where it would not help: a move with network post-copy sends no memory before the resume."""
        if self.settle_post_copy(post_copy, dest_url, strict=False):
            return {"image_id": image_id, "skipped": "the move uses network post-copy: no memory travels before "
                                                     "the resume"}
        check_image_id(image_id)
        with self.state.lock:
            w = self.state.worker(worker_id)
            self._check_capturable(w)
        if w.container is not None:
            return {"image_id": image_id, "skipped": "the worker is a container: its runtime checkpoints it whole "
                                                     "at the pause (docs/architecture.md, 'Ranks in containers')"}
        if w.restored and proctree.filling(proctree.tree(w.root_pid)):
            return {"image_id": image_id, "skipped": "the worker's memory is still being filled after its last move"}
        pids = proctree.tree(w.root_pid)
        need, free = precopy.anon_bytes(pids), shutil.disk_usage(self.s.images).free
        if need * 1.1 + (256 << 20) > free:  # held here until sent: leave room, with a margin, for dumps
            return {"image_id": image_id, "skipped": f"the pre-copy would hold about {need >> 20} MiB in "
                                                     f"{self.s.images}, which has {free >> 20} MiB free"}
        pre_id = image_id + precopy.PRE_SUFFIX
        t0 = time.monotonic()
        progress = {"image_id": image_id, "worker_id": w.id, "bytes_sent": 0, "bytes_total": need}
        with self.state.lock:
            if image_id in self.precopies:
                raise Conflict(f"a pre-copy for {image_id} is already under way",
                               action="wait for it (GET /v1/precopies shows its progress)")
            self.precopies[image_id] = progress
            stop = self._precopy_stops[image_id] = threading.Event()
            for old in [k for k, b in self.bases.items() if b.worker_id == w.id]:
                # An older pre-copy of this worker no move used: its tracking would keep the
                # memory registered (a second registration is refused), and its pages are stale.
                self.bases.pop(old).discard()
        try:
            basis = self._send_pre_copy(w, pids, dest_url, image_id, pre_id, progress, stop)
        finally:
            with self.state.lock:
                self.precopies.pop(image_id, None)
                self._precopy_stops.pop(image_id, None)
        with self.state.lock:
            late = any(c.image_id == image_id for c in self.state.captures.values())
            if not late:
                self.bases[image_id] = basis
                while len(self.bases) > MAX_BASES:
                    self.bases.pop(next(iter(self.bases))).discard()
                if basis.local is not None:
                    self._expire_later(image_id, basis)
        if late:  # its caller gave up waiting and the move went on without it: nobody will use it
            basis.discard()
            self._discard_at(dest_url, pre_id)
            raise DeadlineExceeded(f"the pre-copy for {image_id} ended after its move had started",
                                   action="none: the move sent everything; raise "
                                          "PITSTOP_COORDINATOR_PRECOPY_DEADLINE_S if this repeats")
        out = {"image_id": image_id, "parent_image_id": pre_id, **precopy.describe_basis(basis),
               "kept_for_incremental_dump": basis.local is not None,
               "seconds": round(time.monotonic() - t0, 4), "compression": progress.get("compression")}
        log.info("pre-copied", worker=w.id, dest=dest_url, **out)
        return out

    def stop_all_precopies(self) -> int:
        """At shutdown: every pre-copy under way ends within one 4 MiB read (its move sends
        everything instead, or its coordinator sees the agent gone and ends the move before
        anything pauses)."""
        with self.state.lock:
            stops = list(self._precopy_stops.values())
        for stop in stops:
            stop.set()
        return len(stops)

    def stop_precopy(self, image_id: str) -> dict[str, Any]:
        """Stop a pre-copy under way (its caller gave up on it): it ends within one 4 MiB read,
        its partial copy is discarded at the destination, and its POST answers 409 `aborted`.
        One that has ended and whose move has not come is dropped: its tracking ends, and the
        copy it kept here for CRIU's incremental dump (as big as the worker's memory) goes."""
        with self.state.lock:
            stop = self._precopy_stops.get(image_id)
            if stop is None:
                b = self.bases.pop(image_id, None)
                if b is not None:
                    b.discard()
                    return {"image_id": image_id, "discarded": True}
                raise NotFound(f"no pre-copy for {image_id} is under way here",
                               action="none: it has ended (GET /v1/precopies lists those under way)")
            stop.set()
            return dict(self.precopies[image_id], stopping=True)

    def _expire_later(self, image_id: str, basis: Basis) -> None:
        """Drop this kept pre-copy after precopy_keep_s unless a move takes it first.

        One sweeper thread for all of them, holding each only by a weak reference: a timer
        thread per pre-copy held its basis (page runs, digests) and a sleeping thread for the
        whole 15 minutes after its move had used it, which grew a busy agent's memory (about
        60 such threads per agent in the 200-move soak).  Called with the state lock held."""
        self._expiring[image_id] = (weakref.ref(basis), time.monotonic() + self.s.precopy_keep_s)
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep_bases, name="precopy-expiry", daemon=True)
            self._sweeper.start()

    def _sweep_bases(self) -> None:
        every = max(0.5, min(30.0, self.s.precopy_keep_s / 4))
        while True:
            time.sleep(every)
            now = time.monotonic()
            with self.state.lock:
                due = [(k, ref()) for k, (ref, at) in self._expiring.items() if at <= now or ref() is None]
                for k, _ in due:
                    del self._expiring[k]
                if not self._expiring:  # nothing left to watch: the next kept pre-copy starts another
                    self._sweeper = None
            for k, b in due:
                if b is not None:
                    self._expire_basis(k, b)
            if self._sweeper is not threading.current_thread():
                return

    def _expire_basis(self, image_id: str, basis: Basis) -> None:
        """A kept pre-copy whose move did not come within PITSTOP_AGENT_PRECOPY_KEEP_S (its
        coordinator died, say) must not hold its memory's worth of this host's RAM for ever."""
        with self.state.lock:
            if self.bases.get(image_id) is not basis:
                return
            self.bases.pop(image_id)
        log.warning("a pre-copy's move did not come; its copy here is dropped", image_id=image_id,
                    kept_s=self.s.precopy_keep_s)
        basis.discard()

    def _send_pre_copy(self, w: Worker, pids: list[int], dest_url: str, image_id: str,
                       pre_id: str, progress: dict[str, Any], stop: threading.Event) -> Basis:
        """Write the pre-copy here while streaming it to the destination as image `pre_id`; the
        local copy goes once sent (its pages wait in this agent's image directory until then).
        `progress["bytes_sent"]` follows the stream: a host's memory can take minutes to send,
        and the operator watching the evacuation should see it move."""
        d = self.s.images / (PRE_DIR_PREFIX + image_id)
        shutil.rmtree(d, ignore_errors=True)
        keep = False
        d.mkdir(parents=True, mode=0o700)
        tail = DirectoryTail(d, on_progress=lambda n: progress.__setitem__("bytes_sent", n),
                             compression=self._compression(dest_url))
        errors: list[BaseException] = []
        sender = threading.Thread(target=self.send_to, args=(dest_url, pre_id, tail, errors, [0.0]),
                                  name=f"precopy-{image_id}", daemon=True)
        sender.start()
        try:
            try:
                faults.hit("precopy:before_read")
                basis = precopy.snapshot(w.id, pids, d, stop=stop, track=self.track_writes())
            except BaseException as e:
                tail.failure = e if isinstance(e, Exception) else Exception(repr(e))
                raise
            tail.manifest_base = Manifest(capture_id="pre-" + image_id, criu_version=runtime.locate().version_str,
                                          worker={"id": w.id, "job": w.job, "rank": w.rank}, pre_copy_of=image_id)
            faults.hit("precopy:before_finish")
            if stop.is_set():  # given up on while its last pages went: the destination drops it
                tail.failure = precopy.stopped_error(w.id)
                raise tail.failure
            tail.finished.set()
            sender.join(self.s.transfer_timeout_s)
            progress["compression"] = tail.compression.summary()  # type: ignore[union-attr]
            if sender.is_alive() or errors:
                basis.close()
                raise errors[0] if errors else TransferFailed(
                    f"the pre-copy to {dest_url} did not finish within {self.s.transfer_timeout_s:.0f} s",
                    action="the move can go on without it; check the destination and the network")
            keep = basis.fully_tracked() and self._criu_parent() is not None
            if keep:  # CRIU's incremental dump will take it as its parent, and a rollback too
                basis.local = d
            return basis
        finally:
            if sender.is_alive():
                tail.failure = tail.failure or TransferFailed("pre-copy abandoned", action="none")
                sender.join(PRECOPY_STREAM_STOP_WAIT_S)
            if not keep:
                shutil.rmtree(d, ignore_errors=True)

    def _basis_for(self, cap: Capture, w: Worker) -> Basis | None:
        with self.state.lock:
            b = self.bases.pop(cap.image_id or "", None)
        if b is not None and b.worker_id != w.id:
            b.discard()
            return None
        return b

    def track_writes(self) -> bool:
        """Whether a pre-copy asks the kernel what the worker wrote (memory/writetrack.py); the
        kernel is asked once per agent."""
        if not self.s.precopy_write_tracking:
            return False
        if self._write_tracking_unavailable is None:
            self._write_tracking_unavailable = writetrack.unavailable() or ""
            if self._write_tracking_unavailable:
                log.warning("pre-copies hash every page at the pause: write tracking is unavailable",
                            reason=self._write_tracking_unavailable)
        return not self._write_tracking_unavailable

    def _criu_parent(self) -> runtime.CriuCommand | None:
        """The CRIU to dump a pre-copied worker incrementally with (criu/criutrack.py), or None
        where the full dump and pitstop's delta are used; the reason is logged once."""
        if not self.s.precopy_criu_parent:
            return None
        command, why = criutrack.command()
        if why and not self._criu_parent_logged:
            self._criu_parent_logged = True
            log.warning("a pre-copied worker's pause holds CRIU's full dump: its incremental dump is unavailable",
                        reason=why)
        return command

    def _incremental_dump(self, cap: Capture, w: Worker, images: Path, own_net: bool, overlap: bool,
                          basis: Basis, command: runtime.CriuCommand) -> criu_ops.DumpResult | None:
        """CRIU dumps only what the worker wrote since its pre-copy; the rest stays in the pre-copy,
        moved into the images as their `parent` (the source's own full copy until the move ends).
        None, with the images emptied, where CRIU could not: the caller dumps whole instead."""
        os.rename(basis.local, images / PARENT)  # type: ignore[arg-type]
        basis.local = None
        if faults.value("capture:break_parent"):  # CRIU then refuses the parent (no pid-reuse check)
            (images / PARENT / "inventory.img").unlink()
        try:
            res = self._dump(cap, w, images, own_net, overlap, parent=PARENT, command=command)
        except CaptureFailed as e:  # CRIU resumed the tree; its writes are still tracked
            log.warning("CRIU's incremental dump failed; dumping whole", capture=cap.id, worker=w.id,
                        reason=e.message)
            procwindow.clear_for_retry(images, 0)  # its log kept as dump-attempt0.log; the parent goes too
            self.state.update_capture(cap, phases={**cap.phases, "incremental_dump_failed": 1.0})
            return None
        with self.state.lock:
            self._tracking[cap.id] = basis  # ended once the source has exited (or resumed): _end_tracking
        self.state.update_capture(cap, pre_copy={
            "parent_bytes": res.pages_in_parent * precopy.PAGE, "changed_bytes": res.pages_written * precopy.PAGE,
            "seconds": 0.0, "tracked_tasks": sum(1 for t in basis.tasks.values() if t.tracker is not None),
            "digested_tasks": 0,
            "pre_copied_bytes": basis.bytes, "by": "criu"})
        return res

    def _delta(self, cap: Capture, images: Path, basis: Basis) -> None:
        """Write the delta against the pre-copy (memory/precopy.py): what travels instead of the dump."""
        try:
            faults.hit("precopy:before_delta")
            self._tracking[cap.id] = basis  # ended once the source has exited (or resumed): _end_tracking
            d = precopy.rewrite(images, images / DELTA, basis, end_tracking=False)
        except OSError as e:
            raise CaptureFailed(f"could not write the delta against the pre-copy: {e}",
                                action="the source is restored from its dump; evacuate again "
                                       "(`--no-pre-copy` sends the images whole)") from None
        why = {"untracked_reason": next(iter(basis.untracked.values()))} if basis.untracked else {}
        self.state.update_capture(cap, pre_copy={**precopy.describe_delta(d), "pre_copied_bytes": basis.bytes,
                                                 "by": "pitstop", **why},
                                  phases={**cap.phases, "delta": d.seconds})

    def _split(self, cap: Capture, images: Path) -> dict:
        """Split the dump (memory/postcopy.py) and offer its lazy pages on the data port."""
        t0 = time.monotonic()
        try:
            sp = postcopy.split(images, images / VIEW)
        except OSError as e:
            raise CaptureFailed(f"could not split the dump for post-copy: {e}",
                                action="the source is restored from its dump; move it without "
                                       "post-copy (`pitstop evacuate --no-post-copy`)") from None
        if sp.made_lazy_bytes:  # CRIU's stack test marked them eager: a dump it would have sent whole
            log.info("pitstop marked pages lazy that CRIU did not", capture=cap.id, worker=cap.worker_id,
                     made_lazy_bytes=sp.made_lazy_bytes, lazy_bytes=sp.lazy_bytes)
        if sp.lazy_bytes == 0 and sp.eager_bytes >= NO_LAZY_NOTICE_BYTES:
            # Only memory no lazy restore may leave out (locked, shared, huge-TLB) is left once
            # pitstop has marked the dump (memory/lazyrule.py): keep the log to see what it was.
            log.warning("post-copy found no lazy pages in the dump: all of it travels before the restore",
                        capture=cap.id, worker=cap.worker_id, eager_bytes=sp.eager_bytes,
                        dump_log=str(self.keep_diagnostic(images / criu_ops.DUMP_LOG, f"{cap.id}-dump.log")))
        self.page_sources[cap.image_id] = PageSource(cap, sp)  # type: ignore[index]
        self.state.update_capture(cap, post_copy={**postcopy.describe(sp), "pages_served": 0},
                                  phases={**cap.phases, "split": time.monotonic() - t0})
        return {"url": self.s.url, "data_port": self.data_port, "image_id": cap.image_id,
                "lazy_bytes": sp.lazy_bytes}

    def keep_diagnostic(self, src: Path, name: str) -> Path | None:
        """Copy a file that explains something odd out of an image directory (deleted after the
        move) into <state dir>/diagnostics, keeping the newest DIAGNOSTICS_KEPT."""
        d = self.s.state_dir / "diagnostics"
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(src, d / name)
            for old in sorted(d.iterdir(), key=lambda f: f.stat().st_mtime)[:-DIAGNOSTICS_KEPT]:
                old.unlink(missing_ok=True)
            return d / name
        except OSError as e:
            log.warning("could not keep a diagnostic file", src=str(src), error=repr(e))
            return None

    def pages_for(self, image_id: str) -> Callable[["object"], None]:
        """For the data port: who answers a lazy-pages daemon asking for `image_id`'s pages."""
        src = self.page_sources.get(image_id)
        if src is None or src.cap.state not in ("sent", "released", "committed"):
            raise NotFound(f"no lazy pages of image {image_id!r} are served here",
                           action="the move was rolled back or its fill has ended; nothing to fetch")

        def serve(conn: "object") -> None:
            if not src.busy.acquire(blocking=False):
                raise Conflict(f"the lazy pages of {image_id} are already being fetched", action="none")
            cap = src.cap

            def progress(served: page_server.Served) -> None:
                src.progress(served)
                faults.hit("postcopy:after_reply")

            try:
                served = page_server.serve(
                    conn, src.split, idle_timeout_s=min(self.s.lazy_fill_timeout_s, 60.0),  # type: ignore[arg-type]
                    stop_after=int(faults.value("postcopy:stop_after_pages") or 0) or None,
                    stall_after=int(faults.value("postcopy:stall_after_pages") or 0) or None,
                    on_progress=progress)
                log.info("lazy pages served", capture=cap.id, pages=served.pages, requests=served.requests,
                         seconds=round(served.seconds, 3))
            finally:
                src.busy.release()
                if cap.post_copy is not None:
                    self.state.update_capture(cap, post_copy=dict(cap.post_copy))
                src.done.set()
                if cap.state == "committed":
                    self._drop_page_source(image_id)

        return serve

    def _drop_page_source(self, image_id: str | None) -> None:
        src = self.page_sources.pop(image_id or "", None)
        if src is not None:
            shutil.rmtree(src.cap.image_dir, ignore_errors=True)

    def _run_and_report(self, cap: Capture, w: Worker) -> None:
        try:
            self._run(cap, w)
        except IntegrityError as e:  # a rollback refused images altered at rest: the source stays stopped
            err = {**e.to_dict(), "details": {**e.details, "source_resumed_by": "nobody: it is left stopped"}}
            self.state.update_capture(cap, state="failed", error=err)
            log.error("capture failed and its rollback was refused", capture=cap.id, worker=w.id, error=e.message)
        finally:
            if cap.state not in ("sent", "dumped"):  # failed: the source runs on where it was
                self._end_tracking(cap.id)
            if self.on_finished:
                self.on_finished(cap)
            self._threads.pop(cap.id, None)  # wait() then reads the state: the capture is over

    def _end_tracking(self, cid: str) -> None:
        """Close the capture's write tracking (its userfaultfds of the source tree)."""
        with self.state.lock:
            b = self._tracking.pop(cid, None)
        if b is not None:
            b.close()

    def _wait_for_fill(self, cap: Capture, w: Worker) -> None:
        """A worker restored post-copy is dumped only once its memory is all in place."""
        if not w.restored:
            return
        t0 = time.monotonic()
        deadline = t0 + self.s.capture_fill_wait_s
        while pending := proctree.filling(proctree.tree(w.root_pid)):
            if time.monotonic() >= deadline:
                raise CaptureFailed(
                    f"worker {w.id}'s memory is still being filled after its last post-copy move "
                    f"(pids {pending} have memory a lazy-pages daemon has not filled yet, after "
                    f"{self.s.capture_fill_wait_s:g} s); a dump now would lose those pages",
                    code="worker_filling", http_status=409,
                    action="retry when the fill has ended (the destination agent logs 'memory filled'), "
                           "or raise PITSTOP_AGENT_CAPTURE_FILL_WAIT_S")
            time.sleep(0.02)
        waited = time.monotonic() - t0
        if waited > 0.001:
            log.info("waited for the worker's post-copy fill before dumping it", capture=cap.id, worker=w.id,
                     seconds=round(waited, 3))
            self.state.update_capture(cap, phases={**cap.phases, "wait_fill": waited})

    def _choose(self, cap: Capture, w: Worker) -> CaptureKind:
        """How this capture travels (agent/capture_kinds.py), decided once, before anything stops."""
        if cap.want_post_copy:  # settled as the capture began (settle_post_copy)
            return PostCopyView()
        basis = self._basis_for(cap, w) if cap.dest_url else None
        if basis is None:
            return Whole()
        command = self._criu_parent() if basis.local is not None else None
        return CriuIncremental(basis, command) if command else PreCopyDelta(basis)

    def _run(self, cap: Capture, w: Worker) -> None:
        """The capture's steps; each one that changes something pushes its way back onto one undo
        stack (pitstop/undo.py), which a failure unwinds before the capture is recorded failed."""
        undo = Undo(resumed_by="nobody (it was never stopped)")
        try:
            self._capture(cap, w, undo)
        except PitstopError as e:
            undo.unwind(e)  # a refused rollback (IntegrityError) goes up: the source is left stopped
            self._fail(cap, w, e, resumed_by=undo.resumed_by)

    def _capture(self, cap: Capture, w: Worker, undo: Undo) -> None:
        if w.container is not None:
            return self._capture_container(cap, w, undo)
        self._wait_for_fill(cap, w)
        images = Path(cap.image_dir)
        images.mkdir(parents=True, exist_ok=True)
        images.chmod(0o700)
        pids = proctree.tree(w.root_pid)
        stdio = [p.__dict__ for p in proctree.stdio_pipes(pids)]
        self.state.update_capture(cap, stdio=stdio)
        kind = self._choose(cap, w)
        swd = self.s.stream_while_dumping
        tail = DirectoryTail(kind.streamed(images), on_progress=lambda n: setattr(cap, "bytes_sent", n),
                             dedup=dedup_pages(self.s.dedup_pages, len(pids), tls.enabled()) and kind.whole,
                             compression=self._compression(cap.dest_url) if cap.dest_url else None)
        t0 = time.monotonic()
        sender = _Sender(self, cap, tail, t0) if cap.dest_url else None
        stop_stream = sender.stop if sender else lambda e: setattr(tail, "failure", e)
        undo.push("stream", stop_stream)
        if sender and kind.stream_start(swd) == "before_dump":
            sender.start()

        # Stop the worker's world: its own network namespace (nothing in or out until it runs
        # again, here or there), then its GPUs (CRIU must see a process that holds none).
        net = workerns.from_dict(w.net)
        nft = runtime.locate().nft if net else None
        cap.stopped_at = time.time()  # the pause this rank saw begins (ledger); saved with the dump's record
        undo.stage("pitstop (GPU lock undone)",
                   push=(("network", lambda e: workerns.unlock(net, nft)),) if net else ())
        if net:
            workerns.lock(net, nft)
        suspended = self.gpu.suspend(pids, rescan=lambda: proctree.tree(w.root_pid))  # undone if it fails
        if suspended:
            undo.push("gpu", lambda e: self._resume_gpu(cap))  # after CRIU let the tree run again
            self.state.update_capture(cap, gpu=suspended.record())
            if isinstance(kind, (PreCopyDelta, CriuIncremental)) and kind.basis.distrust(
                    {p.pid for p in suspended.procs}, "it began to use a GPU after its pre-copy"):
                # its pre-copied memory may have been written by the device unseen: its delta is
                # cut by digest from a full dump (CRIU's incremental dump would trust the tracking)
                kind = kind.distrusted()
                tail.directory = kind.streamed(images)
        faults.hit("capture:before_dump")

        # The dump: CRIU stops the tree; should it fail, CRIU lets the tree run again.
        undo.stage("criu")
        t_dump = time.monotonic()
        # Overlap with other dumps in its directory only where nothing streams while it dumps: a
        # dump that collides is redone from scratch (proc/procwindow.py).
        overlap = not (sender is not None and kind.stream_start(swd) == "before_dump")
        dumped = kind.dump(self, cap, w, images, net is not None, overlap)
        res, kind = dumped.result, dumped.kind
        tail.directory = kind.streamed(images)
        dump_end = time.monotonic()
        # the files the tree had, as it had them: what each path CRIU reopens must still be (sealed below)
        file_ids = file_identity.Reopen.write(str(images), proctree.tree(w.root_pid), self.s.name)
        gpu_phases = {"gpu_lock": suspended.lock_s, "gpu_checkpoint": suspended.checkpoint_s,
                      "gpu_rounds": float(suspended.rounds), "gpu_processes": float(len(suspended.procs))} \
            if suspended else {}
        self.state.update_capture(cap, run_id=res.run_id, seal=seal.take(images), phases={
            **cap.phases, **gpu_phases, "before_dump": t_dump - t0,
            "freeze": res.stats.get("freezing_time", 0) / 1e6, "dump": res.seconds,
            "frozen": res.frozen_s, "memdump": res.memdump_s})
        self.state.update_worker(w, state="stopped")
        # From here the source is stopped and whole: the way back is restoring it from its own
        # dump (which takes its network and GPUs back with it), after the stream has stopped.
        undo.stage("pitstop", replace=("gpu", "network", "stream"),
                   push=(("rollback", lambda e: self._rollback_stopped(cap, w)),
                         ("stream", stop_stream)))
        if sender and kind.stream_start(swd) == "after_dump":
            sender.start()
        pages_from, parent = kind.after_dump(self, cap, images)
        if not kind.whole:  # their views hard-link the dump's files, which changes their ctime: sealed again
            self.state.update_capture(cap, seal=seal.take(images))
        tail.manifest_base = Manifest(capture_id=cap.id, stdio=[StdioPipe(**d) for d in stdio],
                                      criu_version=runtime.locate().version_str, output_base=self.output_end(w),
                                      worker={"id": w.id, "job": w.job, "rank": w.rank,
                                              **({"init_dir": w.init_dir} if w.init_dir else {}),
                                              **({"slurm_job": w.slurm_job} if w.slurm_job else {})}, gpu=cap.gpu,
                                      net=w.net, keep_peers=cap.keep_peers, pages_from=pages_from, parent=parent,
                                      file_ids=file_ids, host=self.s.name)
        tail.finished.set()
        if sender is None:
            total = sum(f.stat().st_size for f in images.iterdir() if not f.name.endswith(".log"))
            self.state.update_capture(cap, state="dumped", bytes_total=total)
            log.info("captured", capture=cap.id, worker=w.id, kind=kind.name, **cap.phases)
            return
        if not sender.started:
            sender.start()
        sender.finish(self.s.transfer_timeout_s)  # raises what went wrong; the undo restores the source
        sealed = cap.seal
        if tail.manifest is not None and tail.directory == images and sealed is not None:
            sealed = seal.add_digests(sealed, {f.name: f.digest for f in tail.manifest.files})
        ph = dict(cap.phases)
        ph["transfer"] = sender.done - t0
        ph["transfer_after_dump"] = max(0.0, sender.done - dump_end)
        self.state.update_capture(cap, state="sent", phases=ph, seal=sealed,
                                  bytes_total=tail.manifest.total_bytes if tail.manifest else cap.bytes_sent,
                                  bytes_deduplicated=tail.index.bytes_saved if tail.index else 0,
                                  compression=tail.compression.summary() if tail.compression else None)
        log.info("captured and sent", capture=cap.id, worker=w.id, dest=cap.dest_url, kind=kind.name,
                 bytes=cap.bytes_total, deduplicated=cap.bytes_deduplicated,
                 **{k: round(v, 4) for k, v in ph.items()})

    def _capture_container(self, cap: Capture, w: Worker, undo: Undo) -> None:
        """A container's capture (container/podman.py): its runtime checkpoints it, CRIU writing the
        images straight into this capture's directory, which streams to the destination as they
        are written, with the container's own files after them.  The container's processes are
        gone once it is checkpointed: from there the way back is restoring it here from those
        images, as its runtime does (_restore_container_here)."""
        ctr = dict(w.container or {})
        images = Path(cap.image_dir)
        images.mkdir(parents=True, exist_ok=True)
        images.chmod(0o700)
        tail = DirectoryTail(images, on_progress=lambda n: setattr(cap, "bytes_sent", n),
                             compression=self._compression(cap.dest_url) if cap.dest_url else None)
        t0 = time.monotonic()
        sender = _Sender(self, cap, tail, t0) if cap.dest_url else None
        stop_stream = sender.stop if sender else lambda e: setattr(tail, "failure", e)
        undo.push("stream", stop_stream)
        if sender and self.s.stream_while_dumping:
            sender.start()
        cap.stopped_at = time.time()
        undo.stage("pitstop (GPU lock undone)")
        suspended = self.gpu.suspend(proctree.tree(w.root_pid), rescan=lambda: proctree.tree(w.root_pid))
        if suspended:
            undo.push("gpu", lambda e: self._resume_gpu(cap))
            self.state.update_capture(cap, gpu=suspended.record())
        faults.hit("capture:before_dump")
        # A checkpoint that fails leaves the container running: runc's CRIU thaws it
        undo.stage("the container runtime (the checkpoint failed; the container ran on)")
        t_dump = time.monotonic()
        export = images.parent / f"{cap.id}.export.tar"
        try:
            stats = containers.podman(self.s).checkpoint(ctr["id"], ctr.get("static_dir", ""), images, export,
                                                         timeout_s=self.s.dump_timeout_s + 60)
            container_config.keep_from_export(export, images)
        except (OSError, ValueError) as e:
            raise CaptureFailed(f"the container's checkpoint could not be kept: {e}",
                                action="the container is restored here from its images; see the agent's log") from None
        finally:
            export.unlink(missing_ok=True)
        dump_end = time.monotonic()
        self.state.update_capture(cap, run_id=_run_id(images), seal=seal.take(images), phases={
            **cap.phases, "before_dump": t_dump - t0, "freeze": stats.get("freezing_time", 0.0),
            "dump": dump_end - t_dump, "frozen": stats.get("frozen_time", 0.0),
            "memdump": stats.get("memdump_time", 0.0), "runtime_checkpoint": stats.get("runtime_checkpoint", 0.0)})
        self.state.update_worker(w, state="stopped")
        undo.stage("pitstop", replace=("gpu", "stream"),
                   push=(("rollback", lambda e: self._restore_container_here(cap, w)), ("stream", stop_stream)))
        faults.hit("capture:after_dump")
        tail.manifest_base = Manifest(capture_id=cap.id, criu_version=runtime.locate().version_str,
                                      worker={"id": w.id, "job": w.job, "rank": w.rank,
                                              **({"world": w.world} if w.world else {}),
                                              **({"slurm_job": w.slurm_job} if w.slurm_job else {}),
                                              **({"snapshot_every_s": w.snapshot_every_s}
                                                 if w.snapshot_every_s else {})},
                                      gpu=cap.gpu, keep_peers=cap.keep_peers, container=ctr, host=self.s.name)
        tail.finished.set()
        if sender is None:
            total = sum(f.stat().st_size for f in images.iterdir() if f.is_file())
            self.state.update_capture(cap, state="dumped", bytes_total=total)
            log.info("captured", capture=cap.id, worker=w.id, kind="container", **cap.phases)
            return
        if not sender.started:
            sender.start()
        sender.finish(self.s.transfer_timeout_s)
        ph = {**cap.phases, "transfer": sender.done - t0, "transfer_after_dump": max(0.0, sender.done - dump_end)}
        self.state.update_capture(cap, state="sent", phases=ph,
                                  bytes_total=tail.manifest.total_bytes if tail.manifest else cap.bytes_sent,
                                  compression=tail.compression.summary() if tail.compression else None)
        log.info("captured and sent", capture=cap.id, worker=w.id, dest=cap.dest_url, kind="container",
                 bytes=cap.bytes_total, **{k: round(v, 4) for k, v in ph.items()})

    def _restore_container_here(self, cap: Capture, w: Worker) -> str:
        """Bring a checkpointed container back on this host, from its own images, as its runtime
        restores it (the rollback of a container's move)."""
        self._check_seal(cap)
        faults.hit("rollback:before_restore")
        init, here, _ = containers.restore(self.s, Path(cap.image_dir), w.container or {})
        netlock.release(cap.run_id)
        self.state.update_worker(w, state="running", root_pid=init, start_time=proctree.start_time(init) or 0,
                                 container=here, launcher=containers.launcher_pid(init, here) or w.launcher,
                                 running_since=time.time(), paused_at=None)
        return f"restored here as container {here.get('name')} (pid {init})"

    def reconcile(self) -> list[str]:
        """After an agent restart: captures whose thread died with the previous agent process.

        The worker must end up running where it was.  A dump that completed left it stopped
        with its sockets in repair mode: it is restored from those images, as a rollback
        would.  A dump that never completed (CRIU unfreezes on failure, or never started)
        leaves a process that only needs its network, GPU and SIGSTOP state undone."""
        notes = []
        for d in self.s.images.glob(PRE_DIR_PREFIX + "*"):  # pre-copies live in memory: theirs died with it
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
                notes.append(f"{d.name}: a pre-copy kept for a move that never came, removed")
        for cap in self.state.captures.values():  # a dump kept to serve lazy pages died with its server
            if cap.state == "committed" and Path(cap.image_dir).exists():
                shutil.rmtree(cap.image_dir, ignore_errors=True)
                notes.append(f"{cap.id}: its dump, kept for a post-copy fill, removed")
        for cap in self.state.captures.values():  # failed rollbacks: their images still expire
            if cap.rollback_failed_at is not None and cap.state in ("sent", "dumped", "released"):
                self._expire_images_later(cap)
                notes.append(f"{cap.id}: its rollback failed; its images expire as set")
        for cap in [c for c in self.state.captures.values() if c.state == "dumping"]:
            w = self.state.workers.get(cap.worker_id)
            how = "worker unknown"
            try:
                if w and proctree.is_running(w.root_pid, w.start_time):
                    images = Path(cap.image_dir)
                    if proctree.state(w.root_pid) == "T" and (images / "stats-dump").exists():
                        how = self._rollback_stopped(cap, w)
                    else:
                        net = workerns.from_dict(w.net)
                        if net:
                            workerns.unlock(net, runtime.locate().nft)
                        proctree.resume(proctree.tree(w.root_pid))
                        self._resume_gpu(cap)
                        self.state.update_worker(w, state="running")
                        how = "resumed in place (the dump never completed)"
                elif w:
                    self.state.update_worker(w, state="lost")
                    how = "the worker is gone"
            except PitstopError as e:
                how = f"could not be resumed: {e.message}"
            netlock.release(cap.run_id)
            shutil.rmtree(cap.image_dir, ignore_errors=True)
            self.state.update_capture(cap, state="failed", error={
                "code": "agent_restarted", "message": f"the agent restarted during capture {cap.id}; {how}",
                "action": "evacuate again when the agent is healthy", "details": {}})
            notes.append(f"{cap.id}: {how}")
            log.warning("capture interrupted by an agent restart", capture=cap.id, outcome=how)
        return notes

    def _dump(self, cap: Capture, w: Worker, images: Path, own_net: bool, overlap: bool,
              parent: str | None = None, command: runtime.CriuCommand | None = None) -> criu_ops.DumpResult:
        attempt = 0
        while True:
            attempt += 1
            lock, cwd = self._cwd_lock(w.root_pid)
            try:
                with procwindow.DumpStartWindow(lock, cwd if overlap else ""):
                    res = criu_ops.dump(w.root_pid, images, timeout_s=self.s.dump_timeout_s,
                                        own_netns=workerns.netns_inode(w.root_pid) if own_net else None,
                                        parent=parent, command=command,
                                        log_level=criutrack.LOG_LEVEL if parent else 4)
                if attempt > 1:
                    self.state.update_capture(cap, phases={**cap.phases, "dump_attempts": attempt})
                return res
            except CaptureFailed as e:
                if not (overlap and attempt < procwindow.ATTEMPTS and procwindow.collided(e.details)) or parent:
                    raise
                log.info("the dump met another dump's /proc mount point; dumping again", capture=cap.id,
                         worker=w.id, attempt=attempt)
                procwindow.clear_for_retry(images, attempt)

    def _cwd_lock(self, pid: int) -> tuple[threading.Lock, str]:
        """One dump at a time per working directory *starts* (proc/procwindow.py).

        A worker is not in the host's PID namespace, so CRIU's parasite mounts a private
        /proc at a fixed name ("proc.crtools") in the task's working directory; two
        concurrent dumps of ranks sharing a directory race on that mkdir (EEXIST).
        """
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        with self._locks_guard:
            return self._cwd_locks.setdefault(cwd, threading.Lock()), cwd

    def output_end(self, w: Worker) -> dict[str, int]:
        """Where this host's copy of the worker's output ends: the next host continues from there."""
        if not w.restored:
            return {}
        out = {}
        for stream in ("stdout", "stderr"):
            p = self.restorer.outputs / f"{w.id}.{stream}"
            out[stream] = w.output_base.get(stream, 0) + (p.stat().st_size if p.exists() else 0)
        return out

    def _send(self, cap: Capture, tail: DirectoryTail, errors: list[BaseException], done: list[float]) -> None:
        self.send_to(cap.dest_url, cap.image_id, tail, errors, done)  # type: ignore[arg-type]

    def send_to(self, dest_url: str, image_id: str, tail: DirectoryTail, errors: list[BaseException],
                 done: list[float]) -> None:
        url = f"{dest_url.rstrip('/')}/v1/images/{image_id}"
        try:
            with AgentClient(dest_url, self.s.cluster_token, timeout=self.s.transfer_timeout_s) as dest:
                port = dest.data_port() if self.s.data_stream else None
                pieces = _cut(iter(tail), faults.value("transfer:cut_after"))
                if port:  # the fast path: a socket of its own (transfer/dataport.py)
                    dataport.send(pieces, httpx.URL(url).host, port, image_id, self.s.cluster_token,
                                  timeout_s=self.s.transfer_timeout_s, compression=tail.compression)
                    return
                try:
                    dest.put_images(image_id, pieces, timeout=httpx.Timeout(self.s.transfer_timeout_s, connect=10))
                except (Unavailable, DeadlineExceeded):
                    raise
                except PitstopError as e:
                    errors.append(TransferFailed(f"destination refused the images: {e.message}",
                                                 action=e.action or "check the destination agent",
                                                 details={"status": e.http_status}))
        except (Unavailable, DeadlineExceeded) as e:
            errors.append(TransferFailed(f"transfer to {url} failed: {e.message}",
                                         action="the source was resumed; check the destination agent"))
        except PitstopError as e:
            errors.append(e)
        except OSError as e:  # the data port: refused, reset, timed out
            errors.append(TransferFailed(f"transfer to {dest_url} failed: {e!r}",
                                         action="the source was resumed; check the destination agent"))
        finally:
            done[0] = time.monotonic()

    def _discard_at(self, dest_url: str, image_id: str) -> None:
        try:
            with AgentClient(dest_url, self.s.cluster_token, timeout=PRECOPY_DISCARD_TIMEOUT_S) as dest:
                dest.discard(image_id, timeout=PRECOPY_DISCARD_TIMEOUT_S)
        except PitstopError as e:
            log.warning("could not discard a pre-copy nobody will use", dest=dest_url, image=image_id, error=e.message)

    def _compression(self, dest_url: str) -> Compression:
        """A stream's compression, with what this agent learned of sending to `dest_url` before;
        `auto` never compresses towards this machine's own loopback (compress.same_host)."""
        mode, why = self.s.compress, None
        if mode == "auto" and compress.same_host(httpx.URL(dest_url).host):
            mode, why = "off", "auto: the destination is on this machine's loopback"
        return Compression(mode, level=self.s.compress_level, threads=self.s.compress_threads,
                           link=compress.link_for(dest_url), reason=why)

    def _fail(self, cap: Capture, w: Worker, e: BaseException, resumed_by: str) -> None:
        err: dict[str, Any] = e.to_dict() if isinstance(e, PitstopError) else {"code": "internal", "message": repr(e)}
        err["details"] = {**err.get("details", {}), "source_resumed_by": resumed_by}
        self.page_sources.pop(cap.image_id or "", None)
        self.state.update_capture(cap, state="failed", error=err)
        w = self.state.workers.get(w.id, w)
        state = "running" if proctree.exists(w.root_pid) else "lost"
        self.state.update_worker(w, state=state)
        shutil.rmtree(cap.image_dir, ignore_errors=True)
        log.warning("capture failed; source resumed", capture=cap.id, worker=w.id, error=err["message"])

    def _rollback_stopped(self, cap: Capture, w: Worker) -> str:
        """Bring a stopped source back by restoring it here from its own, complete images.

        Resuming it in place would mean taking its sockets out of TCP repair mode by hand.
        Measured (test_corrupt_image_refused_before_criu_and_source_resumes, 2026-11-29):
        that broke or silently corrupted a gloo stream in 3 of 15 runs (then 0 of 10; the rarer
        divergence seen later was torch's MKL race, docs/reliability.md).  CRIU's restore
        re-creates each connection exactly as dumped.  The dump's nftables lock stays until
        the restored sockets exist, so no peer packet ever meets a missing socket (an RST);
        killing the source first is silent, because its sockets are still in repair mode.
        """
        if w.container is not None:  # checkpointed: its processes are gone already
            return self._restore_container_here(cap, w)
        self._check_seal(cap)  # before the kill: refused, the source stays as it is (stopped)
        proctree.kill_and_wait(w.root_pid)
        faults.hit("rollback:before_restore")
        restored = self.restorer.restore_dir(Path(cap.image_dir), worker_id=w.id, job=w.job, rank=w.rank,
                                             stdio=cap.stdio, replace=True, output_base=self.output_end(w),
                                             gpu=cap.gpu, net=w.net, init_dir=w.init_dir,
                                             reopen=file_identity.Reopen.read(cap.image_dir))
        netlock.release(cap.run_id)
        return f"restored here as pid {restored.root_pid}"

    @staticmethod
    def _check_seal(cap: Capture) -> None:
        """Nothing restores from the source's own images unless they are as the dump left them."""
        if cap.seal is None:  # an agent that died in the instant between the dump and its seal
            log.warning("restoring an unsealed dump (the agent stopped as the dump ended); only its "
                        "directory's owner, root, could have changed it", capture=cap.id)
            return
        seal.check(Path(cap.image_dir), cap.seal)

    def _await_exit(self, cid: str, timeout_s: float = 10.0) -> None:
        """Wait for a released source to be gone: its memory is freed while the copy restores,
        and what comes after (commit, rollback) reuses its namespaces' names."""
        pid, started = self._exiting.pop(cid, (0, None))
        if not pid:
            return
        if proctree.is_running(pid, started):  # it ran on idle time while the copy restored: no longer
            proctree.set_policy(proctree.tree(pid), os.SCHED_OTHER)
        if not proctree.wait_gone(pid, started, timeout_s):
            log.warning("a released source has not exited", capture=cid, pid=pid, waited_s=timeout_s)

    def _drop_net(self, w: Worker) -> None:
        net = workerns.from_dict(w.net)
        if net:
            workerns.destroy(net)

    def _resume_gpu(self, cap: Capture) -> None:
        if cap.gpu:
            self.gpu.resume_in_place(cap.gpu)

    # -- after the copy is safe ----------------------------------------------------------------
    def release(self, cid: str) -> Capture:
        cap = self.state.capture(cid)
        if cap.state == "released":
            return cap
        if cap.state not in ("sent", "dumped"):
            raise Conflict(f"capture {cid} is {cap.state}; only a sent capture can be released",
                           action="wait until the images are sent")
        w = self.state.worker(cap.worker_id)
        if w.container is not None:  # its runtime ended its processes as it checkpointed it
            self.state.update_capture(cap, state="released", phases={**cap.phases, "release": 0.0})
            self.state.update_worker(w, state="released")
            return cap
        t0 = time.monotonic()
        started = proctree.start_time(w.root_pid)
        # its ports free now, its memory freed while the copy restores; or the exit waited for
        why = "PITSTOP_AGENT_RELEASE_WAIT_EXIT is set" if self.s.release_wait_exit else proctree.let_go(w.root_pid)
        if why is None:
            # Its write tracking ends after its exit (commit, rollback): closed now, the kernel would
            # first clear the write protection of every page the exiting tree still maps.
            self._exiting[cid] = (w.root_pid, started)
        else:
            log.info("the source's exit is waited for", capture=cid, worker=w.id, because=why)
            if not proctree.kill_and_wait(w.root_pid):
                raise CaptureFailed(f"source pid {w.root_pid} did not exit after SIGKILL", action="inspect the host")
            self._end_tracking(cid)
        self._drop_net(w)  # its address must be gone from here before it appears at the destination
        self.state.update_capture(cap, state="released", phases={**cap.phases, "release": time.monotonic() - t0})
        self.state.update_worker(w, state="released")
        return cap

    def commit(self, cid: str, moved_to: dict[str, str]) -> Capture:
        cap = self.state.capture(cid)
        if cap.state == "committed":
            return cap
        if cap.state not in ("sent", "released", "dumped"):
            raise Conflict(f"capture {cid} is {cap.state}; it cannot be committed",
                           action="only a capture whose images were sent can be committed")
        w = self.state.worker(cap.worker_id)
        if w.container is not None:  # gone since its checkpoint; the runtime forgets it here too
            self._forget_container(w)
        elif cap.state != "released":
            proctree.kill_and_wait(w.root_pid)
            self._drop_net(w)
        else:
            self._await_exit(cid)
        self._end_tracking(cid)
        netlock.release(cap.run_id)
        src = self.page_sources.get(cap.image_id or "")
        if src is None or src.done.is_set():
            self._drop_page_source(cap.image_id)
            reclaim.later(Path(cap.image_dir))  # the job waits for this commit: delete after it
        else:  # the moved worker's memory is still being fetched from here: keep the dump until then
            threading.Thread(target=self._expire_page_source, args=(src,), daemon=True,
                             name=f"pages-{cid}").start()
        nsinit.remove_unused(w.init_dir)  # not where the worker was restored on this same machine
        self.state.update_capture(cap, state="committed")
        self.state.update_worker(w, state="moved", moved_to=moved_to)
        log.info("committed", capture=cid, worker=w.id, moved_to=moved_to)
        return cap

    def _forget_container(self, w: Worker) -> None:
        """The checkpointed container the source's runtime still lists (one not run with --rm):
        after the commit the container runs on the destination only."""
        try:
            containers.podman(self.s).remove((w.container or {})["id"])
        except PitstopError as e:
            log.warning("could not remove the moved container from this host's runtime", worker=w.id,
                        container=(w.container or {}).get("name"), error=e.message,
                        action="remove it with `podman rm`; it does not run")

    def _expire_page_source(self, src: PageSource) -> None:
        if not src.done.wait(self.s.lazy_fill_timeout_s):
            log.error("the destination's fill did not end in time; its dump is deleted here",
                      capture=src.cap.id, timeout_s=self.s.lazy_fill_timeout_s)
        self._drop_page_source(src.cap.image_id)

    def rollback(self, cid: str) -> Capture:
        cap = self.state.capture(cid)
        if cap.state in ("rolled_back", "failed"):
            return cap
        if cap.state == "committed":
            raise Conflict(f"capture {cid} is committed: the worker runs at its destination",
                           action="nothing to roll back; move it again if needed")
        if cap.state == "dumping":
            raise Conflict(f"capture {cid} is still dumping", action="retry when it has finished")
        w = self.state.worker(cap.worker_id)
        t0 = time.monotonic()
        try:
            if cap.state in ("sent", "dumped") or w.container is not None:
                how = self._rollback_stopped(cap, w)
            else:  # released: the source is gone; restore it here from our own images, lock still held
                self._await_exit(cid)
                self._check_seal(cap)
                faults.hit("rollback:before_restore")
                restored = self.restorer.restore_dir(Path(cap.image_dir), worker_id=w.id, job=w.job, rank=w.rank,
                                                     stdio=cap.stdio, replace=True, output_base=self.output_end(w),
                                                     gpu=cap.gpu, net=w.net, init_dir=w.init_dir,
                                                     reopen=file_identity.Reopen.read(cap.image_dir))
                netlock.release(cap.run_id)
                how = f"restored here as pid {restored.root_pid}"
        except PitstopError as e:
            self._keep_failed(cap, e)
            raise
        self.page_sources.pop(cap.image_id or "", None)
        self._end_tracking(cid)
        shutil.rmtree(cap.image_dir, ignore_errors=True)
        self.state.update_capture(cap, state="rolled_back", phases={**cap.phases, "rollback": time.monotonic() - t0})
        log.info("rolled back", capture=cid, worker=w.id, how=how)
        return cap

    def _keep_failed(self, cap: Capture, e: PitstopError) -> None:
        """A rollback failed: its images stay for a retry or a look, then expire (they hold the
        worker's whole memory, in RAM).  A retry that succeeds deletes them as usual."""
        if cap.rollback_failed_at is None:
            self.state.update_capture(cap, rollback_failed_at=time.time(), error=e.to_dict())
        log.error("rollback failed; the source's images are kept for a while", capture=cap.id, error=e.message,
                  keep_s=self.s.failed_rollback_keep_s)
        self._expire_images_later(cap)

    def _expire_images_later(self, cap: Capture) -> None:
        left = (cap.rollback_failed_at or time.time()) + self.s.failed_rollback_keep_s - time.time()
        t = threading.Timer(max(0.0, left), self._expire_failed, args=(cap.id,))
        t.daemon = True
        t.name = f"expire-{cap.id}"
        t.start()

    def _expire_failed(self, cid: str) -> None:
        cap = self.state.captures.get(cid)
        if cap is None or cap.state not in ("sent", "dumped", "released") or cap.rollback_failed_at is None:
            return  # rolled back by a retry, or committed meanwhile
        shutil.rmtree(cap.image_dir, ignore_errors=True)
        netlock.release(cap.run_id)  # its peers then see the connections reset, not hang on them
        self._end_tracking(cid)
        w = self.state.workers.get(cap.worker_id)
        if w is not None and not proctree.is_running(w.root_pid, w.start_time):
            self.state.update_worker(w, state="lost")
        err = {**(cap.error or {}), "details": {**(cap.error or {}).get("details", {}),
                                                "images": f"deleted after {self.s.failed_rollback_keep_s:.0f} s"}}
        self.state.update_capture(cap, state="failed", error=err)
        log.error("the images of a capture whose rollback failed were deleted", capture=cid,
                  after_s=self.s.failed_rollback_keep_s)

    def wait(self, cid: str, timeout_s: float) -> Capture:
        t = self._threads.get(cid)
        if t:
            t.join(timeout_s)
        return self.state.capture(cid)


def _run_id(images: Path) -> str:
    """The run id of the CRIU that dumped into `images` (its network lock's name, criu/netlock.py)."""
    try:
        with open(images / "inventory.img", "rb") as f:
            return str(runtime.locate().import_pycriu().images.load(f)["entries"][0].get("dump_criu_run_id", ""))
    except (OSError, KeyError, IndexError, ValueError, PitstopError):
        return ""


def dedup_pages(setting: str, processes: int, over_tls: bool) -> bool:
    """Send copy-on-write pages once (transfer/dedup.py)?  Only a tree has them, and finding them
    pays where a byte on the wire costs more than the search: over TLS, or on slower links
    (`on`); on this testbed's plain loopback it costs more than it saves (docs/benchmarks.md)."""
    return processes > 1 and (setting == "on" or (setting == "auto" and over_tls))


def _cut(chunks, after: str | None):  # noqa: ANN001, ANN202 - a fault hook: the stream breaks mid-way
    sent = 0
    for c in chunks:
        sent += len(c)
        if after and sent > int(after):
            raise TransferFailed(f"injected fault: stream cut after {after} bytes", action="this is a test")
        yield c
