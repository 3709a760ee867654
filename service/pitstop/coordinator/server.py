"""Run the coordinator."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable

import structlog
import uvicorn
import uvloop

from pitstop import fdlimit, priority, tls
from pitstop.coordinator.api import build
from pitstop.coordinator.database import describe, open_store, shared
from pitstop.coordinator.leadership import Leadership
from pitstop.coordinator.service import Coordinator
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore, StoreUnavailable
from pitstop.coordinator.timeouts import DUTY_TICK_S, STEP_DOWN_PAUSE_S
from pitstop.endpoints import listening_socket
from pitstop.errors import FailedPrecondition
from pitstop.httpapi import RequestGuard, with_header_deadline
from pitstop.sdnotify import notify, watchdog_loop
from pitstop.stopping import STOP_S, leave_within

CONCURRENCY = 4096
"""Connections and requests at once; past it uvicorn answers 503.  Each agent keeps one
connection for its beats: room for a few thousand hosts, not for unbounded memory."""

log = structlog.get_logger("pitstop.coordinator")


Leading = Callable[[], bool]


async def flush_loop(store: BaseStore, every_s: float, leading: Leading = lambda: True) -> None:
    """Write the beats gathered in memory (Store.flush), off the event loop, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        if not leading():
            continue  # a standby takes no beats
        try:
            await asyncio.to_thread(store.flush)
        except Exception as e:  # noqa: BLE001 - kept in memory and retried at the next tick
            log.warning("could not write heartbeats to the database; will retry", error=repr(e)[:200])


async def prune_loop(store: BaseStore, retention_s: float, every_s: float = 3600.0,
                     leading: Leading = lambda: True) -> None:
    """Forget finished operations past their retention, hourly, off the event loop."""
    while True:
        try:
            n = await asyncio.to_thread(store.prune_ops, retention_s) if leading() else 0
            if n:
                log.info("finished operations past their retention forgotten", count=n, retention_s=retention_s)
        except Exception as e:  # noqa: BLE001 - the next tick tries again
            log.warning("could not prune old operations; will retry", error=repr(e)[:200])
        await asyncio.sleep(every_s)


async def watch_loop(watches: list[Callable[[], list[str]]], every_s: float, leading: Leading = lambda: True) -> None:
    """The watchdog (operations.Operations.watch), off the event loop, until cancelled: an
    operation whose thread died is driven out (an evacuation rolled back, or committed; a recovery
    run again), and its record written once the database takes writes again.  Only the leader's."""
    while True:
        await asyncio.sleep(every_s)
        for watch in watches:
            if not leading():
                break
            try:
                await asyncio.to_thread(watch)
            except Exception as e:  # noqa: BLE001 - the next tick looks again
                log.warning("operation watchdog failed; will look again", error=repr(e)[:200])


async def tick_loop(name: str, tick: Callable[[], None], every_s: float, leading: Leading = lambda: True) -> None:
    """A periodic duty (the snapshot schedule, failure detection), off the event loop, until
    cancelled: the leader's alone."""
    while True:
        await asyncio.sleep(every_s)
        if not leading():
            continue
        try:
            await asyncio.to_thread(tick)
        except Exception as e:  # noqa: BLE001 - the next tick looks again
            log.warning(f"{name} failed; will look again", error=repr(e)[:300])


def step_down(why: str) -> None:
    """This coordinator lost the lease (coordinator/leadership.py): it has already stopped acting
    (no write, no agent call passes); it now starts again, as a standby, so that no thread of its
    old term lives on: the same program, the same arguments, the same process id (what systemd
    and a test harness follow)."""
    log.error("no longer the leader: starting again as a standby", why=why)
    notify(f"STATUS=lost the lease ({why}); starting again as a standby")
    time.sleep(STEP_DOWN_PAUSE_S)  # the answers of requests already refused reach their clients
    os.execv(sys.executable, sys.orig_argv)


