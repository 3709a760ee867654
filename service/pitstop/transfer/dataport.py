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
Every wait has a deadline (connect, hello, each receive, the final answer), and the port's own
resources are bounded against peers that never say who they are: the whole greeting (TLS
handshake and hello line) must be over `greeting_s` after the accept, at most `max_greeting`
connections may be greeting at once and `max_connections` be open in all (one more is answered
"busy" and closed at once), and one source address may hold at most `per_source_greeting` of
the greeting connections and `per_source` of all (so that one host's silent connections never
lock the port for another's real stream), and an error of accept() itself (out of file descriptors, say) is
logged and waited out, never the end of the port.  A reception must be complete by its slot's
deadline (the destination's dump_timeout_s + transfer_timeout_s), however steadily its bytes
trickle in.

Post-copy over the network uses the same port the other way round: the destination asks
  client: {"image_id": ..., "token": ..., "want": "pages"}\\n   server: {"ok": true}\\n
and from then on the socket belongs to CRIU's page-server protocol (memory/page_server.py),
spoken by the destination's `criu lazy-pages` daemon, to which the destination hands it.
"""

from __future__ import annotations

import collections
import errno
import hmac
import json
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog

from pitstop import tls
from pitstop.errors import DeadlineExceeded, PitstopError, TransferFailed, Unavailable
from pitstop.transfer.compress import ENCODING, Compression
from pitstop.transfer.stream import StreamReceiver, overdue

log = structlog.get_logger("pitstop.transfer.dataport")

BUFFER = 4 << 20
MAX_IDLE_BUFFERS = 4
MAX_LINE = 64 << 10
GREETING_S = 10.0      # from accept to a complete, authenticated hello (pitstop's agents: milliseconds)
MAX_GREETING = 64      # connections still greeting; each costs a thread until its greeting ends
MAX_CONNECTIONS = 256  # all connections: receptions (capped by the agent), lazy-page servers, greetings
PER_SOURCE_GREETING = 16  # of MAX_GREETING, from one address: a host sends a stream per rank it moves here (8 GPUs)
PER_SOURCE = 64           # of MAX_CONNECTIONS, from one address: its streams, and the pages its copies serve
ANSWER_S = 5.0         # for the last line to a peer (into an all but empty send buffer)
BACKOFF_S = (0.01, 1.0)  # between failed accept() calls: first, most
LOG_EVERY_S = 10.0     # a recurring refusal or accept error is logged at most this often


def _read_line(sock: socket.socket, limit: int = MAX_LINE, deadline: float | None = None) -> bytes:
    """One control line.  `deadline` (time.monotonic()): for the whole line, not per read, so that
    a peer sending a byte now and then cannot stretch it (TimeoutError once it has passed)."""
    out = bytearray()
    while not out.endswith(b"\n"):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the line was not complete by its deadline")
            sock.settimeout(left)
        b = sock.recv(1)  # only for the short control lines; the stream itself is read in bulk
        if not b:
            raise ConnectionError("connection closed")
        out += b
        if len(out) > limit:
            raise ValueError("control line too long")
    return bytes(out)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class _Every:
    """A recurring event logged at most once per `every_s`, with how often it happened since: a
    flood of refused connections must not become a flood of log lines."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last = -math.inf
        self._count = 0
        self._lock = threading.Lock()

    def hit(self) -> int:
        """Count one; how many to log now (0: not yet)."""
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < self.every_s:
                return 0
            self._last, n, self._count = now, self._count, 0
            return n


@dataclass(eq=False)
class _Conn:
    """An accepted connection: its socket (the TLS one once wrapped) and its greeting's deadline."""

    sock: socket.socket
    addr: Any
    deadline: float
    greeted: bool = False
    answerable: bool = True  # a line can be sent (not: a TLS handshake that did not complete)

    @property
    def source(self) -> str:
        """The peer's address, without its port: what the per-source limits count."""
        return str(self.addr[0]) if isinstance(self.addr, tuple) and self.addr else str(self.addr)

    def shut(self) -> None:
        """Break any wait on it, from another thread (the base class's shutdown: also for TLS)."""
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass


class DataPort:
    """The receiving side: a listening socket and a thread per incoming stream, both bounded."""

    def __init__(self, host: str, port: int, *, token: str | None, open_slot: Callable[[str], Any],
                 fail_slot: Callable[[Any], None], finished: Callable[[Any], dict],
                 on_error: Callable[[Any, OSError], PitstopError], idle_timeout_s: float = 60.0,
                 pages_for: Callable[[str], Callable[[socket.socket], None]] | None = None,
                 sock: socket.socket | None = None, greeting_s: float = GREETING_S,
                 max_greeting: int = MAX_GREETING, max_connections: int = MAX_CONNECTIONS,
                 per_source_greeting: int = PER_SOURCE_GREETING, per_source: int = PER_SOURCE) -> None:
        self._token = token.encode() if token else None
        self._pages_for = pages_for  # image id -> who serves its lazy pages (raises if nobody)
        self._open_slot, self._fail_slot, self._finished, self._on_error = open_slot, fail_slot, finished, on_error
        self.idle_timeout_s = idle_timeout_s
        self.greeting_s, self.max_greeting, self.max_connections = greeting_s, max_greeting, max_connections
        self.per_source_greeting, self.per_source = per_source_greeting, per_source
        # `sock`: already listening (agent/server.py binds before anything else, to fail early)
        self.sock = sock or socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                 backlog=64, reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._ssl = self._server_context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="dataport-accept", daemon=True)
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._greeting = 0  # of _conns, those not greeted yet
        self._from: collections.Counter[str] = collections.Counter()           # source address -> open
        self._greeting_from: collections.Counter[str] = collections.Counter()  # source address -> greeting
        self._refusals, self._accept_errors = _Every(), _Every()
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

    @property
    def connections(self) -> tuple[int, int]:
        """(connections open, of which still greeting)."""
        with self._lock:
            return len(self._conns), self._greeting

    def close(self) -> None:
        """Stop accepting and end every connection (the agent is stopping)."""
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept(), which close() alone does not
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.shut()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _accept(self) -> None:
        """Accept until close().  A failed accept() (EMFILE or ENFILE: out of file descriptors;
        ENOBUFS, ENOMEM; ECONNABORTED, EPROTO: a peer gone first) is logged and waited out: once it
        ended this loop, and with it every later move to this host until the agent restarted."""
        pause = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except OSError as e:
                if self._stop.is_set() or self.sock.fileno() < 0:
                    return  # closed
                n = self._accept_errors.hit()
                if n:
                    log.warning("the data port cannot accept connections; retrying",
                                error=f"{errno.errorcode.get(e.errno or 0, e.errno)}: {e.strerror}", times=n,
                                action="image streams to this agent wait meanwhile; if out of file descriptors, "
                                       "raise LimitNOFILE or look for connections held open to this port")
                self._stop.wait(pause)
                pause = min(2 * pause, BACKOFF_S[1])
                continue
            pause = BACKOFF_S[0]
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        """A thread for the connection, or a prompt refusal where the port is full."""
        c = _Conn(conn, addr, time.monotonic() + self.greeting_s)
        with self._lock:  # close() ends what it finds in _conns: none may join after it
            full = "the agent is stopping" if self._stop.is_set() else self._full(c.source)
            if not full:
                self._conns.add(c)
                self._greeting += 1
                self._from[c.source] += 1
                self._greeting_from[c.source] += 1
        if full:
            self._refuse(c, full)
            return
        try:
            threading.Thread(target=self._serve, args=(c,), name="dataport-conn", daemon=True).start()
        except RuntimeError as e:  # can't start new thread
            self._release(c)
            self._refuse(c, f"no thread for it ({e})")

    def _full(self, source: str) -> str:
        """Why one more connection from `source` is refused now ("": it is not).  Under self._lock."""
        if self._from[source] >= self.per_source:
            return f"{self._from[source]} connections open from {source}, the limit for one address"
        if self._greeting_from[source] >= self.per_source_greeting:
            return (f"{self._greeting_from[source]} connections from {source} have not said who they are yet, the "
                    "limit for one address")
        if len(self._conns) >= self.max_connections:
            return f"{len(self._conns)} connections open, its limit"
        if self._greeting >= self.max_greeting:
            return f"{self._greeting} connections have not said who they are yet, its limit"
        return ""

    def _refuse(self, c: _Conn, why: str) -> None:
        err = Unavailable(f"the data port is busy: {why}", code="data_port_busy",
                          action="the move fails and its source resumes; try again, and if it persists look "
                                 f"for peers holding connections to port {self.port} of this host")
        try:
            c.sock.setblocking(False)  # never wait on a peer that is refused
            c.sock.send(_line({"error": err.to_dict(), "status": err.http_status}))
        except OSError:
            pass
        finally:
            c.sock.close()
        n = self._refusals.hit()
        if n:
            log.warning("data port refused connections", reason=why, refused=n, peer=str(c.addr))

    def _release(self, c: _Conn) -> None:
        with self._lock:
            if c in self._conns:
                self._conns.discard(c)
                self._from[c.source] -= 1
                if not self._from[c.source]:
                    del self._from[c.source]
                if not c.greeted:
                    self._ungreet(c)

    def _ungreet(self, c: _Conn) -> None:
        """`c` no longer counts as greeting.  Under self._lock."""
        self._greeting -= 1
        self._greeting_from[c.source] -= 1
        if not self._greeting_from[c.source]:
            del self._greeting_from[c.source]

    def _take_buffer(self) -> bytearray:
        with self._buffers_lock:
            return self._buffers.pop() if self._buffers else bytearray(BUFFER)

    def _give_back(self, buf: bytearray) -> None:
        with self._buffers_lock:
            if len(self._buffers) < MAX_IDLE_BUFFERS:
                self._buffers.append(buf)

    def _receive(self, conn: socket.socket, slot: Any, mv: memoryview) -> None:
        rx: StreamReceiver = slot.receiver
        deadline = getattr(slot, "deadline", math.inf)  # DestinationSide's slots carry one
        while not rx.complete:
            left = deadline - time.monotonic()
            if left < self.idle_timeout_s:  # the last stretch: no wait may outlast the deadline
                if left <= 0:
                    raise overdue(slot.image_id, deadline - slot.started, rx.received)
                conn.settimeout(left)
            try:
                n = conn.recv_into(mv)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise overdue(slot.image_id, deadline - slot.started, rx.received) from None
                raise
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

    def _hello(self, c: _Conn) -> dict[str, Any]:
        """The peer's hello, authenticated, by the greeting's deadline: each wait of the TLS
        handshake and of the line is bounded by what is left of it, so a peer trickling bytes
        holds the connection `greeting_s` at most, whatever the per-read timeout."""
        try:
            if self._ssl is not None:
                c.sock = self._ssl.wrap_socket(c.sock, server_side=True, do_handshake_on_connect=False)
                c.answerable = False  # a line sent now would wait for the handshake
                c.sock.settimeout(max(c.deadline - time.monotonic(), 1e-3))
                c.sock.do_handshake()  # one call, one deadline (ssl's own, over all of its reads)
                c.answerable = True
                tls.require_role({tls.PEER_ROLE: tls.role_of(c.sock.getpeercert())}, ("agent",))
            hello = json.loads(_read_line(c.sock, deadline=c.deadline))
        except TimeoutError:
            raise DeadlineExceeded(f"no complete hello within {self.greeting_s:g} s of connecting",
                                   action="a peer must send its hello line at once (pitstop's agents do)") from None
        got = str(hello.get("token") or "").encode()
        if self._token is not None and not hmac.compare_digest(got, self._token):
            raise PitstopError("missing or wrong cluster token on the data port", code="unauthenticated",
                               http_status=401, action="send the value of PITSTOP_CLUSTER_TOKEN")
        with self._lock:
            c.greeted = True
            self._ungreet(c)
        c.sock.settimeout(self.idle_timeout_s)
        return hello

    def _serve(self, c: _Conn) -> None:
        slot = None
        try:
            hello = self._hello(c)
            conn = c.sock
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
            conn.settimeout(ANSWER_S)
            conn.sendall(_line({"ok": True, **self._finished(slot)}))
        except BaseException as e:  # noqa: BLE001 - every failure is answered, the slot discarded
            if slot is not None:
                self._fail_slot(slot)
            err = e if isinstance(e, PitstopError) else TransferFailed(
                f"image stream failed on the destination: {e!r}", action="the copy is discarded; send again")
            log.warning("image stream refused or failed", peer=str(c.addr), error=err.message)
            try:
                if c.answerable:
                    c.sock.settimeout(ANSWER_S)
                    c.sock.sendall(_line({"error": err.to_dict(), "status": err.http_status}))
            except OSError:
                pass
        finally:
            self._release(c)
            try:
                c.sock.close()
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
