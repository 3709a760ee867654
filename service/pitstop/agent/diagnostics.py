"""Files that explain something odd (a CRIU log), kept out of image directories that are deleted
once their move or snapshot is over.

Why a directory of their own, with only the newest few: an incremental dump that fell back to a
whole one, or a post-copy dump with no lazy page, is worth a look afterwards, but its image
directory is gone by then, and an agent that keeps every such log would fill its state
directory over a long job."""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog

log = structlog.get_logger("pitstop.agent.diagnostics")

KEPT = 8  # the newest this many stay


def keep(state_dir: Path, src: Path, name: str) -> Path | None:
    """Copy `src` into <state dir>/diagnostics as `name`, dropping all but the newest KEPT; None
    (and a warning in the log, nothing raised) where it could not."""
    d = state_dir / "diagnostics"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(src, d / name)
        for old in sorted(d.iterdir(), key=lambda f: f.stat().st_mtime)[:-KEPT]:
            old.unlink(missing_ok=True)
        return d / name
    except OSError as e:
        log.warning("could not keep a diagnostic file", src=str(src), error=repr(e))
        return None
