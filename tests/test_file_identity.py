"""Root never follows a user's link to another's file (proc/file_identity.py, safepath.open_nofollow,
proc/written_files.py): the paths a restore reopens and the files a rollback cuts back are reached
without following links and must be the files the capture recorded.  Real files, a real uid 65534
making the links."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from pitstop.errors import FailedPrecondition
from pitstop.proc import file_identity
from pitstop.proc.written_files import cut_back, written_files
from pitstop.safepath import LinkInPath, open_nofollow


def _as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd], check=True, timeout=30)


@pytest.fixture
def shared():
    """A directory anyone may write to (a job's working directory shared carelessly), and a root
    file of 50 bytes with one that only root may read (under $TMPDIR: pytest's own directories
    are root's alone, and the user must reach this one)."""
    tmp_path = Path(tempfile.mkdtemp(prefix="pitstop-links-"))
    try:
        yield _shared(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _shared(tmp_path: Path) -> tuple[Path, Path, Path]:
    d = tmp_path / "job"
    d.mkdir()
    d.chmod(0o777)
    tmp_path.chmod(0o755)
    victim = tmp_path / "root-owned"
    victim.write_text("x" * 50)
    victim.chmod(0o644)
    secret = tmp_path / "root-only"
    secret.write_text("secret\n")
    secret.chmod(0o600)
    return d, victim, secret


def test_open_nofollow_refuses_a_link_at_any_component(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("ok")
    (tmp_path / "dirlink").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "flink").symlink_to(tmp_path / "real" / "f")
    os.close(open_nofollow(str(tmp_path / "real" / "f")))
    with pytest.raises(LinkInPath, match="dirlink is a symbolic link"):
        open_nofollow(str(tmp_path / "dirlink" / "f"))
    with pytest.raises(LinkInPath, match="flink is a symbolic link"):
        open_nofollow(str(tmp_path / "real" / "flink"))
    with pytest.raises(LinkInPath, match="flink is a symbolic link"):
        open_nofollow(str(tmp_path / "real" / "flink"), os.O_RDONLY)
    with pytest.raises(LinkInPath, match="not a canonical"):
        open_nofollow(str(tmp_path / "real" / ".." / "real" / "f"))
    with pytest.raises(FileNotFoundError):
        open_nofollow(str(tmp_path / "real" / "missing"))


def test_a_path_replaced_by_a_link_or_another_file_is_refused_before_a_reopen(shared):
    d, victim, secret = shared
    data, log, other = d / "data", d / "log", d / "other"
    data.write_text("input\n")
    log.write_text("")
    other.write_text("kept\n")
    with open(data) as a, open(log, "a") as b, open(other) as c:
        ids = file_identity.load(file_identity.identities([os.getpid()]))
        assert a and b and c
    assert ids[str(data)].ino == os.stat(data).st_ino
    assert file_identity.problems([str(data), str(log), str(other)], ids, same_host=True) == []
    # a local user swaps two of the job's files for links to root's, and one for a file of their own
    _as_nobody("sh", "-c", f"rm -f {data} {log} && ln -s {secret} {data} && ln -s {victim} {log}")
    os.unlink(other)
    _as_nobody("sh", "-c", f"echo mine > {other}")
    found = file_identity.problems([str(data), str(log), str(other)], ids, same_host=False)
    assert len(found) == 3, found
    assert f"{data} is a symbolic link" in found[0] and f"{log} is a symbolic link" in found[1]
    assert "belongs to uid 65534 now, to uid 0" in found[2]
    with pytest.raises(file_identity.FilesChanged) as e:
        file_identity.Reopen(ids, "host-a").check([str(data)], "host-b")
    assert e.value.code == "files_changed" and "nothing was restored" in e.value.action
    assert victim.read_text() == "x" * 50


def test_on_the_host_of_the_dump_another_inode_at_the_path_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("a")
    with open(f) as h:
        ids = file_identity.load(file_identity.identities([os.getpid()]))
        assert h
    (tmp_path / "new").write_text("a")
    os.rename(tmp_path / "new", f)  # same owner, same contents: another file
    assert file_identity.problems([str(f)], ids, same_host=False) == []
    assert "is another file" in file_identity.problems([str(f)], ids, same_host=True)[0]


def test_a_rollback_never_cuts_back_through_a_link(shared):
    """The audit's C1: the job's log turned into a link to a root file between the snapshot and the
    rollback.  The rollback refuses; the root file keeps its 50 bytes."""
    d, victim, _ = shared
    log = d / "log"
    with open(log, "a") as f:
        f.write("one\n")
        f.flush()
        snap = [w for w in written_files([os.getpid()]) if w.path == str(log)]
        f.write("two\n")
    assert snap[0].file_id is not None and snap[0].file_id.uid == 0
    _as_nobody("sh", "-c", f"rm -f {log} && ln -s {victim} {log}")
    for same_host in (True, False):
        with pytest.raises(FailedPrecondition, match="is a symbolic link") as e:
            cut_back(snap, same_host=same_host)
        assert e.value.code == "files_changed"
    assert victim.read_text() == "x" * 50 and victim.stat().st_uid == 0


def test_a_rollback_cuts_back_the_recorded_file_only(tmp_path):
    log = tmp_path / "log"
    with open(log, "a") as f:
        f.write("one\n")
        f.flush()
        snap = [w for w in written_files([os.getpid()]) if w.path == str(log)]
        f.write("two\n")
    os.rename(log, tmp_path / "moved")
    log.write_text("one\ntwo\n")  # the same bytes in another file, put there since
    with pytest.raises(FailedPrecondition, match="another file"):
        cut_back(snap, same_host=True)
    assert cut_back(snap, same_host=False) == [{"path": str(log), "from": 8, "to": 4}]
