"""systemd's notify protocol (Type=notify): readiness, status and the watchdog.

A datagram to $NOTIFY_SOCKET per message; nothing at all when not run by systemd.
The watchdog is fed only from the event loop, so a wedged loop stops feeding it and
systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import os
import socket


def notify(message: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(message.encode(), addr)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC, when the watchdog is for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def watchdog_loop() -> None:
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
