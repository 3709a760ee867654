"""A dump's seal: what its files were when CRIU finished writing them, checked before the source
restores itself from them (a rollback).

Why: a rollback turns the image files back into a running process with the worker's privileges.
The destination checks every byte it received against the sender's manifest; the source's own dump
had no such check, so bytes changed at rest would have become part of the restored worker unseen.
The seal is taken right after the dump (a stat of each file: no byte is read while the job waits)
and kept in the agent's state, not beside the images:
  - inode, size, modification and change time of every file: any write, truncation, replacement or
    chmod changes the change time, which no user can set back;
  - where the stream hashed the files as it sent them, their digests too: checked again, byte for
    byte, before the restore (a rollback is rare and off the job's fast path).
A dump with a parent (CRIU's incremental dump) is sealed with its parent's files.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pitstop.errors import IntegrityError
from pitstop.transfer.manifest import digest_file

Seal = dict[str, list]
"""relative path -> [inode, size, mtime_ns, ctime_ns] or that plus the file's digest."""


# What CRIU writes into an image directory when it restores from it, and never reads: a snapshot's
# part restored once (a recovery that is then run again from its start, by a new leader) is the same
# dump after it.
RESTORE_WRITES = frozenset({"stats-restore"})


def _files(root: Path) -> dict[str, Path]:
    """The files a restore of `root` reads: its own and its parent's (not its subdirectories, which
    hold views cut from the dump for the stream, nor CRIU's logs, which it appends to, nor what a
    restore from it writes there)."""
    out: dict[str, Path] = {}
    for base, prefix in ((root, ""), (root / "parent", "parent/")):
        if prefix and not base.is_dir():
            continue
        with os.scandir(os.path.realpath(base)) as it:
            for e in it:
                if (not e.name.endswith(".log") and e.name not in RESTORE_WRITES
                        and not e.is_dir(follow_symlinks=False)):
                    out[prefix + e.name] = Path(e.path)
    return out


def take(root: Path) -> Seal:
    """The seal of the dump in `root` (and its parent), right after CRIU wrote it."""
    seal: Seal = {}
    for rel, p in _files(root).items():
        st = os.lstat(p)
        seal[rel] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return seal


def add_digests(seal: Seal, digests: dict[str, str]) -> Seal:
    """The stream's digests of the same files (name -> digest), where it hashed them as it sent."""
    return {rel: entry[:4] + ([digests[rel]] if rel in digests else []) for rel, entry in seal.items()}


def check(root: Path, seal: Seal, ignore: tuple[str, ...] = ()) -> None:
    """Raise IntegrityError unless every sealed file is there, unchanged, and no file was added
    (but those named in `ignore`: pitstop's own records, written beside the dump after it)."""
    now = {rel: p for rel, p in _files(root).items() if rel not in ignore}
    problems = [f"{rel}: added after the dump" for rel in sorted(set(now) - set(seal))]

    def one(item: tuple[str, list]) -> str | None:
        rel, entry = item
        p = now.get(rel)
        if p is None:
            return f"{rel}: missing"
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{rel}: {e.strerror}"
        if [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] != entry[:4]:
            return f"{rel}: changed after the dump"
        if len(entry) > 4 and digest_file(p) != entry[4]:
            return f"{rel}: content differs from what was sent"
        return None

    with ThreadPoolExecutor(max_workers=4) as ex:  # xxhash releases the GIL
        problems += [r for r in ex.map(one, seal.items()) if r]
    if problems:
        raise IntegrityError("the source's own images changed after the dump; refusing to restore them: "
                             + "; ".join(problems[:5]),
                             action="the source is left stopped, not restored from images someone altered: "
                                    "find who wrote to the image directory (only root can), then stop the "
                                    "worker's job and start it again from its checkpoint",
                             details={"problems": problems})
