"""Pre-copies: a running worker's memory sent to the destination ahead of its move
(memory/precopy.py), and what the move's capture then does with it.

Why a collaborator of its own: a pre-copy outlives the call that made it.  Its basis (the pages
sent, their digests, the kernel's write tracking, and maybe a full local copy for CRIU's
incremental dump) waits here for the move's capture, is dropped if that never comes, and its
tracking stays open until the source has exited or resumed.  All of that state, and every rule
about it, lives here; the capture asks for its basis once (`take`) and hands it back to the
dump steps below."""

from __future__ import annotations

import os
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import structlog

from pitstop import faults
from pitstop.agent.capture_kinds import DELTA, PARENT
from pitstop.agent.dumper import Dumper
from pitstop.agent.page_sources import PageSources
from pitstop.agent.sending import ImageSender
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Capture, Worker
from pitstop.agent.timeouts import PRECOPY_STREAM_STOP_WAIT_S
from pitstop.criu import criu_ops, criutrack, runtime
from pitstop.errors import CaptureFailed, Conflict, DeadlineExceeded, NotFound, TransferFailed
from pitstop.memory import precopy, writetrack
from pitstop.memory.precopy import Basis
from pitstop.proc import proctree
from pitstop.transfer.manifest import Manifest, check_image_id
from pitstop.transfer.stream import DirectoryTail

log = structlog.get_logger("pitstop.agent.precopies")

PRE_DIR_PREFIX = "pre-"  # a pre-copy's images here, while sent (and kept for its capture: criutrack.py)
MAX_BASES = 64  # pre-copies whose capture has not come yet (an operation that died): the oldest go


