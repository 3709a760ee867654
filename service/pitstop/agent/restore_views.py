"""What CRIU restores from, where it is not the received images as they are: a view written
beside them for a lazy restore, and the check that this host's CRIU can read them at all.

Why apart from the restore's steps (agent/receiving.py): each is a pure function of the images on
disk, tested on images alone, and each fails before CRIU runs, with what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import structlog

from pitstop.criu import runtime
from pitstop.errors import RestoreFailed
from pitstop.memory import cowpages, lazydelta, lazyrule
from pitstop.memory.dumpview import PAGE

log = structlog.get_logger("pitstop.agent.restore")

LAZY_VIEW = "lazy"  # in a slot: what a lazy restore of it reads (memory/lazydelta.py, memory/lazyrule.py)


def check_criu_reads(image_id: str, dirs: list[Path]) -> None:
    """An image whose children share pages with their parent (PE_COW, written by the CRIU pitstop
    carries, or by a pre-copy where it runs) restores only with that CRIU: a stock one would read
    those pages from the child's own pages file, where they are not, and restore garbage.
    Refused before CRIU runs.  `dirs`: the image and the pre-copy it is a delta against."""
    rt = runtime.locate()
    if rt.carried:
        return
    tasks = sorted({pid for d in dirs for pid in cowpages.needs_carried_criu(d, rt.import_pycriu())})
    if tasks:
        raise RestoreFailed(f"image {image_id} was dumped by pitstop's CRIU: tasks {tasks} share pages with "
                            f"their parent (PE_COW), which this host's {rt.source} CRIU {rt.version_str} "
                            "cannot restore",
                            action="the move rolls back; run `pitstop provision-criu` on this host (it builds "
                                   "the carried CRIU; `pitstop doctor` says which CRIU runs), or move to a host "
                                   "that has it")


def lazy_delta_view(image_id: str, images: Path, parent: Path) -> tuple[Path, Path]:
    """A delta restored lazily: CRIU's daemon cannot read its parent, so a local page server
    answers it (memory/lazydelta.py).  The view to restore from, and the server's index."""
    view = images / LAZY_VIEW
    shutil.rmtree(view, ignore_errors=True)  # a restore tried before
    try:
        lazydelta.view(images, parent, view)
    except OSError as e:
        raise _no_view(image_id, e) from None
    return view, view / lazydelta.INDEX


def marked_view(image_id: str, images: Path) -> Path:
    """A whole dump restored lazily from here: its pagemaps with pitstop's lazy marks, not
    CRIU's, which now and then mark nothing lazy (memory/lazyrule.py).  The view to restore from."""
    view = images / LAZY_VIEW
    shutil.rmtree(view, ignore_errors=True)  # a restore tried before
    try:
        changed = lazyrule.view(images, view, runtime.locate().import_pycriu())
    except OSError as e:
        raise _no_view(image_id, e) from None
    if changed.made_lazy:
        log.info("pitstop marked pages lazy that CRIU did not", image=image_id,
                 made_lazy_bytes=changed.made_lazy * PAGE, made_eager_bytes=changed.made_eager * PAGE)
    return view


def _no_view(image_id: str, e: OSError) -> RestoreFailed:
    return RestoreFailed(f"cannot write the lazy view of image {image_id}: {e}",
                         action="the move rolls back; free space in the agent's image directory, or "
                                "restore eagerly (PITSTOP_AGENT_LAZY_RESTORE=0)")
