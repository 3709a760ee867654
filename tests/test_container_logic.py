"""Ranks in containers, the logic: which container a cgroup names, how a container's configuration
is rewritten for the host it moves to, what its archive holds, and what podman's figures say.
The end-to-end behaviour (real podman, runc and CRIU) is tests/test_container_e2e.py."""

from __future__ import annotations

import io
import json
import shutil
import tarfile

import pytest

from pitstop.container import config, needs, podman, ref
from pitstop.transfer import stream

PODMAN_ID = "a" * 64
OTHER_ID = "b" * 64


@pytest.mark.parametrize("text, engine", [
    (f"0::/libpod_parent/libpod-{PODMAN_ID}\n", "podman"),
    (f"9:name=systemd:/machine.slice/libpod-{PODMAN_ID}.scope/container\n", "podman"),
    (f"0::/system.slice/docker-{PODMAN_ID}.scope\n", "docker"),
    (f"4:memory:/docker/{PODMAN_ID}\n", "docker"),
    (f"0::/kubepods.slice/kubepods-besteffort.slice/crio-{PODMAN_ID}.scope\n", "cri-o"),
    (f"0::/kubepods/besteffort/pod1/cri-containerd-{PODMAN_ID}.scope\n", "containerd"),
])
def test_a_containers_cgroup_names_its_engine_and_id(text, engine):
    found = ref.of_cgroup(text)
    assert found == ref.Found(engine, PODMAN_ID)


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-0.slice/session-1.scope\n",
    f"0::/machine.slice/libpod-conmon-{PODMAN_ID}.scope\n",  # the container's monitor, not the container
    f"0::/libpod_parent/libpod-{PODMAN_ID[:40]}\n",  # not a full id
    "",
])
def test_a_process_outside_any_container_has_none(text):
    assert ref.of_cgroup(text) is None


def test_paths_that_name_the_old_host_are_moved_and_no_others():
    doc = {"staticDir": "/var/lib/a/storage/overlay-containers/x/userdata",
           "conmonPidFile": "/run/a/overlay-containers/x/userdata/conmon.pid",
           "mounts": [{"source": "/run/pitstop-a", "destination": "/run/pitstop"},
                      {"source": "/run/pitstop-ab/data", "destination": "/data"},  # only shares a prefix of the name
                      {"source": "/data/shared", "destination": "/shared"}],
           "CreateCommand": ["podman", "--root", "/var/lib/a/storage"], "n": 3, "ok": True}
    got = config.rewrite_paths(doc, {"/var/lib/a/storage": "/srv/b", "/run/a": "/run/b",
                                     "/run/pitstop-a": "/run/pitstop", "/data": "/data"})
    assert got["staticDir"] == "/srv/b/overlay-containers/x/userdata"
    assert got["conmonPidFile"] == "/run/b/overlay-containers/x/userdata/conmon.pid"
    assert got["mounts"][0] == {"source": "/run/pitstop", "destination": "/run/pitstop"}
    assert got["mounts"][1]["source"] == "/run/pitstop-ab/data"
    assert got["mounts"][2]["source"] == "/data/shared"
    assert got["CreateCommand"][2] == "/srv/b" and got["n"] == 3 and got["ok"] is True


def test_the_longest_prefix_wins():
    got = config.rewrite_paths(["/s/a/b/c", "/s/a/x"], {"/s/a": "/t", "/s/a/b": "/u"})
    assert got == ["/u/c", "/t/x"]


