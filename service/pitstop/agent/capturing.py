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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from pitstop import faults, nsinit, tls
from pitstop.agent import containers
from pitstop.agent.capture_kinds import (
    CaptureKind,
    CriuIncremental,
    PostCopyView,
    PreCopyDelta,
    Whole,
)
from pitstop.agent.dumper import Dumper, manifest
from pitstop.agent.page_sources import PageSources
from pitstop.agent.precopies import PRE_DIR_PREFIX, PreCopies
from pitstop.agent.restore_kinds import RestoreOptions
from pitstop.agent.sending import ImageSender, StreamingSend, dedup_pages
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Capture, Worker
from pitstop.container import config as container_config
from pitstop.criu import criu_ops, netlock, runtime, seal
from pitstop.errors import (
    CaptureFailed,
    Conflict,
    IntegrityError,
    PitstopError,
)
from pitstop.gpu.checkpoint import GpuCheckpointer, Suspended
from pitstop.memory.precopy import Basis
from pitstop.network import workerns
from pitstop.proc import file_identity, proctree
from pitstop.transfer.manifest import Manifest
from pitstop.transfer.stream import DirectoryTail
from pitstop.undo import Undo

if TYPE_CHECKING:
    from pitstop.agent.receiving import DestinationSide

log = structlog.get_logger("pitstop.agent.capture")


