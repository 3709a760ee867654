"""Image directories freed after the moment that matters, not during it.

Deleting a 770 MB image set from tmpfs takes about 0.1 s here (this VM hands freed memory
back to the host), and a move deletes several while the whole job waits: the source's dump at
the commit, the destination's received images and pre-copy once a restore returns.  None of
them is needed after that point, so the directory is renamed aside at once (same filesystem:
atomic, and nothing can restore from it by mistake) and deleted by a background thread.  The
names aside start with TRASH; an agent sweeps what an earlier run left at start, and waits for
its own deletions at shutdown (bounded).
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path

import structlog

log = structlog.get_logger("pitstop.agent.reclaim")

TRASH = ".trash-"
_seq = itertools.count()
_pending: set[threading.Thread] = set()
_lock = threading.Lock()


def later(path: Path) -> None:
    """Take `path` out of the way now; delete it in the background."""
    aside = path.with_name(f"{TRASH}{path.name}.{os.getpid()}.{next(_seq)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    except OSError as e:  # cannot rename (another filesystem?): delete it here and now
        log.warning("deleting in place", path=str(path), error=str(e))
        shutil.rmtree(path, ignore_errors=True)
        return
    t = threading.Thread(target=_remove, args=(aside,), name="reclaim", daemon=True)
    with _lock:
        _pending.add(t)
    t.start()


def _remove(aside: Path) -> None:
    try:
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        with _lock:
            _pending.discard(threading.current_thread())


def sweep(root: Path) -> list[str]:
    """At start: what an earlier run of the agent set aside and did not delete."""
    gone = []
    for d in root.glob(TRASH + "*"):
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d.name)
    return gone


def drain(timeout_s: float = 30.0) -> bool:
    """Wait for the deletions under way; False if some are still running at the deadline."""
    with _lock:
        pending = list(_pending)
    for t in pending:
        t.join(timeout_s / max(1, len(pending)))
    return not any(t.is_alive() for t in pending)
