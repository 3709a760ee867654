"""Run an agent: TCP listener for peers, Unix socket for local workers."""

from __future__ import annotations

import asyncio
import grp
import os
import socket
from pathlib import Path

import structlog
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pitstop import fdlimit, priority, safepath, tls
from pitstop.agent import imagefs, reclaim, statelock
from pitstop.agent.agent import Agent
from pitstop.agent.api import local_app, peer_app
from pitstop.agent.peercred import checked
from pitstop.agent.receiving import become_subreaper
from pitstop.agent.settings import AgentSettings
from pitstop.agent.timeouts import PAUSE_LOOK_S
from pitstop.criu import runtime
from pitstop.endpoints import listening_socket
from pitstop.errors import FailedPrecondition
from pitstop.httpapi import RequestGuard, with_header_deadline
from pitstop.memory import lazy_pages
from pitstop.sdnotify import notify, watchdog_loop
from pitstop.stopping import STOP_S, leave_within
from pitstop.transfer.dataport import DataPort

log = structlog.get_logger("pitstop.agent")

PEER_CONCURRENCY = 256
"""Connections and requests at once from peers and the coordinator; past it uvicorn answers 503.
The agent runs beside the training job: its memory must stay bounded whoever connects."""
LOCAL_CONCURRENCY = 128  # launchers and their output readers on this host




async def overdue_pause_loop(agent: Agent) -> None:
    """Resume, off the event loop, workers whose pause outlived its deadline, until cancelled."""
    while True:
        await asyncio.sleep(PAUSE_LOOK_S)
        try:
            await asyncio.to_thread(agent.resume_overdue)
        except Exception as e:  # noqa: BLE001 - the next look tries again
            log.warning("could not look at paused workers' deadlines; will look again", error=repr(e)[:200])


def _image_upload(method: str, path: str) -> int | None:
    """An image stream sent as an HTTP body (agents without a data port) is as large as a worker's
    memory: its limit is the reception's own (free space, deadline: agent/receiving.py)."""
    return 1 << 62 if method == "PUT" and path.startswith("/v1/images/") else None


def share_socket(sock: Path, group: str | None) -> None:
    """The local socket 0660 in the configured group, its directory 0750 in that group (its files
    stay 0600 under the agent's umask): the group's members reach the socket and nothing else.
    Without it the socket was root's group in a 0700 directory, and the documented group access
    could not work.  peercred.py still checks every connection and every route its caller."""
    os.chmod(sock, 0o660)
    if not group:
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.info("local socket for root only: the group does not exist", group=group,
                 action=f"groupadd {group} (or set PITSTOP_AGENT_LOCAL_GROUP) to let its members run jobs")
        return
    os.chown(sock, -1, gid)
    d = sock.parent
    if d.stat().st_uid == os.geteuid():
        os.chown(d, -1, gid)
        os.chmod(d, 0o750)


def check_security(s: AgentSettings) -> None:
    if not s.cluster_token and not s.insecure:
        raise FailedPrecondition(
            "refusing to start without a cluster token: an image holds every byte of a worker's memory",
            code="no_cluster_token",
            action="set PITSTOP_CLUSTER_TOKEN (the same value on every agent and the coordinator), "
                   "or pass --insecure for local development")


WILDCARDS = ("0.0.0.0", "::", "")  # brackets already stripped


def check_advertised(s: AgentSettings) -> None:
    """Peers and the coordinator dial the URL this agent registers: a wildcard there (listening on
    0.0.0.0 with nothing else said) would make each of them dial itself."""
    from urllib.parse import urlsplit

    host = (urlsplit(s.url).hostname or "").strip("[]")
    if host in WILDCARDS:
        raise FailedPrecondition(
            f"this agent would register as {s.url}, a wildcard address no peer can dial",
            code="wildcard_advertise_url",
            action="give --advertise-url http://THIS-HOST:PORT (or PITSTOP_AGENT_ADVERTISE_URL) with the name or "
                   "address the coordinator and the other agents reach this host by")


