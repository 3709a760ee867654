"""The CPU priority of pitstop's own services on a host whose cores the job keeps busy.

A training job keeps every core busy (its ranks, their data loaders), and a move's first
phases run while it does: the coordinator's calls, each agent's pause of its ranks, the
pre-copy.  At the same priority as the job's processes the agent gets one share among many and
answers late; with 8 ranks on 2 cores a pause round was measured at up to 1 s here
(docs/benchmarks.md).  Once the job is paused nothing competes, so a higher priority costs the
job nothing but the agent's own, short, work.  Restored workers get their own nice value back
from their images (CRIU restores it), not the agent's.

A nice value is a weight, not a guarantee: the threads a resume wakes preempt the agent between
its kill() calls.  The rounds the downtime waits on (stopping and continuing ranks, and the
coordinator's calls for them) therefore run on SCHED_FIFO for their few milliseconds: boost()
and critical().  The units grant both without CAP_SYS_NICE (LimitNICE=-10, LimitRTPRIO=1).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import structlog

log = structlog.get_logger()


def apply(nice: int, who: str, realtime: bool = True) -> bool:
    """Set the nice value of this process's threads, before it starts its own (which inherit
    it; a nice value is per thread on Linux), and find out whether boost() can work; returns that.
    Lowering the nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (the units'
    LimitNICE=-10), SCHED_FIFO the same or RLIMIT_RTPRIO >= 1 (LimitRTPRIO=1): without, say so.
    realtime: whether boost() may put a thread on SCHED_FIFO at all (a host whose policy forbids
    real-time threads turns it off; the rounds then run at the nice value alone)."""
    global _realtime
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice != current:
        try:
            # Every thread there is: a library may have started one at import (numpy's OpenBLAS
            # pool, in the agent) and a nice value is per thread.
            for tid in map(int, os.listdir("/proc/self/task")):
                with contextlib.suppress(ProcessLookupError):
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            log.warning("cannot raise this service's CPU priority", service=who, nice=nice, current=current,
                        action="run it as root, or with LimitNICE= in its unit (systemd/), or set its NICE "
                               "setting to 0")
    _realtime = realtime
    back = boost() if realtime else None
    if back:
        back()
    elif realtime:
        _realtime = False
        log.warning("cannot put a thread on SCHED_FIFO: pause and resume rounds run at the nice value alone",
                    service=who, action="run it as root, or with LimitRTPRIO=1 in its unit (systemd/); "
                                        "REALTIME=false says this is meant")
    log.info("cpu priority", service=who, nice=os.getpriority(os.PRIO_PROCESS, 0), realtime=back is not None)
    return back is not None


_realtime = True  # apply() sets it from the service's settings
_lock = threading.Lock()
_open: dict[int, tuple[int, tuple[int, os.sched_param]]] = {}  # thread id: open boosts, policy before


def boost() -> Callable[[], None] | None:
    """Put this thread on SCHED_FIFO (priority 1) until the returned call, which may come from
    any thread; None where it may not (no CAP_SYS_NICE, or no real-time time for its cgroup).

    Boosts nest (an event loop's thread may hold two requests' at once): the thread's own
    policy and nice value come back when the last open one ends, and each returned call
    counts once however often it is made."""
    if not _realtime:
        return None
    tid = threading.get_native_id()
    with _lock:
        depth, before = _open.get(tid, (0, None))
        if before is None:
            try:
                before = os.sched_getscheduler(tid), os.sched_getparam(tid)
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
            except OSError:
                return None
        _open[tid] = (depth + 1, before)
    done = False

    def back() -> None:
        nonlocal done
        with _lock:
            if done:
                return
            done = True
            depth, before = _open.pop(tid)
            if depth > 1:
                _open[tid] = (depth - 1, before)
                return
            try:  # back to SCHED_OTHER with sched_setscheduler keeps the thread's nice value
                os.sched_setscheduler(tid, *before)
            except OSError as e:  # the thread has ended, or cannot happen
                log.warning("cannot put a thread's scheduling policy back", tid=tid, error=str(e))
    return back


@contextlib.contextmanager
def critical() -> Iterator[bool]:
    """Run the block with this thread on SCHED_FIFO (priority 1), then put its policy and nice
    value back; yields whether it got it.

    For the few milliseconds of work that the job's downtime waits on and that busy ranks
    would otherwise interleave with: stopping and continuing a job's ranks.  A SIGCONT wakes
    every thread of a rank, and each woken thread preempts the agent's (nice -10 is a weight,
    not a guarantee): continuing 7 ranks of 49 threads on 2 cores took 4-50 ms of kill() calls
    where the calls alone take microseconds (docs/benchmarks.md).  A real-time thread is not
    preempted by them.  Only for short, bounded work: waiting (a network call with its
    timeout, a lock) costs nothing, but a real-time thread that computes for long starves the
    host's ordinary tasks (the kernel's RT throttling, 95 % by default, is the only limit).
    Threads it starts inherit the policy (glibc's default) for as long as they run.  Without
    CAP_SYS_NICE it runs the block as it is."""
    back = boost()
    try:
        yield back is not None
    finally:
        if back:
            back()
