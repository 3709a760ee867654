"""`pitstop provision-criu`: give this host the CRIU pitstop runs, from an installed pitstop.

Why: a host without a good enough CRIU was told to run `make criu`, a target of the source
checkout that a host installed from a wheel does not have.  The two scripts that target runs
(scripts/provision-criu.sh: Debian's CRIU >= 4.2 in a private prefix unless the host's passes;
scripts/build-criu.sh: the CRIU pitstop carries, 4.2.1 with criu/patches/) ship inside the wheel,
laid out as in the checkout (setup.py), so build-criu.sh finds its patches where it always does
(../criu/patches beside its own directory).  They install into the prefixes criu/runtime.py looks
in, so the next `pitstop doctor` or agent start finds what they made.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from pitstop.errors import FailedPrecondition

SHIPPED = Path(__file__).resolve().parent / "provisioning"
"""Where a wheel carries the scripts and the patch series (setup.py's build_py)."""
CHECKOUT = Path(__file__).resolve().parents[3]
"""The source checkout's root, for an editable install."""
SCRIPTS = ("scripts/provision-criu.sh", "scripts/build-criu.sh")
BUILD_TIMEOUT_S = 3600.0  # a download and a build of CRIU on a slow host


def root() -> Path:
    """The directory holding scripts/ and criu/patches/: the wheel's copy first, else the checkout."""
    for r in (SHIPPED, CHECKOUT):
        if all((r / s).is_file() for s in SCRIPTS) and (r / "criu" / "patches" / "series").is_file():
            return r
    raise FailedPrecondition("this pitstop carries no CRIU provisioning scripts (neither "
                             f"{SHIPPED / 'scripts'} nor {CHECKOUT / 'scripts'} has them)", code="no_provisioning",
                             action="reinstall pitstop from a wheel built by its setup.py (`pip install .` in the "
                                    "source), or install CRIU >= 4.2 yourself and set PITSTOP_CRIU to it")


@dataclass
class Step:
    script: str
    ok: bool
    path: str  # what the script printed: the criu it provides
    log: str   # its stderr, the last lines of which say why where it failed


def run(script: str, timeout_s: float = BUILD_TIMEOUT_S) -> Step:
    """Run one shipped script with bash (a wheel may not keep its mode bits); its output is kept."""
    r = root()
    try:
        p = subprocess.run(["bash", str(r / script)], capture_output=True, text=True, timeout=timeout_s, cwd=r)
    except subprocess.TimeoutExpired as e:
        return Step(script, False, "", f"{script} ran past {timeout_s:.0f} s: {(e.stderr or b'')[-2000:]!r}")
    return Step(script, p.returncode == 0, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "",
                p.stderr)


def provision(carried: bool = True) -> list[Step]:
    """A stock CRIU >= 4.2 (the host's if it passes, else Debian's in a private prefix), then, with
    `carried`, the CRIU pitstop carries.  The carried build failing leaves the stock one in use,
    as `make criu` does; the stock step failing stops here."""
    steps = [run(SCRIPTS[0])]
    if steps[0].ok and carried:
        steps.append(run(SCRIPTS[1]))
    return steps
