"""The agent's image directory on a huge-page tmpfs of its own (agent/imagefs.py): mounted where
that is safe, used as found where it is a mount already, never over images an earlier run
left, unmounted at a clean shutdown, and detached by a local cluster's teardown otherwise."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from pitstop.agent import imagefs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _is_mount(path) -> bool:  # noqa: ANN001
    return imagefs.mount_of(path)[0] == os.path.realpath(path)


def test_the_agent_mounts_a_huge_page_tmpfs_and_unmounts_it_at_shutdown(cluster):
    a = cluster.start_agent("a")
    fs = a.client().info()["image_fs"]
    assert fs == {"path": str(a.image_dir), "fstype": "tmpfs", "huge_pages": True, "mounted_by_agent": True}
    assert "huge=within_size" in imagefs.mount_of(a.image_dir)[2]
    cluster.stop_agent("a")
    assert not _is_mount(a.image_dir)


def test_an_image_directory_holding_images_is_not_hidden_under_a_mount(cluster):
    images = cluster.shm / "b"
    images.mkdir(parents=True)
    (images / "left-by-an-operator").write_text("x")
    b = cluster.start_agent("b", image_dir=images)
    fs = b.client().info()["image_fs"]
    assert not fs["mounted_by_agent"] and not _is_mount(images)
    assert (images / "left-by-an-operator").exists()
    assert "would hide" in b.log.read_text()


def test_a_mount_in_place_is_used_as_it_is_and_off_means_off(cluster, tmp_path):
    images = tmp_path / "own"
    images.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(images)], check=True)
    try:
        c = cluster.start_agent("c", image_dir=images)
        fs = c.client().info()["image_fs"]
        assert fs["fstype"] == "tmpfs" and not fs["huge_pages"] and not fs["mounted_by_agent"]
        cluster.stop_agent("c")
        assert _is_mount(images)  # not the agent's to unmount
    finally:
        subprocess.run(["umount", str(images)], check=True)
    d = cluster.start_agent("d", env={"PITSTOP_AGENT_IMAGE_MOUNT": "off"})
    assert not d.client().info()["image_fs"]["mounted_by_agent"] and not _is_mount(d.image_dir)


def test_a_killed_agent_leaves_its_mount_to_its_next_start_and_the_teardown(cluster):
    e = cluster.start_agent("e")
    cluster.stop_agent("e", signal.SIGKILL)
    assert _is_mount(e.image_dir)
    e2 = cluster.start_agent("e", port=int(e.url.rsplit(":", 1)[1]))
    fs = e2.client().info()["image_fs"]
    assert fs["huge_pages"] and not fs["mounted_by_agent"]  # the earlier run's mount, used as found
    cluster.stop_agent("e", signal.SIGKILL)
    # the cluster fixture's teardown detaches it and checks that nothing is left
