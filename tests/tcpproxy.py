"""A TCP relay a test can cut, to put a network partition between one process and a server it
uses (one coordinator and the PostgreSQL server, while the others reach it directly).

Cut, it behaves as a partition does for the process on the near side: connections stay open,
whatever it sends is taken and never arrives, nothing comes back, and a new connection is accepted
and then hears nothing (a connect through it times out in the handshake, as libpq's does when its
packets are dropped).  Healed, every connection made before is closed (a partition that outlasted
TCP's retries leaves none alive) and new ones are relayed again.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_now = threading.Event()
        self._stop = threading.Event()
        self._healing: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    def url(self, postgres_url: str) -> str:
        """`postgres_url` with its host and port replaced by this relay's."""
        scheme, rest = postgres_url.split("://", 1)
        user, _, hostpath = rest.rpartition("@")
        _, _, path = hostpath.partition("/")
        return f"{scheme}://{user + '@' if user else ''}127.0.0.1:{self.port}/{path}"

    def cut(self) -> None:
        self.cut_now.set()

    def heal(self) -> None:
        """Close every connection made so far (in the relay's own thread), then relay again."""
        done = threading.Event()
        self._healing = done
        if not done.wait(10):
            raise TimeoutError("the relay did not heal")
        self.cut_now.clear()

    def close(self) -> None:
        self.heal()
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.listener.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        self.listener.setblocking(False)
        sel.register(self.listener, selectors.EVENT_READ)
        peer: dict[socket.socket, socket.socket | None] = {}
        while not self._stop.is_set():
            try:
                events = sel.select(timeout=0.1)
            except (OSError, ValueError):
                break
            for key, _ in events:
                s: socket.socket = key.fileobj  # type: ignore[assignment]
                if s is self.listener:
                    self._accept(sel, peer)
                    continue
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                other = peer.get(s)
                if not data:
                    for x in (s, other):
                        if x is not None:
                            with contextlib.suppress(KeyError, ValueError, OSError):
                                sel.unregister(x)
                            with contextlib.suppress(OSError):
                                x.close()
                            peer.pop(x, None)
                    continue
                if self.cut_now.is_set() or other is None:
                    continue  # dropped: it never arrives
                with contextlib.suppress(OSError):
                    other.sendall(data)
            healing, self._healing = self._healing, None
            if healing is not None:
                for x in list(peer):
                    with contextlib.suppress(KeyError, ValueError, OSError):
                        sel.unregister(x)
                    with contextlib.suppress(OSError):
                        x.close()
                peer.clear()
                healing.set()
        for x in list(peer):
            with contextlib.suppress(OSError):
                x.close()
        sel.close()

    def _accept(self, sel: selectors.BaseSelector, peer: dict) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server: socket.socket | None = None
        if not self.cut_now.is_set():
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                return
        peer[client] = server
        sel.register(client, selectors.EVENT_READ)
        if server is not None:
            peer[server] = client
            sel.register(server, selectors.EVENT_READ)
