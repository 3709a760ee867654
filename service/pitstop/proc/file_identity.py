"""Which file each path a worker uses named when it was captured, and whether it still names it.

Why: CRIU's restore runs as root and reopens every file of the tree by path (files.img): its
open files, its mapped libraries, its working directory.  Between a dump and a restore a local
user who can write to one of the job's directories can put a symbolic link in the place of a
file the job had open ("the log" -> /etc/shadow): root would follow it, truncate the target at
a rollback and hand the restored rank a descriptor on it.  So the capture records, for every
path the tree uses, the owner and the inode it named then (from the open files themselves,
/proc/PID/fd and /proc/PID/map_files, not from a lookup by name), and before any restore every
path CRIU will reopen is reached without following links and compared:
  - a path that resolves through a symbolic link is refused (the kernel names open files by
    their real path, so a link there appeared since);
  - a path that now belongs to another owner is refused;
  - on the host where the tree was dumped, a path that now names another inode is refused too
    (the job's file was replaced: what CRIU would reopen is not what the rank had open).
A path that did not exist when the tree was dumped is not compared (CRIU carries deleted files
itself).  One check remains racy: a user who can write to the directory may swap an entry between
this check and CRIU's own open; the check is made immediately before CRIU runs, and a rank's
directories that nobody else can write close it (docs/architecture.md, threat model).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from pitstop import nsinit
from pitstop.errors import FailedPrecondition
from pitstop.proc import proctree
from pitstop.safepath import LinkInPath, open_nofollow

KERNEL = ("/dev/", "/proc/", "/sys/")


class FilesChanged(FailedPrecondition):
    """A file the restore would reopen is not the one the worker had: refused before the restore."""

    code = "files_changed"


@dataclass(frozen=True)
class FileId:
    uid: int
    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileId":
        return cls(st.st_uid, st.st_dev, st.st_ino)

    def to_list(self) -> list[int]:
        return [self.uid, self.dev, self.ino]


def skipped(path: str) -> bool:
    """Paths the restore does not reopen from the file system as a user could change them."""
    return (not path.startswith("/") or path.endswith(" (deleted)") or path.startswith(KERNEL)
            or path.startswith("/memfd:") or nsinit.valid(path))


def identities(pids: list[int]) -> dict[str, list[int]]:
    """path -> [uid, dev, ino] of every file and directory the processes hold open, map, or work
    in, taken from the open files themselves (a stat through the process's own link)."""
    out: dict[str, list[int]] = {}

    def add(path: str, link: str) -> None:
        if path in out or skipped(path):
            return
        try:
            out[path] = FileId.of(os.stat(link)).to_list()
        except OSError:
            return  # gone meanwhile, or not a file: nothing to compare

    for pid in pids:
        for fd, path in proctree.fd_links(pid):
            add(path, f"/proc/{pid}/fd/{fd}")
        base = f"/proc/{pid}/map_files"
        try:
            ranges = os.listdir(base)
        except OSError:
            ranges = []
        for r in ranges:
            try:
                add(os.readlink(f"{base}/{r}"), f"{base}/{r}")
            except OSError:
                continue
        for name in ("cwd", "root"):
            try:
                add(os.readlink(f"/proc/{pid}/{name}"), f"/proc/{pid}/{name}")
            except OSError:
                continue
    return out


def load(d: dict[str, list[int]] | None) -> dict[str, FileId]:
    return {p: FileId(int(v[0]), int(v[1]), int(v[2])) for p, v in (d or {}).items()}


RECORD = ".file-ids.json"
"""Beside a capture's own dump (sealed with it, never streamed: a leading dot): what its rollback
on the source checks.  A destination reads the same record from the manifest."""


@dataclass(frozen=True)
class Reopen:
    """What a restore's reopen of paths is checked against: the files the dump found, and the
    host it was taken on (where inodes are compared as well as owners)."""

    ids: dict[str, FileId]
    host: str

    @classmethod
    def of(cls, file_ids: dict[str, list[int]] | None, host: str) -> "Reopen":
        return cls(load(file_ids), host)

    @classmethod
    def read(cls, directory: str) -> "Reopen":
        """The record a capture kept beside its dump (none: links are still refused)."""
        try:
            with open(os.path.join(directory, RECORD)) as f:
                d = json.load(f)
            return cls.of(d.get("ids"), str(d.get("host", "")))
        except (OSError, ValueError):
            return cls({}, "")

    @staticmethod
    def write(directory: str, pids: list[int], host: str) -> dict[str, list[int]]:
        ids = identities(pids)
        with open(os.path.join(directory, RECORD), "w") as f:
            json.dump({"host": host, "ids": ids}, f)
        return ids

    def problems(self, paths: list[str], here: str) -> list[str]:
        return problems(paths, self.ids, same_host=bool(self.host) and self.host == here)

    def check(self, paths: list[str], here: str) -> None:
        """Raise FilesChanged (every problem at once) unless CRIU may reopen these paths here."""
        refuse_unsafe(paths, self.ids, same_host=bool(self.host) and self.host == here)


def open_checked(path: str, recorded: FileId | None, same_host: bool, flags: int = os.O_PATH) -> int:
    """A descriptor for `path`, reached without following links, that names what the capture
    recorded: the same owner, and on the host of the dump the same inode.  Raises LinkInPath or
    FilesChanged saying which; the OSError of a path that is missing."""
    fd = open_nofollow(path, flags)
    try:
        if recorded is not None:
            st = os.fstat(fd)
            if st.st_uid != recorded.uid:
                raise FilesChanged(f"{path} belongs to uid {st.st_uid} now, to uid {recorded.uid} when the job was "
                                   "captured", action="put the job's files back as they were, or restart the job "
                                                      "from its own checkpoint", details={"path": path})
            if same_host and (st.st_dev, st.st_ino) != (recorded.dev, recorded.ino):
                raise FilesChanged(f"{path} is another file than the one the job had open when it was captured "
                                   "(it was replaced or moved since)",
                                   action="put the job's files back as they were, or restart the job from its own "
                                          "checkpoint", details={"path": path})
        return fd
    except BaseException:
        os.close(fd)
        raise


def problems(paths: list[str], recorded: dict[str, FileId], same_host: bool) -> list[str]:
    """Why CRIU must not reopen these paths (empty: it may): each one checked as open_checked does.
    A missing path is not reported here: the restore (and the spare's file check) say so."""
    out = []
    for path in dict.fromkeys(paths):
        if skipped(path):
            continue
        try:
            os.close(open_checked(path, recorded.get(path), same_host))
        except (LinkInPath, FilesChanged) as e:
            out.append(e.message)
        except OSError:
            continue
    return out


def refuse_unsafe(paths: list[str], recorded: dict[str, FileId], same_host: bool) -> None:
    """Raise FilesChanged with every problem at once, before anything is restored."""
    found = problems(paths, recorded, same_host)
    if found:
        raise FilesChanged("the restore would reopen files that are not the job's any more: " + "; ".join(found),
                           action="put the job's files back as they were (nothing was restored), or restart the job "
                                  "from its own checkpoint", details={"problems": found})


def is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)
