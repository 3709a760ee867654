"""Views of a CRIU dump: the same image files, with each task's pagemap and pages file rewritten.

Both network post-copy (postcopy.py: lazy pages left out) and pre-copy (precopy.py: pages
unchanged since the pre-copy left in the parent image) send such a view instead of the dump,
which stays whole on the source for a rollback.  Everything but the task pagemaps and their
pages files is hard-linked from the dump (a view costs no copy of them)."""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE = 4096
PE_PARENT = 1 << 0  # the pages are in the parent image (criu/include/pagemap.h)
PE_LAZY = 1 << 1  # they may be restored lazily
PE_PRESENT = 1 << 2  # they are in this image's pages file
# they are the parent task's at the same addresses: the child shared them copy-on-write at the dump
# (the CRIU pitstop carries, criu/patches/); no pages in this image, nor in a parent image
PE_COW = 1 << 3
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


def load_pagemap(path: Path, pycriu: Any) -> dict[str, Any]:
    """A pagemap image as pycriu.images.load gives it ({"magic": "PAGEMAP", "entries": [head, *entries]},
    each a dict of the fields set), read 15 x faster: pycriu converts each field in Python (70 ms
    for the 900 entries of one torch rank, read and written once each inside the pause); here the
    protobuf runtime parses each entry and ListFields names what is set."""
    pb, magic = pycriu.images.pb, pycriu.images.magic
    data = path.read_bytes()
    (m,) = struct.unpack_from("i", data, 0)
    off = 4
    if m in (magic.by_name["IMG_COMMON"], magic.by_name["IMG_SERVICE"]):
        (m,) = struct.unpack_from("i", data, 4)
        off = 8
    if m != magic.by_name["PAGEMAP"]:
        raise ValueError(f"{path.name} is not a pagemap image (magic {m:#x})")
    entries: list[dict[str, Any]] = []
    msg: Any = pb.pagemap_head()
    while off < len(data):
        (size,) = struct.unpack_from("i", data, off)
        msg.ParseFromString(data[off + 4:off + 4 + size])
        entries.append({f.name: v for f, v in msg.ListFields()})
        off += 4 + size
        msg = pb.pagemap_entry()
    return {"magic": "PAGEMAP", "entries": entries}


def dump_pagemap(img: dict[str, Any], f: Any, pycriu: Any) -> None:
    """Write a pagemap image as pycriu.images.dump does (the same bytes), without its per-field Python."""
    pb, magic = pycriu.images.pb, pycriu.images.magic
    out = [struct.pack("ii", magic.by_name["IMG_COMMON"], magic.by_name["PAGEMAP"])]
    for i, e in enumerate(img["entries"]):
        raw = (pb.pagemap_head if i == 0 else pb.pagemap_entry)(**e).SerializeToString()
        out.append(struct.pack("i", len(raw)))
        out.append(raw)
    f.write(b"".join(out))


def task_images(images: Path, pycriu: Any) -> Iterator[TaskImage]:
    for pm in sorted(images.iterdir()):
        m = TASK_PAGEMAP.fullmatch(pm.name)
        if not m:
            continue
        img = load_pagemap(pm, pycriu)
        head = img["entries"][0]
        yield TaskImage(int(m.group(1)), pm, img, head, img["entries"][1:], f"pages-{head['pages_id']}.img")


def link_the_rest(images: Path, view: Path, rewritten: set[str]) -> None:
    """Every other image file of the dump into the view, as a hard link (CRIU's logs stay out)."""
    for f in images.iterdir():
        if f.is_file() and f.name not in rewritten and not f.name.endswith(".log"):
            os.link(f, view / f.name)
