"""Directories that nobody but root (or the service's own user) can change, checked component by
component before anything is written into them.

Why: the agent's image directory receives every byte of a worker's memory, and what the agent
restores from it becomes a process running as that worker's user, often root.  If another local
user owns the directory, or can write to any directory above it, that user can read the images
(tokens included) or swap them for their own before a restore.  So the walk from / opens each
component with O_NOFOLLOW relative to its parent's descriptor (no symlink is followed, nothing is
looked up twice by name) and refuses any component that:
  - is a symbolic link or not a directory;
  - is owned by a user other than root or the service's own;
  - is writable by group or others, unless it has the sticky bit and is not the last component
    (the kernel lets nobody but its owner rename or remove an entry of a sticky directory such as
    /dev/shm or /tmp, so a directory of ours inside one cannot be swapped).
The last component must be the service's own with no access for group or others beyond `mode`;
a directory it creates gets exactly `mode`.  A refusal changes nothing and names the component.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pitstop.errors import FailedPrecondition

_DIR = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(FailedPrecondition):
    """A directory another user could change: refused before anything is written into it."""

    code = "unsafe_path"


def _refuse(path: str, why: str, what: str) -> UnsafePath:
    return UnsafePath(f"{what} {path} is not safe to use: {why}",
                      action=f"give a directory that only root can change (the default under /run/pitstop is), "
                             f"or remove {path} (pitstop did not create it) and start again",
                      details={"path": path, "reason": why})


def _check_parent(path: str, st: os.stat_result, uid: int, what: str) -> None:
    if st.st_uid not in (0, uid):
        raise _refuse(path, f"it belongs to uid {st.st_uid}", what)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"group or others may write to it (mode {stat.S_IMODE(st.st_mode):04o})", what)


def private_dir(path: Path, *, mode: int = 0o700, what: str = "directory", create: bool = True) -> Path:
    """Make sure `path` exists as a directory only this service can change (see the module's
    docstring); create what is missing.  Returns the path as given (absolute)."""
    path = Path(os.path.abspath(path))
    uid = os.geteuid()
    parts = path.parts[1:]
    fd = os.open("/", _DIR | os.O_PATH)
    shown = "/"
    try:
        _check_parent("/", os.fstat(fd), uid, what)
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            shown = os.path.join(shown, name)
            try:
                nfd = os.open(name, _DIR | (os.O_RDONLY if last else os.O_PATH), dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise _refuse(shown, "it does not exist", what) from None
                try:
                    os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made meanwhile: checked below like any other
                nfd = os.open(name, _DIR | (os.O_RDONLY if last else os.O_PATH), dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = "it is a symbolic link" if _is_link(name, fd) else "it is not a directory"
                    raise _refuse(shown, kind, what) from None
                raise
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if not last:
                _check_parent(shown, st, uid, what)
                continue
            if st.st_uid != uid:
                raise _refuse(shown, f"it belongs to uid {st.st_uid}, not to this service (uid {uid})", what)
            if stat.S_IMODE(st.st_mode) & ~mode & 0o077:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o077 | (mode & 0o077))  # ours: tightened, not refused
        return path
    finally:
        os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def owned_subdir(parent: Path, name: str, mode: int = 0o700) -> Path:
    """Create `parent`/`name` afresh (it must not exist) with `mode`, and return it.  For the
    per-capture directories inside a checked private directory: an entry already there was not
    made by this capture, so it is refused rather than reused."""
    d = parent / name
    try:
        os.mkdir(d, mode)
    except FileExistsError:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(str(d), "an entry of that name is there already and is not this service's", "directory")
        os.chmod(d, mode)
    return d


def check_parents(path: Path) -> None:
    """Check, creating nothing, the components of `path` that exist (a dry run of private_dir for
    doctor): raises UnsafePath for the first another user could change."""
    path = Path(os.path.abspath(path))
    uid = os.geteuid()
    shown = Path("/")
    for name in path.parts[1:]:
        nxt = shown / name
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return  # made by the agent, as root's, at its start
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(str(nxt), "it is a symbolic link", "directory")
        _check_parent(str(nxt), st, uid, "directory")
        shown = nxt


# -- files a user controls, opened by root without following links ---------------------------

class LinkInPath(FailedPrecondition):
    """A path that root was about to open on a job's behalf resolves through a symbolic link."""

    code = "link_in_path"