def check_lazy_restore(s: AgentSettings) -> None:
    """Post-copy asked for on a kernel that cannot do it: say so at start, not at the first move."""
    if not s.lazy_restore:
        return
    ok, out = lazy_pages.supported()
    if not ok:
        raise FailedPrecondition(
            "PITSTOP_AGENT_LAZY_RESTORE=1 but this kernel cannot serve lazy restores: CRIU says "
            + (out.splitlines()[-1] if out else "nothing"),
            code="lazy_restore_unsupported",
            action="unset PITSTOP_AGENT_LAZY_RESTORE (restores stay eager), or enable userfaultfd "
                   "(CONFIG_USERFAULTFD, vm.unprivileged_userfaultfd does not matter for root)")


MOVED_SETTINGS = {  # an agent's setting that is now another service's: (where it went, why)
    "PITSTOP_AGENT_REMOTE_POST_COPY": ("PITSTOP_COORDINATOR_POST_COPY on the coordinator",
                                       "whether a move uses post-copy is decided for the whole move, "
                                       "by the coordinator; the agent only says whether it can serve it"),
}


def warn_moved_settings(env: dict[str, str]) -> list[str]:
    """A setting the agent no longer reads is named at start with where it went, not ignored
    without a word (an upgraded host would quietly move without post-copy); the names warned of."""
    named = [k for k in MOVED_SETTINGS if k in env]
    for k in named:
        where, why = MOVED_SETTINGS[k]
        log.warning(f"{k} is no longer an agent setting and is ignored here: set {where} instead", why=why)
    return named


def hold_state_dir(s: AgentSettings) -> None:
    """Before anything in the state directory is read or written (the local socket, the state
    file, diagnostics): the directory is this agent's alone for its life (agent/statelock.py)."""
    try:
        safepath.private_dir(s.state_dir, mode=0o755, what="the agent's state directory")
        statelock.hold(s.state_dir, name=s.name, url=s.url)
    except OSError as e:  # as Agent() says it of the image directory, below
        raise FailedPrecondition(f"cannot prepare the agent's directories: {e.strerror}: {e.filename or s.state_dir}",
                                 code="agent_directories",
                                 action="give --state-dir and --image-dir on writable local file systems") from None


def _preload() -> None:
    """Import now what the first capture and restore need (pycriu and its protobuf modules,
    about 0.1 s of CPU): otherwise the first move after every start pays it while the job waits."""
    try:
        runtime.locate().import_pycriu()
        import pycriu.images  # noqa: F401  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - a host without CRIU is reported by doctor and at capture
        log.warning("CRIU not loaded at start", error=str(e))


def _bind_and_load(s: AgentSettings, host: str, port: int, data_host: str,
                   data_port: int) -> tuple[socket.socket, socket.socket, Agent]:
    """The API's and the image streams' sockets (first: a port in use changes nothing), then the
    state directory held and the agent loaded from it.  What fails closes the sockets."""
    socks = [listening_socket(host, port, "the agent's API (--listen)")]
    try:
        socks.append(listening_socket(data_host, data_port, "image streams (PITSTOP_AGENT_DATA_LISTEN)"))
        hold_state_dir(s)  # after the ports (a port in use changes nothing), before anything reads the directory
        try:
            agent = Agent(s)
            s.sock.parent.mkdir(parents=True, exist_ok=True)
            if s.sock.exists():
                s.sock.unlink()
        except OSError as e:
            raise FailedPrecondition(f"cannot prepare the agent's directories: {e.strerror}: {e.filename}",
                                     code="agent_directories",
                                     action="give --state-dir and --image-dir on writable local file systems") from None
    except BaseException:
        for x in socks:
            x.close()
        raise
    return socks[0], socks[1], agent


