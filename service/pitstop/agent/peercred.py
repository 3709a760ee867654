"""Who may talk to the agent's local socket: checked per connection with SO_PEERCRED.

The local socket registers workers and prepares their networks, so it is as sensitive as
the agent itself.  The socket file is 0660, and on top of that every connection's peer
credentials (from the kernel, not from anything the client says) must be root, the
agent's own user, or a member of the `pitstop` group (PITSTOP_AGENT_LOCAL_GROUP).  Others
get a 403 that says so and the connection is closed before any request is read.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import socket
import struct
from collections.abc import MutableMapping
from typing import Any

import structlog

log = structlog.get_logger("pitstop.agent.peercred")


PEER = "pitstop.peer"
"""Where each request's scope carries its connection's (pid, uid, gid), from the kernel."""


def caller_uid(scope: MutableMapping[str, Any]) -> int:
    """The uid of the process on the other end of the local socket (the agent's own uid where the
    request came in some other way, as in-process tests do)."""
    peer = scope.get(PEER)
    return peer[1] if peer else os.getuid()


def caller_pid(scope: MutableMapping[str, Any]) -> int | None:
    """The pid of the process on the other end of the local socket (None where the request came
    in some other way)."""
    peer = scope.get(PEER)
    return peer[0] if peer else None


def privileged(uid: int) -> bool:
    """Root and the agent's own user act for anyone; the group's members only for themselves."""
    return uid in (0, os.getuid())


def process_uids(pid: int) -> set[int]:
    """The real, effective, saved and filesystem uids of `pid` (empty if it is gone): a caller owns
    a process only if it is every one of them (a set-uid program run by the caller is not its)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return {int(x) for x in line.split()[1:]}
    except OSError:
        return set()
    return set()


def peer_of(sock: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    return pid, uid, gid


def allowed(uid: int, gid: int, group: str | None) -> bool:
    if uid in (0, os.getuid()):
        return True
    if not group:
        return False
    try:
        g = grp.getgrnam(group)
    except KeyError:
        return False
    if gid == g.gr_gid:
        return True
    try:
        return pwd.getpwuid(uid).pw_name in g.gr_mem
    except KeyError:
        return False


def checked(base: type[asyncio.Protocol], group: str | None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, refusing peers that `allowed` rejects."""

    class PeerChecked(base):  # type: ignore[misc, valid-type]
        _refusal: bytes | None = None
        _peer: tuple[int, int, int] | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            try:
                pid, uid, gid = peer_of(transport.get_extra_info("socket"))
            except OSError:
                return  # not a Unix socket
            self._peer = (pid, uid, gid)
            if allowed(uid, gid, group):
                return
            body = json.dumps({"error": {
                "code": "forbidden_peer",
                "message": f"uid {uid} (pid {pid}) may not use this agent's local socket",
                "action": f"run as root or as a member of the {group!r} group" if group else "run as root",
                "details": {}}}).encode()
            log.warning("local socket: peer refused", pid=pid, uid=uid, gid=gid)
            self._refusal = (b"HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\n"
                             + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[PEER] = self._peer  # each request's routes see who asked (caller_uid)

        def data_received(self, data: bytes) -> None:
            if self._refusal is None:
                return super().data_received(data)
            # The request is read and dropped, never parsed; answering after reading it lets the
            # close be a clean FIN rather than a reset that could swallow the answer.
            self.transport.write(self._refusal)
            self._refusal = b""
            self.transport.close()

    return PeerChecked


def own(scope: MutableMapping[str, Any], what: str, owner: int | None) -> int:
    """The caller's uid, refused (403 not_your_worker) unless it is `owner`'s: root and the agent's
    user act for all."""
    from pitstop.errors import Forbidden

    uid = caller_uid(scope)
    if not privileged(uid) and owner is not None and owner != uid:
        raise Forbidden(f"uid {uid} may not act on {what}: it belongs to uid {owner}", code="not_your_worker",
                        action="act only on your own workers, or ask root")
    return uid


def local(scope: MutableMapping[str, Any]) -> bool:
    """Whether the request came in on the local socket (its peer's credentials are known)."""
    return scope.get(PEER) is not None