class SourceSide:
    """A capture's steps and its ends (release, commit, rollback), with the collaborators that
    hold their own state: the dumper (the agent's one dump path), the pre-copies, the lazy pages
    served after a post-copy move, and the sender."""

    def __init__(self, settings: AgentSettings, state: AgentState, restorer: "DestinationSide") -> None:
        self.s = settings
        self.state = state
        self.restorer = restorer  # ..receiving.DestinationSide, for rollback by local restore
        self.gpu: GpuCheckpointer = restorer.gpu  # one driver handle per agent
        self.dumper = Dumper(settings)
        self.sender = ImageSender(settings)
        self.pages = PageSources(settings, state)
        self.precopies = PreCopies(settings, state, self.sender, self.pages, self.dumper)
        self._threads: dict[str, threading.Thread] = {}
        self.on_finished: Callable[[Capture], None] | None = None  # metrics, once per capture
        self._exiting: dict[str, tuple[int, int | None]] = {}  # released captures' sources, still exiting

    # -- capture -----------------------------------------------------------------------------
    def start(self, worker_id: str, dest_url: str | None, image_id: str | None,
              keep_peers: list[str] | None = None, post_copy: bool | None = None) -> Capture:
        remote = self.pages.settle(post_copy, dest_url)
        with self.state.lock:
            w = self.state.capturable(worker_id)
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

    def _run_and_report(self, cap: Capture, w: Worker) -> None:
        try:
            self._run(cap, w)
        except IntegrityError as e:  # a rollback refused images altered at rest: the source stays stopped
            err = {**e.to_dict(), "details": {**e.details, "source_resumed_by": "nobody: it is left stopped"}}
            self.state.update_capture(cap, state="failed", error=err)
            log.error("capture failed and its rollback was refused", capture=cap.id, worker=w.id, error=e.message)
        finally:
            if cap.state not in ("sent", "dumped"):  # failed: the source runs on where it was
                self.precopies.end_tracking(cap.id)
            if self.on_finished:
                self.on_finished(cap)
            self._threads.pop(cap.id, None)  # wait() then reads the state: the capture is over

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
        if cap.want_post_copy:  # settled as the capture began (PageSources.settle)
            return PostCopyView()
        basis = self.precopies.take(cap, w) if cap.dest_url else None
        if basis is None:
            return Whole()
        command = self.precopies.criu_parent() if basis.local is not None else None
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
        """Stop the worker's world, dump it, send it; each stage pushes its way back on `undo`."""
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
        tail = DirectoryTail(kind.streamed(images), on_progress=lambda n: setattr(cap, "bytes_sent", n),
                             dedup=dedup_pages(self.s.dedup_pages, len(pids), tls.enabled()) and kind.whole,
                             compression=self.sender.compression(cap.dest_url) if cap.dest_url else None)
        run = _Run(cap, w, images, kind, tail, self._streaming(cap, tail, time.monotonic()))
        undo.push("stream", run.stop_stream)
        run.start_stream_if("before_dump", self.s.stream_while_dumping)
        suspended = self._stop_world(run, pids, undo)
        faults.hit("capture:before_dump")
        self._dump(run, suspended, undo)
        run.start_stream_if("after_dump", self.s.stream_while_dumping)
        pages_from, parent = run.kind.after_dump(self, cap, images)
        if not run.kind.whole:  # their views hard-link the dump's files, which changes their ctime: sealed again
            self.state.update_capture(cap, seal=seal.take(images))
        tail.manifest_base = manifest(w, cap.id, host=self.s.name, stdio=stdio, output_base=self.output_end(w),
                                      gpu=cap.gpu, file_ids=run.file_ids, keep_peers=cap.keep_peers,
                                      pages_from=pages_from, parent=parent)
        tail.finished.set()
        self._send(run)

    def _stop_world(self, run: "_Run", pids: list[int], undo: Undo) -> "Suspended | None":
        """Stop the worker's world: its own network namespace (nothing in or out until it runs
        again, here or there), then its GPUs (CRIU must see a process that holds none)."""
        cap, w = run.cap, run.w
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
            kind = run.kind
            if isinstance(kind, (PreCopyDelta, CriuIncremental)) and kind.basis.distrust(
                    {p.pid for p in suspended.procs}, "it began to use a GPU after its pre-copy"):
                # its pre-copied memory may have been written by the device unseen: its delta is
                # cut by digest from a full dump (CRIU's incremental dump would trust the tracking)
                run.set_kind(kind.distrusted())
        return suspended

    def _dump(self, run: "_Run", suspended: "Suspended | None", undo: Undo) -> None:
        """The dump: CRIU stops the tree; should it fail, CRIU lets the tree run again.  From its
        end the source is stopped and whole: the way back is restoring it from its own dump
        (which takes its network and GPUs back with it), after the stream has stopped."""
        cap, w, images = run.cap, run.w, run.images
        undo.stage("criu")
        t_dump = time.monotonic()
        # Overlap with other dumps in its directory only where nothing streams while it dumps: a
        # dump that collides is redone from scratch (proc/procwindow.py).
        overlap = not (run.sender is not None and run.kind.stream_start(self.s.stream_while_dumping) == "before_dump")
        dumped = run.kind.dump(self, cap, w, images, overlap)
        res = dumped.result
        run.set_kind(dumped.kind)
        run.dump_end = time.monotonic()
        # the files the tree had, as it had them: what each path CRIU reopens must still be (sealed below)
        run.file_ids = file_identity.Reopen.write(str(images), proctree.tree(w.root_pid), self.s.name)
        gpu_phases = {"gpu_lock": suspended.lock_s, "gpu_checkpoint": suspended.checkpoint_s,
                      "gpu_rounds": float(suspended.rounds), "gpu_processes": float(len(suspended.procs))} \
            if suspended else {}
        self.state.update_capture(cap, run_id=res.run_id, seal=seal.take(images), phases={
            **cap.phases, **gpu_phases, "before_dump": t_dump - run.t0,
            "freeze": res.stats.get("freezing_time", 0) / 1e6, "dump": res.seconds,
            "frozen": res.frozen_s, "memdump": res.memdump_s,
            **({"dump_attempts": float(res.attempts)} if res.attempts > 1 else {})})
        self.state.update_worker(w, state="stopped")
        undo.stage("pitstop", replace=("gpu", "network", "stream"),
                   push=(("rollback", lambda e: self._rollback_stopped(cap, w)),
                         ("stream", run.stop_stream)))

    def _send(self, run: "_Run") -> None:
        """The images are complete: wait for them to reach the destination (or record them here)."""
        cap, tail, sender = run.cap, run.tail, run.sender
        if sender is None:
            total = sum(f.stat().st_size for f in run.images.iterdir() if not f.name.endswith(".log"))
            self.state.update_capture(cap, state="dumped", bytes_total=total)
            log.info("captured", capture=cap.id, worker=run.w.id, kind=run.kind.name, **cap.phases)
            return
        if not sender.started:
            sender.start()
        sender.finish(self.s.transfer_timeout_s)  # raises what went wrong; the undo restores the source
        sealed = cap.seal
        if tail.manifest is not None and tail.directory == run.images and sealed is not None:
            sealed = seal.add_digests(sealed, {f.name: f.digest for f in tail.manifest.files})
        ph = {**cap.phases, "transfer": sender.done - run.t0, "transfer_after_dump": max(0.0, sender.done - run.dump_end)}
        self.state.update_capture(cap, state="sent", phases=ph, seal=sealed,
                                  bytes_total=tail.manifest.total_bytes if tail.manifest else cap.bytes_sent,
                                  bytes_deduplicated=tail.index.bytes_saved if tail.index else 0,
                                  compression=tail.compression.summary() if tail.compression else None)
        log.info("captured and sent", capture=cap.id, worker=run.w.id, dest=cap.dest_url, kind=run.kind.name,
                 bytes=cap.bytes_total, deduplicated=cap.bytes_deduplicated,
                 **{k: round(v, 4) for k, v in ph.items()})

    def _streaming(self, cap: Capture, tail: DirectoryTail, t0: float) -> StreamingSend | None:
        """The stream of a capture with a destination (none for one kept here)."""
        if not cap.dest_url:
            return None
        return StreamingSend(self.sender, cap.dest_url, cap.image_id or cap.id, tail, t0, name=f"send-{cap.id}")

    # -- what a capture kind asks (agent/capture_kinds.py) -------------------------------------
    def dump_whole(self, cap: Capture, w: Worker, images: Path, overlap: bool) -> criu_ops.DumpResult:
        return self.dumper.dump(w, images, self.dumper.options(w), overlap=overlap)

    def dump_incremental(self, cap: Capture, w: Worker, images: Path, overlap: bool, basis: Basis,
                         command: runtime.CriuCommand) -> tuple[criu_ops.DumpResult, bool]:
        return self.precopies.dump_incremental(cap, w, images, overlap, basis, command)

    def cut_delta(self, cap: Capture, images: Path, basis: Basis) -> None:
        self.precopies.cut_delta(cap, images, basis)

    def split(self, cap: Capture, images: Path) -> dict[str, Any]:
        return self.pages.split(cap, images)

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
                             compression=self.sender.compression(cap.dest_url) if cap.dest_url else None)
        t0 = time.monotonic()
        sender = self._streaming(cap, tail, t0)
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
        dump_end = self._checkpoint_container(cap, ctr, images, t0)
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

    def _checkpoint_container(self, cap: Capture, ctr: dict[str, Any], images: Path, t0: float) -> float:
        """The container checkpointed by its runtime into `images`, its own files kept beside them,
        the dump sealed and its phases recorded; when the dump ended."""
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
        return dump_end

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

    def output_end(self, w: Worker) -> dict[str, int]:
        """Where this host's copy of the worker's output ends: the next host continues from there."""
        if not w.restored:
            return {}
        out = {}
        for stream in ("stdout", "stderr"):
            p = self.restorer.outputs / f"{w.id}.{stream}"
            out[stream] = w.output_base.get(stream, 0) + (p.stat().st_size if p.exists() else 0)
        return out

    def _fail(self, cap: Capture, w: Worker, e: BaseException, resumed_by: str) -> None:
        err: dict[str, Any] = e.to_dict() if isinstance(e, PitstopError) else {"code": "internal", "message": repr(e)}
        err["details"] = {**err.get("details", {}), "source_resumed_by": resumed_by}
        self.pages.forget(cap.image_id)
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
        return self._restore_here(cap, w)

    def _restore_here(self, cap: Capture, w: Worker) -> str:
        """Restore the source from its own images, as it was dumped; then lift the dump's network lock."""
        restored = self.restorer.restore_dir(Path(cap.image_dir), RestoreOptions(
            worker_id=w.id, job=w.job, rank=w.rank, stdio=cap.stdio, output_base=self.output_end(w), gpu=cap.gpu,
            net=w.net, init_dir=w.init_dir, reopen=file_identity.Reopen.read(cap.image_dir)))
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
            self.precopies.end_tracking(cid)
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
            containers.forget(self.s, w, "it was moved: it runs on the destination")
        elif cap.state != "released":
            proctree.kill_and_wait(w.root_pid)
            self._drop_net(w)
        else:
            self._await_exit(cid)
        self.precopies.end_tracking(cid)
        netlock.release(cap.run_id)
        self.pages.after_commit(cap)
        nsinit.remove_unused(w.init_dir)  # not where the worker was restored on this same machine
        self.state.update_capture(cap, state="committed")
        self.state.update_worker(w, state="moved", moved_to=moved_to)
        log.info("committed", capture=cid, worker=w.id, moved_to=moved_to)
        return cap

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
                how = self._restore_here(cap, w)
        except PitstopError as e:
            self._keep_failed(cap, e)
            raise
        self.pages.forget(cap.image_id)
        self.precopies.end_tracking(cid)
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
        self.precopies.end_tracking(cid)
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