class PreCopies:
    def __init__(self, settings: AgentSettings, state: AgentState, sender: ImageSender, pages: PageSources,
                 dumper: Dumper) -> None:
        self.s = settings
        self.state = state
        self.sender = sender
        self.pages = pages
        self.dumper = dumper
        self.bases: dict[str, Basis] = {}  # pre-copies sent, by the image id of the move they serve
        self._expiring: dict[str, tuple[weakref.ref[Basis], float]] = {}  # kept ones: when they go
        self._sweeper: threading.Thread | None = None
        self.under_way: dict[str, dict[str, Any]] = {}  # by image id: what was sent so far
        self._stops: dict[str, threading.Event] = {}  # by image id: set to stop that pre-copy
        self._write_tracking_unavailable: str | None = None  # why not ("" when it is), once asked
        self._tracking: dict[str, Basis] = {}  # by capture id: write tracking still open
        self._criu_parent_logged = False

    # -- before the move -----------------------------------------------------------------------
    def run(self, worker_id: str, dest_url: str, image_id: str, post_copy: bool | None = None) -> dict[str, Any]:
        """Send the running worker's memory to the destination ahead of its move.

        Nothing pauses: the worker runs while its pages are read.  The capture of the move that
        follows (same image id) then sends only the pages that changed.  Skipped, not refused,
        where it would not help: a move with network post-copy sends no memory before the resume."""
        if self.pages.settle(post_copy, dest_url, strict=False):
            return {"image_id": image_id, "skipped": "the move uses network post-copy: no memory travels before "
                                                     "the resume"}
        check_image_id(image_id)
        with self.state.lock:
            w = self.state.capturable(worker_id)
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
            if image_id in self.under_way:
                raise Conflict(f"a pre-copy for {image_id} is already under way",
                               action="wait for it (GET /v1/precopies shows its progress)")
            self.under_way[image_id] = progress
            stop = self._stops[image_id] = threading.Event()
            for old in [k for k, b in self.bases.items() if b.worker_id == w.id]:
                # An older pre-copy of this worker no move used: its tracking would keep the
                # memory registered (a second registration is refused), and its pages are stale.
                self.bases.pop(old).discard()
        try:
            basis = self._send(w, pids, dest_url, image_id, pre_id, progress, stop)
        finally:
            with self.state.lock:
                self.under_way.pop(image_id, None)
                self._stops.pop(image_id, None)
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
            self.sender.discard_at(dest_url, pre_id)
            raise DeadlineExceeded(f"the pre-copy for {image_id} ended after its move had started",
                                   action="none: the move sent everything; raise "
                                          "PITSTOP_COORDINATOR_PRECOPY_DEADLINE_S if this repeats")
        out = {"image_id": image_id, "parent_image_id": pre_id, **precopy.describe_basis(basis),
               "kept_for_incremental_dump": basis.local is not None,
               "seconds": round(time.monotonic() - t0, 4), "compression": progress.get("compression")}
        log.info("pre-copied", worker=w.id, dest=dest_url, **out)
        return out

    def stop_all(self) -> int:
        """At shutdown: every pre-copy under way ends within one 4 MiB read (its move sends
        everything instead, or its coordinator sees the agent gone and ends the move before
        anything pauses)."""
        with self.state.lock:
            stops = list(self._stops.values())
        for stop in stops:
            stop.set()
        return len(stops)

    def stop(self, image_id: str) -> dict[str, Any]:
        """Stop a pre-copy under way (its caller gave up on it): it ends within one 4 MiB read,
        its partial copy is discarded at the destination, and its POST answers 409 `aborted`.
        One that has ended and whose move has not come is dropped: its tracking ends, and the
        copy it kept here for CRIU's incremental dump (as big as the worker's memory) goes."""
        with self.state.lock:
            stop = self._stops.get(image_id)
            if stop is None:
                b = self.bases.pop(image_id, None)
                if b is not None:
                    b.discard()
                    return {"image_id": image_id, "discarded": True}
                raise NotFound(f"no pre-copy for {image_id} is under way here",
                               action="none: it has ended (GET /v1/precopies lists those under way)")
            stop.set()
            return dict(self.under_way[image_id], stopping=True)

    def _expire_later(self, image_id: str, basis: Basis) -> None:
        """Drop this kept pre-copy after precopy_keep_s unless a move takes it first.

        One sweeper thread for all of them, holding each only by a weak reference: a timer
        thread per pre-copy held its basis (page runs, digests) and a sleeping thread for the
        whole 15 minutes after its move had used it, which grew a busy agent's memory (about
        60 such threads per agent in the 200-move soak).  Called with the state lock held."""
        self._expiring[image_id] = (weakref.ref(basis), time.monotonic() + self.s.precopy_keep_s)
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="precopy-expiry", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
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
                    self._expire(k, b)
            if self._sweeper is not threading.current_thread():
                return

    def _expire(self, image_id: str, basis: Basis) -> None:
        """A kept pre-copy whose move did not come within PITSTOP_AGENT_PRECOPY_KEEP_S (its
        coordinator died, say) must not hold its memory's worth of this host's RAM for ever."""
        with self.state.lock:
            if self.bases.get(image_id) is not basis:
                return
            self.bases.pop(image_id)
        log.warning("a pre-copy's move did not come; its copy here is dropped", image_id=image_id,
                    kept_s=self.s.precopy_keep_s)
        basis.discard()

    def _send(self, w: Worker, pids: list[int], dest_url: str, image_id: str,
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
                             compression=self.sender.compression(dest_url))
        errors: list[BaseException] = []
        sender = threading.Thread(target=self.sender.send, args=(dest_url, pre_id, tail, errors, [0.0]),
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
            keep = basis.fully_tracked() and self.criu_parent() is not None
            if keep:  # CRIU's incremental dump will take it as its parent, and a rollback too
                basis.local = d
            return basis
        finally:
            if sender.is_alive():
                tail.failure = tail.failure or TransferFailed("pre-copy abandoned", action="none")
                sender.join(PRECOPY_STREAM_STOP_WAIT_S)
            if not keep:
                shutil.rmtree(d, ignore_errors=True)

    # -- what this agent can do with one ------------------------------------------------------
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

    def criu_parent(self) -> runtime.CriuCommand | None:
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

    # -- at the move's capture -----------------------------------------------------------------
    def take(self, cap: Capture, w: Worker) -> Basis | None:
        """The pre-copy the capture's move made of `w`, if any (it is the capture's from now on)."""
        with self.state.lock:
            b = self.bases.pop(cap.image_id or "", None)
        if b is not None and b.worker_id != w.id:
            b.discard()
            return None
        return b

    def dump_incremental(self, cap: Capture, w: Worker, images: Path, overlap: bool, basis: Basis,
                         command: runtime.CriuCommand) -> tuple[criu_ops.DumpResult, bool]:
        """CRIU dumps only what the worker wrote since its pre-copy; the rest stays in the pre-copy,
        moved into the images as their `parent` (the source's own full copy until the move ends).
        Where CRIU cannot, the worker is dumped whole (and the delta cut from that).  Returns the
        dump and whether it is incremental."""
        os.rename(basis.local, images / PARENT)  # type: ignore[arg-type]
        basis.local = None
        if faults.value("capture:break_parent"):  # CRIU then refuses the parent (no pid-reuse check)
            (images / PARENT / "inventory.img").unlink()

        def fell_back(e: CaptureFailed) -> None:
            self.state.update_capture(cap, phases={**cap.phases, "incremental_dump_failed": 1.0})

        res, incremental = self.dumper.incremental_else_whole(
            w, images, self.dumper.options(w, parent=PARENT, command=command), self.dumper.options(w),
            overlap=overlap, log_name=f"{cap.id}-incremental-dump.log", fell_back=fell_back)
        if not incremental:
            return res, False
        with self.state.lock:
            self._tracking[cap.id] = basis  # ended once the source has exited (or resumed): end_tracking
        self.state.update_capture(cap, pre_copy={
            "parent_bytes": res.pages_in_parent * precopy.PAGE, "changed_bytes": res.pages_written * precopy.PAGE,
            "seconds": 0.0, "tracked_tasks": sum(1 for t in basis.tasks.values() if t.tracker is not None),
            "digested_tasks": 0,
            "pre_copied_bytes": basis.bytes, "by": "criu"})
        return res, True

    def cut_delta(self, cap: Capture, images: Path, basis: Basis) -> None:
        """Write the delta against the pre-copy (memory/precopy.py): what travels instead of the dump."""
        try:
            faults.hit("precopy:before_delta")
            self._tracking[cap.id] = basis  # ended once the source has exited (or resumed): end_tracking
            d = precopy.rewrite(images, images / DELTA, basis, end_tracking=False)
        except OSError as e:
            raise CaptureFailed(f"could not write the delta against the pre-copy: {e}",
                                action="the source is restored from its dump; evacuate again "
                                       "(`--no-pre-copy` sends the images whole)") from None
        why = {"untracked_reason": next(iter(basis.untracked.values()))} if basis.untracked else {}
        self.state.update_capture(cap, pre_copy={**precopy.describe_delta(d), "pre_copied_bytes": basis.bytes,
                                                 "by": "pitstop", **why},
                                  phases={**cap.phases, "delta": d.seconds})

    def end_tracking(self, cid: str) -> None:
        """Close the capture's write tracking (its userfaultfds of the source tree)."""
        with self.state.lock:
            b = self._tracking.pop(cid, None)
        if b is not None:
            b.close()
