"""The wheel is what a host installs: built from the source as `pip wheel` builds it, installed
outside the checkout, it must carry pitstop's native parts and pass `pitstop doctor` (given CRIU).

Before: `pip install .` built a pure-Python wheel (no shared library, no pitstop-init), and on a
host installed that way doctor ended "this host cannot migrate workers: ... run make native"."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_the_wheel_carries_its_native_parts_and_a_host_installed_from_it_passes_doctor(tmp_path):
    src = tmp_path / "src"  # a copy: a build leaves build/ and egg-info behind
    files = subprocess.run(["git", "ls-files", "service", "native", "shim", "setup.py", "pyproject.toml",
                            "README.md", "scripts/provision-criu.sh", "scripts/build-criu.sh", "criu/patches"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    wheels = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (whl,) = wheels.glob("pitstop-*.whl")
    assert not whl.name.endswith("-none-any.whl"), f"{whl.name}: native code needs a platform wheel"
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        for n in ("libpitstop_procself.so", "libpitstop_writetrack.so", "libpitstop_criutrack.so",
                  "libpitstop_criufill.so", "libpitstop_shim.so", "libnccl.so.2", "pitstop-init"):
            assert f"pitstop/native/{n}" in names, n
        assert (z.getinfo("pitstop/native/pitstop-init").external_attr >> 16) & stat.S_IXUSR
        for n in ("dashboard.html", "dashboard.js"):  # the coordinator's dashboard (package data)
            assert f"pitstop/coordinator/{n}" in names, n
        # what `pitstop provision-criu` runs, laid out as in the checkout: build-criu.sh finds its patches
        prov = "pitstop/criu/provisioning/"
        assert {prov + "scripts/provision-criu.sh", prov + "scripts/build-criu.sh"} <= names
        series = [ln.strip() for ln in z.read(prov + "criu/patches/series").decode().splitlines()
                  if ln.strip() and not ln.lstrip().startswith("#")]
        assert series and all(prov + "criu/patches/" + p in names for p in series), series

    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(whl)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(site))  # before the checkout's editable install on the path
    where = subprocess.run([sys.executable, "-c", "import pitstop.nativelib as n; print(n.BUILD); print(n.SHIM_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60).stdout.split()
    assert where == [str(site / "pitstop" / "native")] * 2, where
    d = subprocess.run([sys.executable, "-m", "pitstop.cli", "doctor", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    report = json.loads(d.stdout)
    assert report["ready"], report["reasons"]
    assert d.returncode == 0
    # doctor's advice for a host without CRIU works from the wheel: the scripts are the installed ones
    p = subprocess.run([sys.executable, "-c", "from pitstop.criu import provision; print(provision.root())"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == str(site / "pitstop" / "criu" / "provisioning"), p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "provision-criu", "--stock-only"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)  # idempotent: reuses what is there
    assert p.returncode == 0 and "runs now" in p.stdout, p.stdout + p.stderr
