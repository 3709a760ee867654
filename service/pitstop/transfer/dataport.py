"""The agents' data port: image streams on a plain socket instead of an HTTP request.

Why: on the HTTP path uvicorn copies every received byte twice before the application
sees it (into a bytearray per read, then into a bytes object per receive()) and pauses
reading every 64 KiB; with recv_into() a 4 MiB buffer and pwrite() from it, the receiver
copies each byte once from the kernel and once into the image file.  The sender hands
mapped image pages straight to sendall().  Same framing as the HTTP body (stream.py), same
slot, manifest check and errors; the HTTP PUT stays for agents without a data port.

The exchange, one connection per image (TLS-wrapped when PITSTOP_TLS_* is set, with the
same CA and the same role check as the HTTP API):
  client: {"image_id": ..., "token": ...}\\n       server: {"ok": true, "encodings": ["zstd"]}\\n  or an error line
  client: the frames, up to and including the manifest (Z frames only if the server named "zstd")
  server: {"ok": true, "bytes": N, "files": F, "seconds": S}\\n  or {"error": {...}, "status": 507}\\n
Every wait has a deadline (connect, hello, each receive, the final answer).

Post-copy over the network uses the same port the other way round: the destination asks
  client: {"image_id": ..., "token": ..., "want": "pages"}\\n   server: {"ok": true}\\n
and from then on the socket belongs to CRIU's page-server protocol (transfer/page_server.py),
spoken by the destination's `criu lazy-pages` daemon, to which the destination hands it.
"""

from __future__ import annotations

import hmac
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from .. import tls
from ..errors import PitstopError, TransferFailed
from .compress import ENCODING, Compression
from .stream import StreamReceiver

log = structlog.get_logger("pitstop.transfer.dataport")

BUFFER = 4 << 20
MAX_IDLE_BUFFERS = 4
MAX_LINE = 64 << 10


def _read_line(sock: socket.socket, limit: int = MAX_LINE) -> bytes:
    out = bytearray()
    while not out.endswith(b"\n"):
        b = sock.recv(1)  # only for the short control lines; the stream itself is read in bulk
        if not b:
            raise ConnectionError("connection closed")
        out += b
        if len(out) > limit:
            raise ValueError("control line too long")
    return bytes(out)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class DataPort:
    """The receiving side: a listening socket and a thread per incoming stream."""

    def __init__(self, host: str, port: int, *, token: str | None, open_slot: Callable[[str], Any],
                 fail_slot: Callable[[Any], None], finished: Callable[[Any], dict],
                 on_error: Callable[[Any, OSError], PitstopError], idle_timeout_s: float = 60.0,
                 pages_for: Callable[[str], Callable[[socket.socket], None]] | None = None,
                 sock: socket.socket | None = None) -> None:
        self._token = token.encode() if token else None
        self._pages_for = pages_for  # image id -> who serves its lazy pages (raises if nobody)
        self._open_slot, self._fail_slot, self._finished, self._on_error = open_slot, fail_slot, finished, on_error
        self.idle_timeout_s = idle_timeout_s
        # `sock`: already listening (agent/server.py binds before anything else, to fail early)
        self.sock = sock or socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                 backlog=64, reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._ssl = self._server_context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="dataport-accept", daemon=True)
        # Receive buffers are reused: a fresh 4 MiB buffer per stream, freed on another thread
        # each time, made glibc's per-thread arenas grow by 10-15 MiB over a 50-move soak.
        self._buffers: list[bytearray] = []
        self._buffers_lock = threading.Lock()

    @staticmethod
    def _server_context() -> ssl.SSLContext | None:
        kw = tls.server_kwargs()
        if not kw:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(kw["ssl_certfile"], kw["ssl_keyfile"])
        ctx.load_verify_locations(kw["ssl_ca_certs"])
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def start(self) -> "DataPort":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn, addr), name="dataport-recv", daemon=True).start()

    def _take_buffer(self) -> bytearray:
        with self._buffers_lock:
            return self._buffers.pop() if self._buffers else bytearray(BUFFER)

    def _give_back(self, buf: bytearray) -> None:
        with self._buffers_lock:
            if len(self._buffers) < MAX_IDLE_BUFFERS:
                self._buffers.append(buf)

    def _receive(self, conn: socket.socket, slot: Any, mv: memoryview) -> None:
        rx: StreamReceiver = slot.receiver
        while not rx.complete:
            n = conn.recv_into(mv)
            if n == 0:
                raise TransferFailed(f"image stream {slot.image_id} ended before its manifest "
                                     f"({rx.received} bytes received)", http_status=400,
                                     action="the copy is discarded; the source keeps its images")
            try:
                rx.feed(mv[:n])
            except OSError as e:
                raise self._on_error(slot, e) from None

    def _serve_pages(self, conn: socket.socket, image_id: str) -> None:
        if self._ssl is not None or self._pages_for is None:
            raise PitstopError("this agent does not serve lazy pages on its data port", code="failed_precondition",
                               http_status=412, action="post-copy over the network needs a plain data port "
                                                       "(no PITSTOP_TLS_*) on the source")
        serve = self._pages_for(image_id)  # NotFound: answered as an error line, like any refusal
        conn.sendall(_line({"ok": True}))
        try:  # from here on the socket speaks CRIU's protocol: no line of ours may follow
            serve(conn)
        except Exception as e:  # noqa: BLE001 - the daemon sees the connection end and fails
            log.warning("serving lazy pages failed", image=image_id, error=repr(e))

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        slot = None
        try:
            conn.settimeout(self.idle_timeout_s)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
                tls.require_role({tls.PEER_ROLE: tls.role_of(conn.getpeercert())}, ("agent",))
            hello = json.loads(_read_line(conn))
            got = str(hello.get("token") or "").encode()
            if self._token is not None and not hmac.compare_digest(got, self._token):
                raise PitstopError("missing or wrong cluster token on the data port", code="unauthenticated",
                                   http_status=401, action="send the value of PITSTOP_CLUSTER_TOKEN")
            if hello.get("want") == "pages":
                self._serve_pages(conn, str(hello.get("image_id", "")))
                return
            slot = self._open_slot(str(hello.get("image_id", "")))
            conn.sendall(_line({"ok": True, "encodings": [ENCODING]}))
            buf = self._take_buffer()
            mv = memoryview(buf)
            try:
                self._receive(conn, slot, mv)
            finally:
                try:
                    mv.release()  # no view of a pooled buffer may outlive its stream
                    self._give_back(buf)
                except BufferError:
                    pass  # something still holds a view: the buffer is not reused
            conn.sendall(_line({"ok": True, **self._finished(slot)}))
        except BaseException as e:  # noqa: BLE001 - every failure is answered, the slot discarded
            if slot is not None:
                self._fail_slot(slot)
            err = e if isinstance(e, PitstopError) else TransferFailed(
                f"image stream failed on the destination: {e!r}", action="the copy is discarded; send again")
            log.warning("image stream refused or failed", peer=str(addr), error=err.message)
            try:
                conn.sendall(_line({"error": err.to_dict(), "status": err.http_status}))
            except OSError:
                pass
        finally:
            try:
                conn.close()
            except OSError:
                pass


