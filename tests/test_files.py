"""The paths a worker's restore needs, and what another host lacks of them (proc/files.py).

Real processes; the end-to-end refusal, with a spare whose agent sees a tmpfs over the job's
directory, is in tests/test_coordinator_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pitstop.proc import files, proctree

pytestmark = pytest.mark.timeout(60)

HOLDER = r"""
import mmap, os, sys, time
d = sys.argv[1]
os.chdir(d)
log = open("train.log", "a")                      # open, kept
gone = open("scratch.tmp", "w"); os.unlink("scratch.tmp")   # deleted: CRIU carries it
data = open("weights.bin", "rb")
m = mmap.mmap(data.fileno(), 0, prot=mmap.PROT_READ)        # mapped
print("ready", flush=True)
time.sleep(60)
"""


def test_a_workers_paths_are_listed_with_their_kind_and_the_kernels_left_out(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"w" * 8192)
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        used = {f.path: f for f in files.used_files(proctree.tree(p.pid))}
        assert used[str(tmp_path / "weights.bin")] == files.UsedFile(str(tmp_path / "weights.bin"), "mapped", 8192)
        assert used[str(tmp_path / "train.log")].kind == "open"
        assert used[str(tmp_path)].kind == "dir"  # its working directory
        assert used[os.path.realpath(sys.executable)].kind == "mapped"  # the interpreter itself
        assert not any("scratch.tmp" in x or x.startswith(("/dev/", "/proc/", "/sys/")) for x in used), used
        assert files.lacking(list(used.values())) == []  # this host has them all
    finally:
        p.kill()
        p.wait()


def test_what_a_host_lacks_is_named_with_why(tmp_path):
    (tmp_path / "lib.so").write_bytes(b"x" * 100)
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "a-dir")
    want = [files.UsedFile(str(tmp_path / "linked" / "x.py"), "open"),      # through a link: never followed
            files.UsedFile(str(tmp_path / "lib.so"), "mapped", 100),        # present, same size
            files.UsedFile(str(tmp_path / "lib.so"), "mapped", 120),        # present, other size
            files.UsedFile(str(tmp_path / "gone.py"), "open"),              # missing
            files.UsedFile(str(tmp_path / "a-dir"), "open"),                # a directory, not a file
            files.UsedFile(str(tmp_path / "lib.so"), "dir"),                # a file, not a directory
            files.UsedFile(str(tmp_path / "a-dir"), "dir")]                 # present
    assert files.lacking(want) == [
        {"path": str(tmp_path / "linked" / "x.py"),
         "why": f"a symbolic link is in its path here ({tmp_path / 'linked'}); a restore does not follow links"},
        {"path": str(tmp_path / "lib.so"), "why": "100 bytes here, 120 where the worker runs"},
        {"path": str(tmp_path / "gone.py"), "why": "missing"},
        {"path": str(tmp_path / "a-dir"), "why": "not a regular file here"},
        {"path": str(tmp_path / "lib.so"), "why": "not a directory here"}]
