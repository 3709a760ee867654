"""A local user must never reach what root dumps or restores (safepath.py, criu/seal.py).

The attacks, as an audit ran them as `nobody` (uid 65534): create the agent's image directory
before the agent does, inside a world-writable /dev/shm, and keep it; or change the bytes of a
dump before a rollback restores them.  Before the fix the agent took the directory as it found it
(mkdir exist_ok, chmod only) and a rollback restored whatever the files held."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from pitstop import safepath
from pitstop.agent.settings import AgentSettings
from pitstop.criu import netlock
from pitstop.dev.devcluster import free_port, pitstop_cmd
from pitstop.errors import IntegrityError
from pitstop.proc import proctree

from .helpers import wait_for_step

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.fixture
def sticky():
    """A world-writable sticky directory, as /dev/shm and /tmp are (where nobody can reach it)."""
    d = Path(tempfile.mkdtemp(prefix="pitstop-sec-", dir="/dev/shm"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(*cmd: str) -> None:
    subprocess.run([*AS_NOBODY, *cmd], check=True, timeout=30)


def test_the_default_image_directory_is_not_under_a_world_writable_one():
    images = AgentSettings(name="h").images
    assert images == Path("/run/pitstop/images/h")
    assert not str(images).startswith(("/dev/shm", "/tmp"))


@pytest.mark.timeout(30)
def test_a_directory_another_user_made_first_is_refused_and_left_as_it_was(sticky):
    _as_nobody("mkdir", "-p", str(sticky / "pitstop" / "agent"))
    _as_nobody("touch", str(sticky / "pitstop" / "agent" / "planted"))
    for target in (sticky / "pitstop" / "agent", sticky / "pitstop" / "agent" / "deeper"):
        with pytest.raises(safepath.UnsafePath) as e:
            safepath.private_dir(target)
        assert "belongs to uid 65534" in e.value.message and str(sticky / "pitstop") in e.value.message
        assert e.value.action
    st = os.stat(sticky / "pitstop" / "agent")
    assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o755  # nothing chmod'ed, nothing made
    assert os.listdir(sticky / "pitstop" / "agent") == ["planted"]


@pytest.mark.timeout(30)
def test_a_symlink_or_a_directory_others_can_write_is_refused(sticky, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    os.symlink(mine, sticky / "link")
    with pytest.raises(safepath.UnsafePath, match="symbolic link"):
        safepath.private_dir(sticky / "link" / "images")
    assert not (mine / "images").exists()
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)  # writable by all, no sticky bit: an entry of ours could be renamed away
    with pytest.raises(safepath.UnsafePath, match="group or others may write"):
        safepath.private_dir(loose / "images")
    assert not (loose / "images").exists()


@pytest.mark.timeout(30)
def test_a_directory_of_ours_in_a_sticky_one_is_used_and_tightened(sticky):
    d = safepath.private_dir(sticky / "pitstop" / "agent")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.stat(d).st_uid == os.geteuid()
    os.chmod(d, 0o755)
    safepath.private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.timeout(60)
def test_an_agent_refuses_to_start_on_an_image_directory_nobody_planted(sticky):
    state = tempfile.mkdtemp(prefix="pitstop-sec-", dir="/tmp")
    images = sticky / "pitstop" / "a"
    _as_nobody("mkdir", "-p", str(images))
    _as_nobody("touch", str(images / "left"))
    try:
        p = subprocess.run([*pitstop_cmd(), "agent", "--name", "a", "--insecure", "--listen", f"127.0.0.1:{free_port()}",
                            "--state-dir", state, "--image-dir", str(images)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode != 0
        err = p.stdout + p.stderr
        assert "unsafe_path" in err or "not safe to use" in err, err
        assert "belongs to uid 65534" in err, err
        assert os.listdir(images) == ["left"] and os.stat(images).st_uid == NOBODY
        assert not _is_mount(images)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def _is_mount(path: Path) -> bool:
    from pitstop.agent import imagefs

    return imagefs.mount_of(path)[0] == os.path.realpath(path)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_rollback_refuses_images_changed_after_the_dump(cluster, tmp_path):
    """Before: the rollback restored the altered file, and the restored worker held its bytes."""
    from .test_agent_e2e import _job

    a, b, out, ranks = _job(cluster, tmp_path, steps=400)
    wait_for_step(ranks[1].log, 5)
    ca = a.client()
    ca.pause("j.0")
    cap = ca.wait_capture(ca.capture("j.1", dest_url=b.url, image_id="img-tamper")["id"], 120)
    try:
        assert cap.state == "sent" and cap.seal
        images = Path(cap.image_dir)
        assert stat.S_IMODE(os.stat(a.image_dir).st_mode) == 0o700
        pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        assert len(cap.seal[pages.name]) == 5, "the stream's digest joins the seal"
        assert all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in images.iterdir() if f.is_file()), \
            "the dump's files are root's alone (the agent's umask 077)"
        with open(pages, "r+b") as f:  # what an attacker with write access would do: same size, same inode
            f.seek(8192)
            byte = f.read(1)
            f.seek(8192)
            f.write(bytes([byte[0] ^ 0xFF]))
        pid = ca.worker("j.1").root_pid
        with pytest.raises(IntegrityError) as e:
            ca.rollback(cap.id)
        assert pages.name in e.value.message and "changed after the dump" in e.value.message
        assert proctree.state(pid) == "T", "the source is left stopped, not replaced by a tampered copy"
        assert ca.worker("j.1").root_pid == pid
    finally:  # the stopped source holds its dump's network lock: lifted, the job ended
        netlock.release(getattr(cap, "run_id", ""))
        for wid in ("j.0", "j.1"):
            for p in reversed(proctree.tree(ca.worker(wid).root_pid)):
                try:
                    os.kill(p, 9)
                except ProcessLookupError:
                    pass


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_images_of_a_failed_rollback_expire(cluster, tmp_path):
    """Before: when a move and its rollback both failed, the source's images (its whole memory)
    stayed in the host's RAM for ever."""
    from .helpers import ddp_cmd, until

    env = {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "rollback:before_restore=fail",
           "PITSTOP_AGENT_FAILED_ROLLBACK_KEEP_S": "2"}
    with cluster.starting():
        a = cluster.start_agent("a", env=env)
        b = cluster.start_agent("b", spare=True)
    ranks = cluster.start_job("j", ddp_cmd(tmp_path / "out", steps=400), 2, {0: "a", 1: "a"})
    for r in range(2):
        cluster.wait_registered("a", f"j.{r}")
    wait_for_step(ranks[1].log, 5)
    ca = a.client()
    ca.pause("j.0")
    cap = ca.wait_capture(ca.capture("j.1", dest_url=b.url, image_id="img-expire")["id"], 120)
    try:
        assert cap.state == "sent"
        images = Path(cap.image_dir)
        with pytest.raises(Exception):  # the injected restore failure
            ca.rollback(cap.id)
        assert images.is_dir(), "kept for a while: a retry may still succeed"
        def ended():  # noqa: ANN202
            c = [c for c in ca.captures() if c.id == cap.id][0]
            return c if c.state == "failed" else None

        after = until(ended, timeout=30, what="the failed rollback's capture ended")
        assert not images.exists() and "deleted after" in after.error["details"]["images"], after
    finally:
        netlock.release(getattr(cap, "run_id", ""))
        for p in reversed(proctree.tree(ca.worker("j.0").root_pid)):
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        b.client().discard("img-expire")
