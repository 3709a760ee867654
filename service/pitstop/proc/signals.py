"""Signals to a worker's tree, as they would arrive outside pitstop.

A worker runs in a PID namespace of its own.  Under pitstop's init (native/pitinit.c) a signal
sent to the namespace's pid 1 is passed on to the command, where it does what it does anywhere.
Without the init the command *is* pid 1, and the kernel drops every signal pid 1 has no handler
for: a SIGTERM the program never asked to handle would be ignored, so it is made a SIGKILL,
which is what SIGTERM would have done to the program outside a namespace.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

DEFAULT_ACTION_ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Signals that, sent to a rank (forwarded by its launcher, or by `pitstop stop|kill`), ask for its
# end: a rank that ends after one was stopped, not lost (coordinator/recovery.py)
ASKS_FOR_END = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL)

NAMES = {s.name.removeprefix("SIG"): int(s) for s in signal.Signals if not s.name.startswith("SIG_")}


def parse(value: str | int) -> int:
    """A signal by number or name (TERM, SIGTERM, 15); ValueError saying what is accepted."""
    if isinstance(value, int) or str(value).isdigit():
        n = int(value)
        if n in {int(s) for s in signal.Signals}:
            return n
        raise ValueError(f"no signal number {n} here")
    name = str(value).upper().removeprefix("SIG")
    if name in NAMES:
        return NAMES[name]
    raise ValueError(f"unknown signal {value!r}: give a name (TERM, INT, KILL, USR1) or a number")


def handles(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (its SigCgt mask)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    except OSError:
        pass
    return False


def as_delivered(root: int, sig: int, under_init: bool) -> int:
    """The signal to send to a worker's namespace root so that `sig` does what it would do outside."""
    if under_init or sig not in DEFAULT_ACTION_ENDS or handles(root, sig):
        return sig
    return signal.SIGKILL


def send(root: int, sig: int, under_init: bool) -> bool:
    """Send `sig` to the worker whose namespace root is `root`; whether it was there to receive it."""
    try:
        os.kill(root, as_delivered(root, sig, under_init))
    except ProcessLookupError:
        return False
    return True
