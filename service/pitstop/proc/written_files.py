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
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import asdict, dataclass

from pitstop.errors import FailedPrecondition
from pitstop.proc.proctree import fd_flags, fd_links

TAIL_BYTES = 64 << 10  # digested at the snapshot: the bytes before its size, which an append leaves alone


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    tail_digest: str  # blake2b of the TAIL_BYTES (or fewer) before `size`

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _tail_digest(path: str, size: int) -> str:
    start = max(0, size - TAIL_BYTES)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(size - start)
    if len(data) != size - start:
        return ""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
                seen[target] = WrittenFile(target, st.st_size, _tail_digest(f"/proc/{pid}/fd/{fd}", st.st_size))
            except OSError:
                continue
    return sorted(seen.values(), key=lambda f: f.path)


def mismatch(f: WrittenFile) -> str | None:
    """Why `f` cannot be cut back to its snapshot's size; None where it can."""
    try:
        st = os.stat(f.path)
    except OSError as e:
        return f"{f.path} is gone ({e.strerror})"
    if st.st_size < f.size:
        return f"{f.path} is {st.st_size} bytes, shorter than the {f.size} it had at the snapshot"
    try:
        if _tail_digest(f.path, f.size) != f.tail_digest:
            return f"{f.path} was rewritten before the snapshot's end ({f.size} bytes): only appends can be cut back"
    except OSError as e:
        return f"{f.path} cannot be read ({e.strerror})"
    return None


def cut_back(files: list[WrittenFile], *, apply: bool = True) -> list[dict[str, object]]:
    """Check every file, then (apply) cut each one that grew back to its snapshot's size; what was cut.
    FailedPrecondition, before anything is cut, where one cannot be matched."""
    problems = [p for p in (mismatch(f) for f in files) if p]
    if problems:
        raise FailedPrecondition("the job cannot be rolled back against the files it writes: " + "; ".join(problems),
                                 code="files_changed",
                                 action="restart the job from its own checkpoint, or put the files back as they were")
    cut = []
    for f in files:
        now = os.stat(f.path).st_size
        if now > f.size:
            if apply:
                os.truncate(f.path, f.size)
            cut.append({"path": f.path, "from": now, "to": f.size})
    return cut


def load(items: list[dict[str, object]]) -> list[WrittenFile]:
    return [WrittenFile(str(d["path"]), int(d["size"]), str(d["tail_digest"])) for d in items]  # type: ignore[call-overload]
