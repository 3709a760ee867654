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
from dataclasses import dataclass

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
