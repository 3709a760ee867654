"""Fault-injection hooks, kept in production code and inert there.

A hook fires only when *both* PITSTOP_ENABLE_FAULTS=1 and PITSTOP_FAULTS name it, so a
stray variable cannot turn one on.  PITSTOP_FAULTS is a comma-separated list of
`point=action`; actions: `sleep:SECONDS`, `fail` (raise), or a value read with value().
Used by the qualification matrix (tests/qualify) to stop a process at a precise phase or
damage what it handles, as CRIU's zdtm does with its own hooks.  Points:
  phase:<name>          coordinator, as an evacuation enters a phase
  after_commit_point    coordinator, right after the commit point is recorded
  rewire:ids_spent      coordinator, in an early rewire, once the record says the restored ranks are
                        told the ranks that stay's ids (fail: a rollback must then redo the rewire)
  snapshot_phase:<name> coordinator, as a snapshot enters a phase (check, pause, lock, dump, resume,
                        replicate, commit)
  recovery_phase:<name> coordinator, as a recovery enters a phase (plan, fence, stop, restore, resume)
  capture:before_dump   source agent, before CRIU dumps
  precopy:before_read   source agent, before a pre-copy reads the running worker's memory
  precopy:before_finish source agent, after the pre-copy's pages are read, before its manifest
                        is sent (sleep:S holds the pre-copy in flight, to watch its progress)
  precopy:before_delta  source agent, after the dump, before the delta against the pre-copy
  transfer:cut_after    source agent, value = bytes after which the image stream breaks
  image:corrupt         destination agent, value = 1: flip one byte of the received pages
  restore:before_criu   destination agent, before CRIU restores
  snapshot:before_dump  any agent, before CRIU dumps a worker for a snapshot
  snapshot:before_replicate  any agent, before it sends a snapshot's part to its buddy
  snapshot:before_restore    any agent, before a recovery restores a worker from a snapshot
  rollback:before_restore source agent, a rollback's restore from its own images, after the stopped
                        source was killed (fail: the move and its rollback both fail)
  restore:before_register destination agent, after CRIU restored the worker, before it is
                        registered (a rollback that looks for it meanwhile finds nothing)
  restore:kill_fill     destination agent, value = 1: stop (SIGSTOP) the lazy-pages daemon the moment
                        CRIU's restore returns, kill it once the lazy restore returns, so it can
                        never have finished the fill first (the worker must then be stopped, not
                        run on zeros; stopped any earlier, the restore itself hangs)
  restore:kill_page_server destination agent, value = 1: kill the local page relay that serves a lazy
                        restore's pages once the restore returns (the worker must then be stopped)
  postcopy:stop_after_pages  source agent, value = N: its page server hangs up after N pages
                        (post-copy over the network; the moved worker must then be stopped)
  postcopy:after_reply  source agent, after each reply of its page server (sleep:S slows the fill)
  postcopy:stall_after_pages source agent, value = N: its page server stops answering after N pages
                        (a hung source: the destination's relay must stop the worker at its deadline)
  postcopy:faults_from  source agent, value = commit: the two above count the pages served once the
                        move committed, so that the restore's own pages never reach them (a fault
                        meant for the fill past the commit point; pair it with after_reply=sleep:S
                        so that the fill outlasts the commit)
"""

from __future__ import annotations

import os
import time

from pitstop.errors import PitstopError


def _table() -> dict[str, str]:
    if os.environ.get("PITSTOP_ENABLE_FAULTS") != "1":
        return {}
    out = {}
    for item in os.environ.get("PITSTOP_FAULTS", "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def value(point: str) -> str | None:
    return _table().get(point)


def hit(point: str) -> None:
    action = _table().get(point)
    if not action:
        return
    if action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "fail":
        raise PitstopError(f"injected fault at {point}", code="injected_fault", action="this is a test")
