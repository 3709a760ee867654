"""Where pitstop's native libraries are: inside the installed package (a wheel built by setup.py),
else native/build and shim/build of a checkout (make native), or a path an operator set.

One place, so that a packaged install (libraries under /usr/lib, say) changes one variable per
library and the launcher, the capture and `pitstop doctor` all follow it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGED = Path(__file__).resolve().parent / "native"  # an installed wheel's (setup.py puts them there)
_in_wheel = (PACKAGED / "pitstop-init").exists()
BUILD = PACKAGED if _in_wheel else REPO / "native" / "build"
SHIM_DIR = PACKAGED if _in_wheel else REPO / "shim" / "build"


def built(var: str, name: str, default_dir: Path = BUILD) -> Path | None:
    """The library `name` as $`var` names it, else in `default_dir`; None when it is not there
    (callers say what is lost without it and which command builds it)."""
    p = Path(os.environ.get(var, default_dir / name))
    return p if p.exists() else None
