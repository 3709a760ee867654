"""The wheel carries pitstop's native parts (native/, shim/) inside the package, built for the
platform it is built on, so that `pip install` of the wheel gives a host `pitstop doctor` accepts.
It also carries the scripts that give a host its CRIU (scripts/provision-criu.sh,
scripts/build-criu.sh) and the patch series the second applies (criu/patches/), laid out as in
the checkout under pitstop/criu/provisioning/: `pitstop provision-criu` runs them there.

Why a setup.py beside pyproject.toml: the native parts are plain C built by their Makefiles (no
Python extension modules), and setuptools' build_py is the one hook that runs for every wheel.
An editable install (`make setup`) builds nothing here: a checkout uses native/build and
shim/build, which `make native` fills (pitstop/nativelib.py finds either)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
SHIPPED = {  # what a host runs; the test job's abort tracer stays in the checkout
    "native/build": ("libnccl.so.2", "libpitstop_procself.so", "libpitstop_writetrack.so",
                     "libpitstop_criutrack.so", "libpitstop_criufill.so", "pitstop-init"),
    "shim/build": ("libpitstop_shim.so",),
}


PROVISIONING = ("scripts/provision-criu.sh", "scripts/build-criu.sh", "criu/patches")
"""What `pitstop provision-criu` runs (pitstop/criu/provision.py), relative to the checkout's root."""


class BuildWithNative(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for d in ("native", "shim"):
            subprocess.run(["make", "-C", str(ROOT / d)], check=True)
        dest = Path(self.build_lib) / "pitstop" / "native"
        dest.mkdir(parents=True, exist_ok=True)
        for d, names in SHIPPED.items():
            for n in names:
                shutil.copy2(ROOT / d / n, dest / n)  # copy2 keeps pitstop-init executable
        prov = Path(self.build_lib) / "pitstop" / "criu" / "provisioning"
        for rel in PROVISIONING:  # missing: a wheel whose doctor would advise what it cannot run
            (prov / rel).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / rel).is_dir():
                shutil.copytree(ROOT / rel, prov / rel, dirs_exist_ok=True)
            else:
                shutil.copy2(ROOT / rel, prov / rel)


class PlatformDistribution(Distribution):
    """Native code inside: the wheel is for this platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildWithNative}, distclass=PlatformDistribution)