def _servers(s: AgentSettings, agent: Agent, host: str, port: int) -> tuple[uvicorn.Server, uvicorn.Server]:
    """The peers' API over TCP (the cluster's token) and the local one on the Unix socket (the
    caller's credentials, checked by `checked`)."""
    peers = RequestGuard(peer_app(agent), tokens=lambda: (s.cluster_token,), large=_image_upload)
    tcp = uvicorn.Server(uvicorn.Config(peers, host=host, port=port, log_level="warning",
                                        http=with_header_deadline(tls.http_protocol(), s.header_timeout_s,
                                                                  s.max_connections_per_source), lifespan="off",
                                        timeout_keep_alive=30,
                                        limit_concurrency=fdlimit.concurrency(PEER_CONCURRENCY, "the agent"),
                                        timeout_graceful_shutdown=int(STOP_S // 2), **tls.server_kwargs()))
    uds = uvicorn.Server(uvicorn.Config(RequestGuard(local_app(agent), tokens=lambda: ()), uds=str(s.sock),
                                        log_level="warning", limit_concurrency=LOCAL_CONCURRENCY,
                                        http=with_header_deadline(checked(HttpToolsProtocol, s.local_group), s.header_timeout_s),
                                        lifespan="off",
                                        timeout_graceful_shutdown=int(STOP_S // 2)))
    return tcp, uds


def serve(s: AgentSettings) -> None:
    priority.apply(s.nice, "agent", realtime=s.realtime)  # first: every thread started later inherits it
    os.umask(0o077)  # as the systemd unit's UMask=: what it writes (state, images, outputs) is its own
    check_security(s)
    check_advertised(s)
    check_lazy_restore(s)
    warn_moved_settings(dict(os.environ))
    _preload()
    become_subreaper()
    host, port = s.host_port()
    data_host, data_port = s.data_host_port()
    tcp_sock, data_sock, agent = _bind_and_load(s, host, port, data_host, data_port)
    tcp, uds = _servers(s, agent, host, port)
    port_ = DataPort(data_host, data_port, sock=data_sock, token=s.cluster_token, open_slot=agent.dest.open_slot,
                     fail_slot=agent.dest.fail_slot, finished=agent.finish_slot, on_error=agent.storage_error,
                     idle_timeout_s=min(s.transfer_timeout_s, 60.0), pages_for=agent.pages.pages_for).start()
    agent.data_port = agent.pages.data_port = s.data_advertise_port or port_.port
    extra = []
    if s.coordinator:
        from pitstop.agent.heartbeat import heartbeat_loop

        extra.append(heartbeat_loop(agent))

    async def main() -> None:
        tasks = [asyncio.create_task(tcp.serve(sockets=[tcp_sock])), asyncio.create_task(uds.serve())]
        tasks += [asyncio.create_task(x) for x in extra]
        while not (tcp.started and uds.started):
            if any(t.done() for t in tasks[:2]):
                break
            await asyncio.sleep(0.02)
        share_socket(s.sock, s.local_group)
        tasks.append(asyncio.create_task(watchdog_loop()))
        tasks.append(asyncio.create_task(overdue_pause_loop(agent)))
        notify(f"READY=1\nSTATUS=agent {s.name} serving {s.url}")
        log.info("agent up", name=s.name, url=s.url, socket=str(s.sock), spare=s.spare,
                 coordinator=s.coordinator, insecure=not s.cluster_token)
        done, pending = await asyncio.wait(tasks[:2], return_when=asyncio.FIRST_COMPLETED)
        notify("STOPPING=1")
        if agent.precopies.stop_all():
            log.info("pre-copies under way stopped: the agent is stopping")
        tcp.should_exit = uds.should_exit = True
        port_.close()
        for t in tasks:
            if t not in done:
                t.cancel()

    try:
        uvloop.run(main())  # libuv's loop: 0.45 instead of 0.49 cores at 3,000 HTTP beats/s (bench/heartbeat_load.py)
    finally:  # also when a listener failed: the image mount must not outlive the agent
        if not reclaim.drain(STOP_S):
            log.warning("image deletions still running at shutdown; the next start finishes them")
        imagefs.release(agent.image_fs)
    leave_within(STOP_S, "agent")  # after a stop, not after a failure: that one's exit status must show