def _export(tmp_path, files: dict[str, bytes], link_checkpoint: bool = True):
    """An archive laid out as `podman container checkpoint --export` writes it, its checkpoint a link."""
    path = tmp_path / "export.tar"
    with tarfile.open(path, "w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        if link_checkpoint:
            info = tarfile.TarInfo("checkpoint")
            info.type, info.linkname = tarfile.SYMTYPE, "/elsewhere/images"
            t.addfile(info)
    return path


def test_the_exports_own_files_travel_with_the_images_and_the_spares_archive_is_rewritten(tmp_path):
    cfg = {"id": PODMAN_ID, "name": "r1", "staticDir": "/g/a/overlay-containers/x/userdata"}
    spec = {"root": {"path": "/g/a/overlay/l/merged"}, "mounts": [{"source": "/sock-a", "destination": "/run/pitstop"}]}
    export = _export(tmp_path, {"config.dump": json.dumps(cfg).encode(), "spec.dump": json.dumps(spec).encode(),
                                "ctr.log": b"step 1\n", "network.status": b"{}", "artifacts/x": b"no"})
    images = tmp_path / "images"
    images.mkdir()
    kept = config.keep_from_export(export, images)
    assert sorted(kept) == ["config.dump", "ctr.log", "network.status", "spec.dump"]
    # named apart from CRIU's files, and not *.log, which the image stream leaves out (the log travels)
    assert sorted(p.name for p in images.iterdir()) == ["ctr-config.dump", "ctr-ctr-log", "ctr-network.status",
                                                        "ctr-spec.dump"]
    assert not any(stream._skipped(p.name) for p in images.iterdir())
    archive = tmp_path / "import.tar"
    got = config.import_tar(images, archive, {"/g/a": "/g/b", "/sock-a": "/sock-b"})
    assert got["staticDir"] == "/g/b/overlay-containers/x/userdata" and got["id"] == PODMAN_ID
    with tarfile.open(archive) as t:
        names = sorted(t.getnames())
        spec2 = json.loads(t.extractfile("spec.dump").read())
        log = t.extractfile("ctr.log").read()
    assert names == ["config.dump", "ctr.log", "network.status", "spec.dump"]  # no checkpoint: it is linked
    assert spec2["root"]["path"] == "/g/b/overlay/l/merged" and spec2["mounts"][0]["source"] == "/sock-b"
    assert log == b"step 1\n"


def test_an_export_without_the_containers_configuration_is_refused(tmp_path):
    export = _export(tmp_path, {"ctr.log": b"x"})
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(ValueError, match="config.dump"):
        config.keep_from_export(export, images)


def test_what_a_move_needs_of_a_container_is_read_from_podmans_record():
    info = {"Id": PODMAN_ID, "Name": "r1", "Image": OTHER_ID, "ImageName": "localhost/t:1", "OCIRuntime": "runc",
            "StaticDir": "/g/overlay-containers/x/userdata",
            "HostConfig": {"NetworkMode": "host", "AutoRemove": True,
                           "Devices": [{"PathOnHost": "/dev/fuse", "PathInContainer": "/dev/fuse"}]},
            "Mounts": [{"Type": "bind", "Source": "/data", "Destination": "/data"},
                       {"Type": "volume", "Source": "/var/lib/v", "Destination": "/v"}]}
    got = needs.record(info)
    assert got == {"id": PODMAN_ID, "name": "r1", "image": OTHER_ID, "image_name": "localhost/t:1",
                   "runtime": "runc", "static_dir": "/g/overlay-containers/x/userdata", "network": "host",
                   "auto_remove": True, "mounts": [{"source": "/data", "destination": "/data"}],
                   "devices": ["/dev/fuse"]}


def test_podmans_figures_are_read_in_seconds():
    out = 'abc\n{"podman_checkpoint_duration": 700000, "container_statistics": [{"Id": "x", ' \
          '"runtime_checkpoint_duration": 450000, "criu_statistics": {"freezing_time": 1000, ' \
          '"frozen_time": 380000, "memdump_time": 210000, "pages_written": 65000}}]}'
    assert podman._stats(out, "criu_statistics") == {"freezing_time": 0.001, "frozen_time": 0.38,
                                                      "memdump_time": 0.21, "pages_written": 65000.0}
    assert podman._stats(out, "runtime_checkpoint_duration", scalar=True) == {"value": 0.45}
    assert podman._stats("no figures", "criu_statistics") == {}


def test_runc_checkpoints_and_a_crun_without_criu_is_named():
    if shutil.which("runc") is None and podman.runtime_path("runc") is None:
        pytest.skip("runc is not installed")
    assert podman.runtime_cannot_checkpoint("runc") is None
    assert "not installed" in (podman.runtime_cannot_checkpoint("no-such-runtime") or "")
    if podman.runtime_path("crun"):  # Debian's crun: built without CRIU
        import subprocess
        plus = "+CRIU" in subprocess.run([podman.runtime_path("crun"), "--version"], capture_output=True,
                                         text=True).stdout
        why = podman.runtime_cannot_checkpoint("crun")
        assert (why is None) == plus, why
        if not plus:
            assert "+CRIU" in why


def test_doctor_says_whether_ranks_in_containers_can_move_here():
    from pitstop import doctor

    c = doctor.containers()
    assert c.name == "ranks in containers" and not c.required
    if podman.Podman().version() is None:
        assert c.ok is None and "podman is not installed" in c.detail
    elif podman.runtime_cannot_checkpoint("runc") is None:
        assert c.ok is True and "runc" in c.detail, c.detail