def open_nofollow(path: str, flags: int = os.O_PATH) -> int:
    """A descriptor for the absolute, canonical `path` (as the kernel names an open file: no `.`,
    `..` or link in it), reached component by component with O_NOFOLLOW from `/`, as
    openat2(RESOLVE_NO_SYMLINKS) would.

    Why: the agent runs as root and acts on paths a job's user controls (the files a rank writes,
    cut back at a rollback; the files CRIU reopens).  A path a user turned into a link to root's
    files must fail here, not be followed; and what is then done is done through this descriptor,
    so that nothing is looked up twice by name.  Raises LinkInPath naming the component, or the
    OSError of a component that is missing."""
    if not path.startswith("/") or any(p in (".", "..") for p in path.split("/")):
        raise LinkInPath(f"{path!r} is not a canonical absolute path", action="name files by their real path")
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", _DIR | os.O_PATH)
    shown = ""
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            shown += "/" + name
            try:
                nfd = os.open(name, (flags if last else os.O_PATH | os.O_DIRECTORY) | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, fd):
                    raise LinkInPath(f"{shown} is a symbolic link (to {_target(name, fd)!r}), where {path} was a "
                                     "real path when the job was captured", action="put the job's files back as "
                                     "they were (a link there may point at files of another user)",
                                     details={"path": path, "link": shown}) from None
                raise
            os.close(fd)
            fd = nfd
            if last and flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):  # O_PATH|O_NOFOLLOW opens the link
                raise LinkInPath(f"{shown} is a symbolic link (to {_target(name, _parent(path))!r}), where it was "
                                 "a real file when the job was captured",
                                 action="put the job's files back as they were (a link there may point at files of "
                                        "another user)", details={"path": path, "link": shown})
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def _target(name: str, dir_fd: int | str) -> str:
    try:
        return os.readlink(name, dir_fd=dir_fd) if isinstance(dir_fd, int) else os.readlink(os.path.join(dir_fd, name))
    except OSError:
        return "?"


def _parent(path: str) -> str:
    return os.path.dirname(path) or "/"


def reopen(fd: int, flags: int) -> int:
    """An O_PATH descriptor opened again for I/O (through /proc/self/fd, as the kernel allows for
    O_PATH): the same inode, whatever the path names by now."""
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def makedirs_nofollow(path: str, mode: int = 0o755) -> int:
    """An O_PATH descriptor for the directory `path` (absolute, canonical), made where missing,
    reached without following links (LinkInPath where one is in the way).  For directories root
    makes on a launcher's say (a worker's init directory): never at the end of a user's link."""
    if not path.startswith("/") or any(p in (".", "..") for p in path.split("/")):
        raise LinkInPath(f"{path!r} is not a canonical absolute path", action="name directories by their real path")
    fd = os.open("/", _DIR | os.O_PATH)
    shown = ""
    try:
        for name in [p for p in path.split("/") if p]:
            shown += "/" + name
            try:
                nfd = os.open(name, _DIR | os.O_PATH, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = -1
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise LinkInPath(f"{shown} is {'a symbolic link' if _is_link(name, fd) else 'not a directory'}",
                                     action=f"remove {shown} (pitstop did not make it) or choose another directory",
                                     details={"path": path, "link": shown}) from None
                raise
            if nfd < 0:
                try:
                    nfd = os.open(name, _DIR | os.O_PATH, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise LinkInPath(f"{shown} is not a directory", action=f"remove {shown}",
                                         details={"path": path, "link": shown}) from None
                    raise
            os.close(fd)
            fd = nfd
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)
