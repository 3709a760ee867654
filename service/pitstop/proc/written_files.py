"""Regular files a worker has open for writing, as a snapshot finds them, and the rule that lets a
rollback to that snapshot restore against them (agent/snapshots.py).

Why: a job rolled back to a snapshot runs again the steps it had run since, and writes again what
it wrote then.  CRIU restores each open file's descriptor and position but not its contents, and
does not check a data file's size, so a log opened for appending would get every line after the
snapshot twice.  The rule: a file the job writes is cut back to its size at the snapshot, so the
job writes those bytes again and the file ends as an uninterrupted run's.  That is right only for
a file that grew by appending since; so the last bytes before the snapshot's size are digested at
the snapshot and compared first, and a file that is now shorter, gone, or different there is
refused: a job never restores against a file it cannot match.  Every file is checked before any
is cut.

The agent does this as root on paths the job's user controls, so each file is reached without
following links and must be the one the snapshot recorded (its owner; on the host of the snapshot
its inode too: proc/file_identity.py), and it is read and cut through that one descriptor: a file
a user turned into a link to another's is refused, never followed.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import asdict, dataclass

from pitstop.errors import FailedPrecondition
from pitstop.proc.file_identity import FileId, FilesChanged, open_checked
from pitstop.proc.proctree import fd_flags, fd_links
from pitstop.safepath import LinkInPath, reopen

TAIL_BYTES = 64 << 10  # digested at the snapshot: the bytes before its size, which an append leaves alone


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    tail_digest: str  # blake2b of the TAIL_BYTES (or fewer) before `size`
    file_id: FileId | None = None  # owner and inode at the snapshot (None in a record from before they were kept)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["file_id"] = self.file_id.to_list() if self.file_id else None
        return d


def _tail_digest(fd: int, size: int) -> str:
    start = max(0, size - TAIL_BYTES)
    data = os.pread(fd, size - start, start)
    if len(data) != size - start:
        return ""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _digest_of(path: str, size: int) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _tail_digest(fd, size)
    finally:
        os.close(fd)


def written_files(pids: list[int]) -> list[WrittenFile]:
    """The regular files the processes hold open for writing (one entry per path)."""
    seen: dict[str, WrittenFile] = {}
    for pid in pids:
        for fd, target in fd_links(pid):
            if not target.startswith("/") or target.endswith(" (deleted)") or target in seen:
                continue
            flags = fd_flags(pid, fd)
            if flags is None or flags & os.O_ACCMODE == os.O_RDONLY:
                continue
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                if not stat.S_ISREG(st.st_mode):
                    continue
                seen[target] = WrittenFile(target, st.st_size, _digest_of(f"/proc/{pid}/fd/{fd}", st.st_size),
                                           FileId.of(st))
            except OSError:
                continue
    return sorted(seen.values(), key=lambda f: f.path)


def _open(f: WrittenFile, same_host: bool) -> int:
    """`f` opened for reading and writing, reached without following links, checked to be the file
    the snapshot recorded and a regular one."""
    pfd = open_checked(f.path, f.file_id, same_host)
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise FilesChanged(f"{f.path} is not a regular file any more", action="put the job's files back as they were")
        return reopen(pfd, os.O_RDWR)
    finally:
        os.close(pfd)


def mismatch(f: WrittenFile, same_host: bool = True) -> str | None:
    """Why `f` cannot be cut back to its snapshot's size; None where it can."""
    try:
        fd = _open(f, same_host)
    except (LinkInPath, FilesChanged) as e:
        return e.message
    except FileNotFoundError as e:
        return f"{f.path} is gone ({e.strerror})"
    except OSError as e:
        return f"{f.path} cannot be opened ({e.strerror})"
    try:
        size = os.fstat(fd).st_size
        if size < f.size:
            return f"{f.path} is {size} bytes, shorter than the {f.size} it had at the snapshot"
        if _tail_digest(fd, f.size) != f.tail_digest:
            return f"{f.path} was rewritten before the snapshot's end ({f.size} bytes): only appends can be cut back"
    except OSError as e:
        return f"{f.path} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    return None


def cut_back(files: list[WrittenFile], *, apply: bool = True, same_host: bool = True) -> list[dict[str, object]]:
    """Check every file, then (apply) cut each one that grew back to its snapshot's size; what was cut.
    FailedPrecondition, before anything is cut, where one cannot be matched.  same_host: the files
    are on the host where the snapshot was taken (their inodes must be the recorded ones too)."""
    problems = [p for p in (mismatch(f, same_host) for f in files) if p]
    if problems:
        raise FailedPrecondition("the job cannot be rolled back against the files it writes: " + "; ".join(problems),
                                 code="files_changed",
                                 action="restart the job from its own checkpoint, or put the files back as they were")
    cut = []
    for f in files:
        fd = _open(f, same_host)  # again: each cut through a descriptor checked just now
        try:
            now = os.fstat(fd).st_size
            if now > f.size:
                if apply:
                    os.ftruncate(fd, f.size)
                cut.append({"path": f.path, "from": now, "to": f.size})
        finally:
            os.close(fd)
    return cut


def load(items: list[dict[str, object]]) -> list[WrittenFile]:
    out = []
    for d in items:
        fid = d.get("file_id")
        out.append(WrittenFile(str(d["path"]), int(d["size"]), str(d["tail_digest"]),  # type: ignore[call-overload]
                               FileId(*[int(x) for x in fid]) if isinstance(fid, list) else None))
    return out
