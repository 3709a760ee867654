"""One undo stack for a multi-step operation: each step that changes something pushes its way
back; a failure runs them all, last first.

Why one stack rather than cleanup written at every exit: a capture stops the worker's network,
its GPUs and then the worker itself, streams while it dumps, and may fail at any of those steps.
Written by hand at each exit, every new mode adds a branch to each of them, and one forgotten
line leaves a worker stopped.  Here a step's undo is written once, next to the step, and the
stack also says who will have resumed the worker if the move fails from here (an operation's
error tells the operator that: `source_resumed_by`).

Every undo runs even if an earlier one raised; the first error is raised once all have run,
so that a refused rollback (an IntegrityError: the dump changed at rest) is still reported while
the stream it left open is still closed.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

log = structlog.get_logger("pitstop.undo")

Step = Callable[[BaseException], object]  # what it returns is ignored


class Undo:
    def __init__(self, resumed_by: str) -> None:
        self._steps: list[tuple[str, Step]] = []
        self.resumed_by = resumed_by  # who resumes the worker should the operation fail from here

    def push(self, name: str, step: Step) -> None:
        self._steps.append((name, step))

    def stage(self, resumed_by: str, *, replace: tuple[str, ...] = (), push: tuple[tuple[str, Step], ...] = ()) -> None:
        """Enter a new stage: drop the undos named in `replace` (the new ones supersede them: a
        rollback from the dump replaces unlocking the network and the GPUs), push the new ones,
        and say who resumes the worker from here."""
        self._steps = [(n, s) for n, s in self._steps if n not in replace]
        self._steps.extend(push)
        self.resumed_by = resumed_by

    def names(self) -> list[str]:
        return [n for n, _ in self._steps]

    def unwind(self, error: BaseException) -> None:
        """Run every undo, last first, each told why; raise the first undo that failed, if any."""
        first: BaseException | None = None
        while self._steps:
            name, step = self._steps.pop()
            try:
                step(error)
            except BaseException as e:  # noqa: BLE001 - the other undos run all the same
                log.warning("an undo step failed", step=name, error=repr(e))
                first = first or e
        if first is not None:
            raise first