@dataclass
class _Run:
    """One capture's state as it goes through its stages (SourceSide._capture)."""

    cap: Capture
    w: Worker
    images: Path
    kind: CaptureKind
    tail: DirectoryTail
    sender: StreamingSend | None
    t0: float = field(default_factory=time.monotonic)
    dump_end: float = 0.0
    file_ids: dict[str, list[int]] = field(default_factory=dict)

    def set_kind(self, kind: CaptureKind) -> None:
        """The kind changed (a GPU made it distrust its pre-copy, CRIU fell back to a whole dump):
        what streams follows it."""
        self.kind = kind
        self.tail.directory = kind.streamed(self.images)

    def start_stream_if(self, when: str, stream_while_dumping: bool) -> None:
        if self.sender is not None and not self.sender.started and self.kind.stream_start(stream_while_dumping) == when:
            self.sender.start()

    def stop_stream(self, e: BaseException) -> None:
        if self.sender is not None:
            self.sender.stop(e)
        else:
            self.tail.failure = e if isinstance(e, Exception) else Exception(str(e))


def _run_id(images: Path) -> str:
    """The run id of the CRIU that dumped into `images` (its network lock's name, criu/netlock.py)."""
    try:
        with open(images / "inventory.img", "rb") as f:
            return str(runtime.locate().import_pycriu().images.load(f)["entries"][0].get("dump_criu_run_id", ""))
    except (OSError, KeyError, IndexError, ValueError, PitstopError):
        return ""

