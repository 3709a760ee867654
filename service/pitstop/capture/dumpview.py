"""Views of a CRIU dump: the same image files, with each task's pagemap and pages file rewritten.

Both network post-copy (postcopy.py: lazy pages left out) and pre-copy (precopy.py: pages
unchanged since the pre-copy left in the parent image) send such a view instead of the dump,
which stays whole on the source for a rollback.  Everything but the task pagemaps and their
pages files is hard-linked from the dump (a view costs no copy of them)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 4096
PE_PARENT = 1 << 0  # the pages are in the parent image (criu/include/pagemap.h)
PE_LAZY = 1 << 1  # they may be restored lazily
PE_PRESENT = 1 << 2  # they are in this image's pages file
TASK_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")


@dataclass
class TaskImage:
    """One task's pagemap in a dump: its id (the pid in the dump's namespace), the loaded image,
    its head and entries, and the name of its pages file."""

    pid: int
    pagemap: Path
    image: dict[str, Any]
    head: dict[str, Any]
    entries: list[dict[str, Any]]
    pages_name: str


def task_images(images: Path, pycriu: Any) -> Iterator[TaskImage]:
    for pm in sorted(images.iterdir()):
        m = TASK_PAGEMAP.fullmatch(pm.name)
        if not m:
            continue
        with open(pm, "rb") as f:
            img = pycriu.images.load(f, pretty=False)
        head = img["entries"][0]
        yield TaskImage(int(m.group(1)), pm, img, head, img["entries"][1:], f"pages-{head['pages_id']}.img")


def link_the_rest(images: Path, view: Path, rewritten: set[str]) -> None:
    """Every other image file of the dump into the view, as a hard link (CRIU's logs stay out)."""
    for f in images.iterdir():
        if f.is_file() and f.name not in rewritten and not f.name.endswith(".log"):
            os.link(f, view / f.name)
