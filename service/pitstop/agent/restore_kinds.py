"""How one received image is restored, decided once from its manifest and the agent's settings
(DestinationSide.restore_image), the destination's counterpart of capture_kinds.py.

Two questions, each answered once, so that the restore's steps ask the plan instead of
re-deciding from the manifest's fields at every turn:

- **Is it a delta?**  An image cut against a pre-copy (memory/precopy.py, criu/criutrack.py)
  names that pre-copy as its parent; CRIU reads the unchanged pages from it, so the parent must
  be here, verified, and linked in before CRIU starts.
- **Who fills the memory?**  `EAGER`: CRIU restores every page before the worker runs.
  `LOCAL`: the agent's own lazy restore (`lazy_restore`): the worker runs first and a lazy-pages
  daemon fills its memory from the images here, through pitstop's marked view of a whole dump
  (memory/lazyrule.py) or, for a delta, a local page server over the delta and its parent
  (memory/lazydelta.py).  `REMOTE`: network post-copy: the source still holds the pages the
  image left out and serves them to the daemon (memory/postcopy.py).  The source's choice wins:
  an image that names `pages_from` cannot be restored any other way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.proc import file_identity
from pitstop.transfer.manifest import Manifest


class PageFill(enum.Enum):
    EAGER = "eager"
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True)
class RestorePlan:
    fill: PageFill
    parent: str | None  # the pre-copy this image is a delta against, restored as its `parent`

    @classmethod
    def of(cls, m: Manifest, lazy_restore: bool) -> RestorePlan:
        if m.pages_from:
            fill = PageFill.REMOTE
        elif lazy_restore:
            fill = PageFill.LOCAL
        else:
            fill = PageFill.EAGER
        return cls(fill=fill, parent=m.parent)

    @property
    def lazy(self) -> bool:
        """The worker runs before its memory is all in: a daemon fills it afterwards."""
        return self.fill is not PageFill.EAGER

    def describe(self) -> str:
        delta = f"a delta against {self.parent}" if self.parent else "a whole dump"
        return f"{delta}, memory filled {self.fill.value}"


@dataclass(frozen=True)
class RestoreOptions:
    """What one restore registers, and how: one typed object (DestinationSide._restore), built
    from a manifest (a move's image, a snapshot's part: `of_manifest`) or from the worker's own
    record (a rollback on the source), in one place each.

    lazy: restore post-copy, memory filled by a lazy-pages daemon after the worker runs again.
    pages_from: the lazy pages are on the source (post-copy over the network): the daemon fetches
    them there.  local_index: a delta and its pre-copy here, served to the daemon by a local page
    server.  reopen: the files the dump found, which every path CRIU reopens here must still be
    (proc/file_identity.py); without it, paths through a symbolic link are still refused."""

    worker_id: str
    job: str
    rank: int
    stdio: list[dict[str, Any]]
    replace: bool = True  # a worker of that id already here (a rollback) is replaced
    slurm_job: str | None = None
    output_base: dict[str, int] = field(default_factory=dict)
    gpu: dict[str, Any] | None = None
    net: dict[str, str] | None = None
    keep_peers: list[str] | None = None
    init_dir: str | None = None
    reopen: file_identity.Reopen | None = None
    lazy: bool = False
    pages_from: dict[str, Any] | None = None
    local_index: Path | None = None

    @classmethod
    def of_manifest(cls, m: Manifest, *, net: dict[str, str] | None, **more: Any) -> RestoreOptions:
        """A dumped worker as its manifest describes it; `net`: its address here (the manifest's,
        or one under a namespace name of its own); `more`: what only some restores set."""
        wk = m.worker
        return cls(worker_id=wk["id"], job=wk["job"], rank=int(wk["rank"]), stdio=[p.model_dump() for p in m.stdio],
                   output_base=m.output_base, gpu=m.gpu or None, net=net, init_dir=wk.get("init_dir"),
                   reopen=file_identity.Reopen.of(m.file_ids, m.host), **more)