class _Server(uvicorn.Server):
    """uvicorn, handing the lease over as soon as it is told to stop (SIGTERM, SIGINT)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self.handed_over = threading.Event()

    def handle_exit(self, sig: int, frame: object) -> None:
        if not self.should_exit:
            threading.Thread(target=self._hand_over, name="hand-over", daemon=True).start()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    def _hand_over(self) -> None:
        try:
            self._on_exit()
        finally:
            self.handed_over.set()


def _refuse_unsafe(s: CoordinatorSettings, host: str) -> None:
    """What the coordinator will not start with, said before it binds anything."""
    if not s.insecure and not (s.operator_token and s.cluster_token):
        missing = [n for n, v in (("PITSTOP_TOKEN", s.operator_token), ("PITSTOP_CLUSTER_TOKEN", s.cluster_token))
                   if not v]
        raise FailedPrecondition(f"refusing to start without {' and '.join(missing)}", code="no_token",
                                 action="set them (operators use PITSTOP_TOKEN, agents PITSTOP_CLUSTER_TOKEN), "
                                        "or pass --insecure for local development")
    if shared(s.db) and not s.advertise_url and host in ("0.0.0.0", "::", ""):
        raise FailedPrecondition(f"--listen {s.listen} says on which addresses, not how the agents and the other "
                                 "coordinators reach this one", code="no_advertise_url",
                                 action="give --advertise-url http(s)://HOST:PORT (PITSTOP_COORDINATOR_ADVERTISE_URL): "
                                        "standbys send clients there while this coordinator leads")


def _bind_and_open(s: CoordinatorSettings, host: str, port: int) -> tuple[socket.socket, socket.socket | None,
                                                                          BaseStore, BaseStore]:
    """The API's socket (and the beats' datagram socket on the same port), then the database twice:
    the lease on a connection of its own.  A database that cannot be opened closes the sockets."""
    sock = listening_socket(host, port, "the coordinator's API (--listen)")
    udp_sock = None
    try:
        if s.beat_udp:  # the same port, for beats as datagrams
            udp_sock = listening_socket(host, port, "heartbeats (--listen)", datagram=True)
        try:
            return sock, udp_sock, open_store(s.db), open_store(s.db)
        except (OSError, sqlite3.Error) as e:
            raise FailedPrecondition(f"cannot open the database {s.db}: {getattr(e, 'strerror', None) or e}",
                                     code="database", action="give --db a path on a writable local file system "
                                                             "(SQLite needs its directory writable too)") from None
        except StoreUnavailable as e:  # a PostgreSQL server that does not answer, or refuses us
            raise FailedPrecondition(f"cannot open the database {describe(s.db)}: {e.message}", code="database",
                                     action=e.action) from None
    except BaseException:
        sock.close()
        if udp_sock is not None:
            udp_sock.close()
        raise


def serve(s: CoordinatorSettings) -> None:
    priority.apply(s.nice, "coordinator", realtime=s.realtime)  # first: every thread started later inherits it
    os.umask(0o077)  # as the systemd unit's UMask=: what it writes (state, images, outputs) is its own
    host, port = s.host_port()
    _refuse_unsafe(s, host)
    sock, udp_sock, store, lease_store = _bind_and_open(s, host, port)
    coords: list[Coordinator] = []
    lead = Leadership(store, lease_store, s.url(), s.lease_s,
                      on_lead=lambda term, gap: log.info("took over as leader", term=term,
                                                         resumed=coords[0].take_over(term, gap)),
                      on_lose=step_down, exclusive=not shared(s.db))
    app, driver = build(s, store, lead)
    coord: Coordinator = app.app.state.coordinator  # type: ignore[attr-defined]  # the FastAPI app behind the beats
    coords.append(coord)
    touched: list[str] = []
    try:
        if lead.try_acquire():  # a coordinator alone leads from its start, after the reconcile below
            touched = coord.take_over(lead.term or 0, lead.gap_s)
    except StoreUnavailable as e:
        log.warning("could not read the lease at start; this coordinator keeps looking", error=e.message)
    lead.start()
    guarded = RequestGuard(app, tokens=lambda: (s.operator_token, s.read_token, s.cluster_token))
    leading = coord.leading

    def hand_over() -> None:
        """Told to stop: the last beats written, then the lease given up at once (a standby takes over
        while this process still drains its connections, not when the lease would have expired)."""
        if leading():
            try:
                driver.store.flush()
            except StoreUnavailable as e:
                log.warning("could not write the last beats", error=e.message)
        lead.stop(release=True)

    server = _Server(uvicorn.Config(guarded, host=host, port=port, log_level="warning", lifespan="off",
                                    http=with_header_deadline(tls.http_protocol(), s.header_timeout_s,
                                                              s.max_connections_per_source),
                                    limit_concurrency=fdlimit.concurrency(CONCURRENCY, "the coordinator"),
                                    timeout_graceful_shutdown=int(STOP_S // 2),
                                    **tls.server_kwargs()), on_exit=hand_over)

    async def main() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        udp = None
        if udp_sock is not None:
            udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(app.datagrams, sock=udp_sock)
        loops = [watchdog_loop(), flush_loop(driver.store, s.flush_s, leading),
                 watch_loop([coord.operations.watch], s.watchdog_s, coord.on_duty),
                 prune_loop(driver.store, s.ops_retention_days * 86400, leading=leading),
                 tick_loop("snapshot schedule", coord.snapshots.tick, DUTY_TICK_S, coord.on_duty),
                 tick_loop("failure detection", coord.recoveries.tick, DUTY_TICK_S, coord.on_duty)]
        tasks = [asyncio.create_task(c) for c in loops]
        role = lead.view()
        log.info("coordinator up", listen=s.listen, url=s.url(), db=describe(s.db), role=role["role"],
                 term=role["term"], leader=role["leader"], reconciled=touched)
        notify(f"READY=1\nSTATUS=coordinator serving {s.listen} ({role['role']})")
        await serving
        notify("STOPPING=1")
        for t in tasks:
            t.cancel()
        if udp is not None:
            udp.close()
        server.handed_over.wait(STOP_S / 4)
        hand_over()  # where uvicorn stopped without a signal (nothing left to do if it was one)

    uvloop.run(main())  # libuv's loop: 0.45 instead of 0.49 cores at 3,000 HTTP beats/s (bench/heartbeat_load.py)
    leave_within(STOP_S, "coordinator")
