"""The files a worker's tree uses by path, and whether another host has them.

CRIU captures a process's memory, not its files: on restore it opens every file the process
had open, maps every file it had mapped (its Python, its libraries, torch's .so files) and
enters every working directory by the same path, and it refuses a mapped file whose size is not
the one it recorded.  A spare without the job's files at the same paths (a different image, a
directory that is local to the leaving host) would fail the restore after the job had paused,
and roll back.  Asked before anything pauses instead, the spare names what it lacks.

Not listed, because the restore does not need them at a path: deleted files (CRIU carries their
contents), memfds, pipes, sockets, anonymous inodes, /dev, /proc and /sys (the kernel's), and
the worker init's own directory (nsinit.py: the destination makes it).  An open file's size is
not compared: a log the job appends to grows between the check and the capture.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass

from pitstop import nsinit
from pitstop.proc import proctree
from pitstop.safepath import LinkInPath, open_nofollow

KERNEL = ("/dev/", "/proc/", "/sys/")
MAX_FILES = 20_000  # a worker with more distinct paths than this is listed up to here


@dataclass(frozen=True)
class UsedFile:
    path: str
    kind: str               # "mapped" (size must match), "open" (must exist), "dir" (a working directory)
    size: int | None = None  # mapped files only

    def as_dict(self) -> dict:
        return asdict(self)


def _skip(path: str) -> bool:
    return (not path.startswith("/") or path.endswith(" (deleted)") or path.startswith(KERNEL)
            or path.startswith("/memfd:") or nsinit.valid(path))


def used_files(pids: list[int]) -> list[UsedFile]:
    """Every path the restore of these processes needs, once each (first kind seen wins, mapped first)."""
    found: dict[str, UsedFile] = {}

    def add(f: UsedFile) -> None:
        if len(found) < MAX_FILES and f.path not in found:
            found[f.path] = f

    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as m:
                lines = m.read().splitlines()
        except OSError:
            continue  # gone: the capture will say so
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and not _skip(parts[5]) and parts[5] not in found:
                try:
                    add(UsedFile(parts[5], "mapped", os.stat(parts[5]).st_size))
                except OSError:
                    continue  # replaced or removed since it was mapped: CRIU handles that itself
    for pid in pids:
        for link in ("cwd", "root"):
            try:
                path = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            if not _skip(path) and path != "/":
                add(UsedFile(path, "dir"))
        for fd, path in proctree.fd_links(pid):
            if _skip(path):
                continue
            try:
                mode = os.stat(f"/proc/{pid}/fd/{fd}").st_mode
            except OSError:
                continue
            if stat.S_ISREG(mode):
                add(UsedFile(path, "open"))
            elif stat.S_ISDIR(mode):
                add(UsedFile(path, "dir"))
    return list(found.values())


def lacking(files: list[UsedFile]) -> list[dict[str, str]]:
    """What this host lacks of `files`: each path with why, in the order given."""
    out = []
    for f in files:
        try:  # reached as the restore's check reaches it (proc/file_identity.py): a link is not the file
            fd = open_nofollow(f.path)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except LinkInPath as e:
            out.append({"path": f.path, "why": f"a symbolic link is in its path here ({e.details.get('link')}); "
                                               "a restore does not follow links"})
            continue
        except FileNotFoundError:
            out.append({"path": f.path, "why": "missing"})
            continue
        except OSError as e:
            out.append({"path": f.path, "why": f"cannot be read here ({e.strerror})"})
            continue
        if f.kind == "dir":
            if not stat.S_ISDIR(st.st_mode):
                out.append({"path": f.path, "why": "not a directory here"})
        elif not stat.S_ISREG(st.st_mode):
            out.append({"path": f.path, "why": "not a regular file here"})
        elif f.kind == "mapped" and f.size is not None and st.st_size != f.size:
            out.append({"path": f.path, "why": f"{st.st_size} bytes here, {f.size} where the worker runs"})
    return out
