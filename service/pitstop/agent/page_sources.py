"""The lazy pages this agent serves after a network post-copy move (memory/postcopy.py): a
capture's dump is split into what travels before the restore and what the destination's
lazy-pages daemon fetches from here, on the data port, after the worker runs again.

Why a collaborator of its own: what it holds (the split dumps, by image id) outlives the capture's
thread, ends on its own clock (the destination's fill), and is asked for by the data port, not
by the capture.  Whether this agent can serve at all is a capability it reports; whether a move
uses it is the coordinator's policy (PITSTOP_COORDINATOR_POST_COPY)."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from pitstop import faults, tls
from pitstop.agent import diagnostics, reclaim
from pitstop.agent.capture_kinds import VIEW
from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Capture
from pitstop.criu import criu_ops
from pitstop.errors import CaptureFailed, Conflict, FailedPrecondition, NotFound
from pitstop.memory import page_server, postcopy

log = structlog.get_logger("pitstop.agent.page_sources")

NO_LAZY_NOTICE_BYTES = 16 << 20  # a post-copy dump this big with no lazy page is odd: its CRIU log is kept


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


class PageSources:
    def __init__(self, settings: AgentSettings, state: AgentState) -> None:
        self.s = settings
        self.state = state
        self.data_port: int | None = None  # this agent's data port, where it serves lazy pages
        self._by_image: dict[str, PageSource] = {}

    def support(self) -> dict[str, Any]:
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

    def settle(self, want: bool | None, dest_url: str | None, strict: bool = True) -> bool:
        """Whether a move from here goes network post-copy: what the caller asked (None or False:
        no), if this agent can.  Asked for and impossible: refused where `strict` (before anything
        stops); a pre-copy (not strict) just goes on without it."""
        if not dest_url or not want:
            return False
        why = self.support()["unavailable"]
        if not why:
            return True
        if strict:
            raise FailedPrecondition(f"post-copy over the network was asked for, but {why}",
                                     code="post_copy_unavailable",
                                     action="evacuate without post-copy (the images travel whole)")
        return False

    def split(self, cap: Capture, images: Path) -> dict:
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
            kept = diagnostics.keep(self.s.state_dir, images / criu_ops.DUMP_LOG, f"{cap.id}-dump.log")
            log.warning("post-copy found no lazy pages in the dump: all of it travels before the restore",
                        capture=cap.id, worker=cap.worker_id, eager_bytes=sp.eager_bytes, dump_log=str(kept))
        self._by_image[cap.image_id] = PageSource(cap, sp)  # type: ignore[index]
        self.state.update_capture(cap, post_copy={**postcopy.describe(sp), "pages_served": 0},
                                  phases={**cap.phases, "split": time.monotonic() - t0})
        return {"url": self.s.url, "data_port": self.data_port, "image_id": cap.image_id,
                "lazy_bytes": sp.lazy_bytes}

    def pages_for(self, image_id: str) -> Callable[["object"], None]:
        """For the data port: who answers a lazy-pages daemon asking for `image_id`'s pages."""
        src = self._by_image.get(image_id)
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
                    faults_from=(lambda: cap.state == "committed") if faults.value("postcopy:faults_from") == "commit"
                    else None,
                    on_progress=progress)
                log.info("lazy pages served", capture=cap.id, pages=served.pages, requests=served.requests,
                         seconds=round(served.seconds, 3))
            finally:
                src.busy.release()
                if cap.post_copy is not None:
                    self.state.update_capture(cap, post_copy=dict(cap.post_copy))
                src.done.set()
                if cap.state == "committed":
                    self._drop(image_id)

        return serve

    def forget(self, image_id: str | None) -> None:
        """The capture failed or rolled back: its pages are served no more (its images go with it)."""
        self._by_image.pop(image_id or "", None)

    def after_commit(self, cap: Capture) -> None:
        """The move committed: its dump goes once nothing fetches from it any more, at once where
        it served no lazy page or its fill has ended, else when the fill ends (or its deadline)."""
        src = self._by_image.get(cap.image_id or "")
        if src is None or src.done.is_set():
            self._drop(cap.image_id)
            reclaim.later(Path(cap.image_dir))  # the job waits for this commit: delete after it
        else:  # the moved worker's memory is still being fetched from here: keep the dump until then
            threading.Thread(target=self._expire, args=(src,), daemon=True, name=f"pages-{cap.id}").start()

    def _drop(self, image_id: str | None) -> None:
        src = self._by_image.pop(image_id or "", None)
        if src is not None:
            shutil.rmtree(src.cap.image_dir, ignore_errors=True)

    def _expire(self, src: PageSource) -> None:
        if not src.done.wait(self.s.lazy_fill_timeout_s):
            log.error("the destination's fill did not end in time; its dump is deleted here",
                      capture=src.cap.id, timeout_s=self.s.lazy_fill_timeout_s)
        self._drop(src.cap.image_id)
