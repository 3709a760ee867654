"""Run the coordinator."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Callable

import structlog
import uvicorn
import uvloop

from pitstop import fdlimit, priority, tls
from pitstop.coordinator.api import build
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.snapshots import TICK_S
from pitstop.coordinator.store import Store
from pitstop.endpoints import listening_socket
from pitstop.errors import FailedPrecondition
from pitstop.httpapi import RequestGuard, with_header_deadline
from pitstop.sdnotify import notify, watchdog_loop
from pitstop.stopping import STOP_S, leave_within

CONCURRENCY = 4096
"""Connections and requests at once; past it uvicorn answers 503.  Each agent keeps one
connection for its beats: room for a few thousand hosts, not for unbounded memory."""

log = structlog.get_logger("pitstop.coordinator")


async def flush_loop(store: Store, every_s: float) -> None:
    """Write the beats gathered in memory (Store.flush), off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(store.flush)
        except Exception as e:  # noqa: BLE001 - kept in memory and retried at the next tick
            log.warning("could not write heartbeats to the database; will retry", error=repr(e)[:200])


async def prune_loop(store: Store, retention_s: float, every_s: float = 3600.0) -> None:
    """Forget finished operations past their retention, hourly, off the event loop."""
    while True:
        try:
            n = await asyncio.to_thread(store.prune_ops, retention_s)
            if n:
                log.info("finished operations past their retention forgotten", count=n, retention_s=retention_s)
        except Exception as e:  # noqa: BLE001 - the next tick tries again
            log.warning("could not prune old operations; will retry", error=repr(e)[:200])
        await asyncio.sleep(every_s)


async def watch_loop(watches: list[Callable[[], list[str]]], every_s: float) -> None:
    """The watchdogs (Driver.watch, Recoveries.watch), off the event loop, until cancelled: an
    operation whose thread died is driven out (an evacuation rolled back, or committed; a recovery
    run again), and its record written once the database takes writes again."""
    while True:
        await asyncio.sleep(every_s)
        for watch in watches:
            try:
                await asyncio.to_thread(watch)
            except Exception as e:  # noqa: BLE001 - the next tick looks again
                log.warning("operation watchdog failed; will look again", error=repr(e)[:200])


async def tick_loop(name: str, tick: Callable[[], None], every_s: float) -> None:
    """A periodic duty (the snapshot schedule, failure detection), off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(tick)
        except Exception as e:  # noqa: BLE001 - the next tick looks again
            log.warning(f"{name} failed; will look again", error=repr(e)[:300])


def serve(s: CoordinatorSettings) -> None:
    priority.apply(s.nice, "coordinator", realtime=s.realtime)  # first: every thread started later inherits it
    os.umask(0o077)  # as the systemd unit's UMask=: what it writes (state, images, outputs) is its own
    if not s.insecure and not (s.operator_token and s.cluster_token):
        missing = [n for n, v in (("PITSTOP_TOKEN", s.operator_token), ("PITSTOP_CLUSTER_TOKEN", s.cluster_token))
                   if not v]
        raise FailedPrecondition(f"refusing to start without {' and '.join(missing)}", code="no_token",
                                 action="set them (operators use PITSTOP_TOKEN, agents PITSTOP_CLUSTER_TOKEN), "
                                        "or pass --insecure for local development")
    host, port = s.host_port()
    sock = listening_socket(host, port, "the coordinator's API (--listen)")
    udp_sock = None
    try:
        if s.beat_udp:  # the same port, for beats as datagrams
            udp_sock = listening_socket(host, port, "heartbeats (--listen)", datagram=True)
        try:
            app, driver = build(s)
        except (OSError, sqlite3.Error) as e:
            raise FailedPrecondition(f"cannot open the database {s.db}: {getattr(e, 'strerror', None) or e}",
                                     code="database", action="give --db a path on a writable local file system "
                                                             "(SQLite needs its directory writable too)") from None
    except BaseException:
        sock.close()
        if udp_sock is not None:
            udp_sock.close()
        raise
    touched = driver.reconcile()
    coord = app.app.state.coordinator  # type: ignore[attr-defined]  # the FastAPI app behind the beats
    # a snapshot the last coordinator left under way: its job resumed off the start's path (a host's
    # answer may wait for its dump under way to end), before the recoveries run again
    undo = threading.Thread(target=coord.snapshots.reconcile, name="reconcile-snapshots", daemon=True)
    undo.start()
    touched += coord.recoveries.reconcile(after=undo)
    guarded = RequestGuard(app, tokens=lambda: (s.operator_token, s.read_token, s.cluster_token))
    server = uvicorn.Server(uvicorn.Config(guarded, host=host, port=port, log_level="warning", lifespan="off",
                                           http=with_header_deadline(tls.http_protocol(), s.header_timeout_s,
                                                                     s.max_connections_per_source),
                                           limit_concurrency=fdlimit.concurrency(CONCURRENCY, "the coordinator"),
                                           timeout_graceful_shutdown=int(STOP_S // 2),
                                           **tls.server_kwargs()))

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        udp = None
        if udp_sock is not None:
            udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(app.datagrams, sock=udp_sock)
        dog = asyncio.create_task(watchdog_loop())
        flusher = asyncio.create_task(flush_loop(driver.store, s.flush_s))
        watcher = asyncio.create_task(watch_loop([driver.watch, coord.recoveries.watch], s.watchdog_s))
        pruner = asyncio.create_task(prune_loop(driver.store, s.ops_retention_days * 86400))
        duties = [asyncio.create_task(tick_loop("snapshot schedule", coord.snapshots.tick, TICK_S)),
                  asyncio.create_task(tick_loop("failure detection", coord.recoveries.tick, TICK_S))]
        log.info("coordinator up", listen=s.listen, db=str(s.db), reconciled=touched)
        notify(f"READY=1\nSTATUS=coordinator serving {s.listen}")
        await serving
        notify("STOPPING=1")
        dog.cancel()
        flusher.cancel()
        pruner.cancel()
        watcher.cancel()
        for d in duties:
            d.cancel()
        if udp is not None:
            udp.close()
        driver.store.flush()

    uvloop.run(main())  # libuv's loop: 0.45 instead of 0.49 cores at 3,000 HTTP beats/s (bench/heartbeat_load.py)
    leave_within(STOP_S, "coordinator")