def send(pieces: Iterable[bytes | memoryview], host: str, port: int, image_id: str, token: str | None,
         timeout_s: float, connect_timeout_s: float = 10.0, compression: Compression | None = None) -> dict[str, Any]:
    """Stream `pieces` to a data port; the destination's final answer, or TransferFailed.

    `compression`: the stream's (DirectoryTail's); told whether the destination decodes compressed
    pieces, and when each byte is in the socket, which is how it times the link."""
    sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    try:
        if tls.enabled():
            sock = tls.client_context().wrap_socket(sock, server_hostname=host)
        sock.settimeout(timeout_s)
        hello = _hello(sock, {"image_id": image_id, "token": token or ""}, f"{host}:{port}")
        t0 = time.monotonic()
        if compression is not None:
            compression.accept(hello.get("encodings"))
            compression.started()
        wire = 0
        try:
            for piece in pieces:
                t = time.perf_counter()
                sock.sendall(piece)
                if compression is not None:
                    wire += len(piece)
                    compression.sent(wire, time.perf_counter() - t)
        except OSError:
            _answer(sock, f"{host}:{port}")  # the destination stopped reading: it says why
            raise
        reply = _answer(sock, f"{host}:{port}")
        reply.setdefault("seconds", time.monotonic() - t0)
        return reply
    finally:
        sock.close()


def open_pages(host: str, port: int, image_id: str, token: str | None, timeout_s: float = 10.0) -> socket.socket:
    """A socket on which the source serves `image_id`'s lazy pages (for `criu lazy-pages --ps-socket`)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        _hello(sock, {"image_id": image_id, "token": token or "", "want": "pages"}, f"{host}:{port}")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)  # CRIU owns it from here; the daemon has its own waits, ours is the fill deadline
    return sock


def _hello(sock: socket.socket, hello: dict[str, Any], where: str) -> dict[str, Any]:
    """Say who we are and what we want; the destination's first answer, or TransferFailed."""
    sock.sendall(_line(hello))
    return _answer(sock, where)


def _answer(sock: socket.socket, where: str) -> dict[str, Any]:
    try:
        reply = json.loads(_read_line(sock))
    except (OSError, ValueError) as e:
        raise TransferFailed(f"image transfer to {where} broke before the destination answered: {e!r}",
                             action="the source was resumed; check the destination agent and the network "
                                    "between the hosts") from None
    if "error" in reply:
        err = reply["error"]
        raise TransferFailed(f"destination refused the images: {err.get('message', '')}",
                             action=err.get("action", "check the destination agent"),
                             details={"status": reply.get("status"), "code": err.get("code")})
    return reply
