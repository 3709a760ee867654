"""Where pitstop's native libraries are: native/build (make native) or a path an operator set.

One place, so that a packaged install (libraries under /usr/lib, say) changes one variable per
library and the launcher, the capture and `pitstop doctor` all follow it."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "native" / "build"


def built(var: str, name: str, default_dir: Path = BUILD) -> Path | None:
    """The library `name` as $`var` names it, else in `default_dir`; None when it is not there
    (callers say what is lost without it and which command builds it)."""
    p = Path(os.environ.get(var, default_dir / name))
    return p if p.exists() else None
