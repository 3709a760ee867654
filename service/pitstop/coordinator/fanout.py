"""One network call per item, all at once: the coordinator's rounds over agents and ranks."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from pitstop.coordinator.timeouts import HEARD_POLL_S
from pitstop.errors import Unavailable

T = TypeVar("T")


def in_parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """fn over items at once (each a network call with its own timeout); results in order,
    the first exception raised once all have ended."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(len(items), 32)) as ex:
        futures = [ex.submit(fn, x) for x in items]
        return [f.result() for f in futures]


class HostSilent(Unavailable):
    """The host a call was waiting on stopped reporting: it lost power or its network."""

    code = "host_silent"


def while_heard(fn: Callable[[], T], hosts: str | tuple[str, ...], heard: Callable[[str], bool], what: str) -> T:
    """fn() (a call to an agent, which may involve others: `hosts`), abandoned as soon as
    `heard(host)` turns false for one of them.

    Why: a host that loses power sends no reset; a call to it ends only at its own timeout (a
    dump's is minutes), and the coordinator would wait that long with every other rank of the
    job paused, and a recovery behind it.  Its heartbeats say sooner.  The abandoned call runs
    on in its daemon thread until its own timeout; its result is dropped."""
    done: Future[T] = Future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            done.set_exception(e)
    names = (hosts,) if isinstance(hosts, str) else hosts
    threading.Thread(target=call, daemon=True, name=f"call-{names[0]}").start()
    while True:
        try:
            return done.result(timeout=HEARD_POLL_S)
        except TimeoutError:
            for host in names:
                if not heard(host):
                    raise HostSilent(f"{host} went silent during {what}: the call was abandoned", action=(
                        f"{host} is treated as failed; check its power and network")) from None


def each_while_heard(fn: Callable[[str], T], hosts: list[str], heard: Callable[[str], bool], what: str) -> list[T]:
    """fn(host) for every host at once (in_parallel), each call abandoned once its own host is
    silent (while_heard)."""
    return in_parallel(lambda h: while_heard(lambda: fn(h), h, heard, what), hosts)


def by_agent(pairs: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(worker, agent) pairs as (agent, its workers), in first-seen order: one call per agent."""
    out: dict[str, list[str]] = {}
    for wid, node in pairs:
        out.setdefault(node, []).append(wid)
    return list(out.items())
