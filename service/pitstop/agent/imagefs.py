"""The agent's image directory on a tmpfs of its own, backed by transparent huge pages.

Why: every byte of a move is written to and read from the image directory while the job
waits (CRIU's dump, the pre-copy's delta, the received copy, the restore), and then deleted.
On /dev/shm (4 KiB pages) each 770 MB image set costs about 188,000 page allocations to
write, as many page-table entries to map for the delta's digests, and 0.1 s to free.
Measured here on one rank of 770 MB (2026-11-30): CRIU's memory dump 0.20-0.22 s on a tmpfs
with `huge=within_size` against 0.38-0.50 s on /dev/shm, the delta 0.11 s against 0.14-0.22 s,
deleting 0.007 s against 0.1 s.  `within_size` gives a file huge pages only where it is at
least 2 MiB long, so the many small image files stay small.

The agent mounts it at start (root only; PITSTOP_AGENT_IMAGE_MOUNT=off to leave the directory
as it is) where the directory is not a mount point already and is empty once the agent has
settled what an earlier run left there (a directory still holding a capture's images, or a
fill's, is never hidden under a new mount).  A mount found in place (an earlier run's, or the
operator's own) is used as it is.  At a clean shutdown the agent unmounts what it mounted if
nothing is left in it.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("pitstop.agent.imagefs")

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class ImageFs:
    """What the image directory is on, for /v1/info and doctor."""

    path: str
    fstype: str
    options: str
    mounted_here: bool = False

    @property
    def huge(self) -> bool:
        return "huge=" in self.options and "huge=never" not in self.options

    def describe(self) -> dict[str, object]:
        return {"path": self.path, "fstype": self.fstype, "huge_pages": self.huge, "mounted_by_agent": self.mounted_here}


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, its options) of the mount holding `path`."""
    target = os.path.realpath(path)
    best = ("/", "", "")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            point = fields[4].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                best = (point, rfields[0], rfields[2] if len(rfields) > 2 else "")
    return best


def _mount(path: Path, size: str | None) -> None:
    opts = "huge=within_size,mode=0700" + (f",size={size}" if size else "")
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def prepare(images: Path, *, enabled: bool, size: str | None = None) -> ImageFs:
    """Mount a huge-page tmpfs at `images` where that is right (see the module's docstring)."""
    point, fstype, opts = mount_of(images)
    here = ImageFs(str(images), fstype, opts)
    if not enabled:
        return here
    if point == os.path.realpath(images):
        log.info("image directory is a mount already; used as it is", path=str(images), fstype=fstype,
                 huge_pages=here.huge)
        return here
    if os.geteuid() != 0:
        log.info("image directory left as it is: mounting a tmpfs needs root", path=str(images))
        return here
    if any(images.iterdir()):
        log.warning("image directory left as it is: it still holds an earlier run's images, which a mount "
                    "would hide; the next start mounts it once they are gone", path=str(images))
        return here
    try:
        _mount(images, size)
    except OSError as e:
        log.warning("could not mount a huge-page tmpfs on the image directory; using it as it is",
                    path=str(images), error=e.strerror, action="set PITSTOP_AGENT_IMAGE_MOUNT=off to silence this")
        return here
    _, fstype, opts = mount_of(images)
    log.info("image directory on a huge-page tmpfs", path=str(images), options=opts)
    return ImageFs(str(images), fstype, opts, mounted_here=True)


def release(fs: ImageFs) -> None:
    """At a clean shutdown: unmount what `prepare` mounted, unless something is left in it."""
    if not fs.mounted_here:
        return
    path = Path(fs.path)
    if any(path.iterdir()):
        log.info("image mount kept: it still holds images; the next start uses it", path=fs.path)
        return
    if _libc.umount2(os.fsencode(path), 0) != 0:
        log.info("image mount kept", path=fs.path, error=os.strerror(ctypes.get_errno()))


def unmount_under(root: Path) -> list[str]:
    """Detach every mount at or below `root` (a local cluster's teardown: agents killed mid-way
    leave theirs)."""
    top = os.path.realpath(root)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == top or point.startswith(top.rstrip("/") + "/"):
                points.append(point)
    for p in sorted(points, key=len, reverse=True):
        if _libc.umount2(os.fsencode(p), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
            log.warning("could not detach a mount", path=p, error=os.strerror(ctypes.get_errno()))
    return points
