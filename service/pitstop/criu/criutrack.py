"""CRIU's own incremental dump after a write-tracked pre-copy (native/criutrack.c).

Without it, the pause of a pre-copied worker still holds CRIU's dump of *all* its memory
(0.25-0.33 s of each 770 MB rank on the reference VM), after which pitstop cuts out what
changed (precopy.rewrite).  CRIU can dump only what changed by itself (`--track-mem` with the
pre-copy as `--prev-images-dir`), but it learns what changed from soft-dirty bits, which this
kernel does not have.  The preloaded library answers CRIU's soft-dirty questions from the
write tracking the pre-copy already runs (memory/writetrack.py), so CRIU writes only the
written pages and marks the rest "in the parent" (the pre-copy's images, kept on the source
until the move ends: a rollback after the release restores from them).

Used only when every process of the worker was tracked, for the CRIU this was read against and
tested with (TESTED), and when the library makes `criu check --feature mem_dirty_track` pass.
Anything else, and any failure of the incremental dump itself, falls back to the full dump and
pitstop's own delta: the fast path may be missing, never wrong.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from pitstop import nativelib
from pitstop.criu import runtime

LIBRARY = "libpitstop_criutrack.so"
# CRIU minors whose dump (criu/mem.c, pagemap-cache.c, kerndat.c) the library was written
# against and whose incremental dumps the tests restore bitwise.  Another CRIU may ask for
# soft-dirty some other way; until tested, it gets the full dump.
TESTED = ((4, 2),)
DIRTY_TRACK_CHECK_TIMEOUT_S = 30.0  # `criu check --feature mem_dirty_track` with the tracking library preloaded: one probe
# The incremental dump's CRIU log level.  At 4 (debug) CRIU writes a line per run of pages, in
# or out of the parent: a delta is thousands of short runs, and those lines doubled its memory
# dump (0.23 against 0.05 s for a 780 MB process, 2026-12-02).  3 keeps errors, warnings and
# CRIU's own account of each step.
LOG_LEVEL = 3


def library() -> Path | None:
    return nativelib.built("PITSTOP_CRIUTRACK", LIBRARY)


@functools.lru_cache(maxsize=1)
def command() -> tuple[runtime.CriuCommand | None, str]:
    """(the CRIU to dump with, the library preloaded, "") where CRIU's incremental dump can be
    used; else (None, why).  Asked once per process."""
    lib = library()
    if lib is None:
        return None, f"native/build/{LIBRARY} is not built; run `make native`"
    try:
        rt = runtime.locate()
    except Exception as e:  # noqa: BLE001 - no CRIU: nothing is dumped at all
        return None, str(e)
    if tuple(rt.version[:2]) not in TESTED:
        return None, (f"CRIU {rt.version_str} is not one the incremental dump was tested with "
                      f"({', '.join('.'.join(map(str, v)) for v in TESTED)})")
    cmd = runtime.preloaded(rt, lib)
    try:
        p = subprocess.run([cmd.binary, "check", "--feature", "mem_dirty_track"], capture_output=True,
                           text=True, timeout=DIRTY_TRACK_CHECK_TIMEOUT_S, env=cmd.environ())
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"could not run CRIU with {LIBRARY}: {e}"
    if p.returncode != 0 or "is supported" not in p.stdout + p.stderr:
        last = (p.stdout + p.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"CRIU with {LIBRARY} does not report dirty tracking: {last[0]}"
    return cmd, ""
