"""How this agent's images travel to another agent: a capture's as they are written, a pre-copy's
while it is read, a snapshot's part once complete.

Why one sender for all three: each chooses the same way between the data port (a socket of its
own, transfer/dataport.py) and HTTP, applies the same compression learned per destination, and
turns the same failures into one error an operator can act on.  Written three times, the
snapshot's replication once lacked the compression a capture had."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import structlog

from pitstop import faults
from pitstop.agent.settings import AgentSettings
from pitstop.agent.timeouts import PRECOPY_DISCARD_TIMEOUT_S, STREAM_STOP_WAIT_S
from pitstop.errors import DeadlineExceeded, PitstopError, TransferFailed, Unavailable
from pitstop.transfer import compress, dataport
from pitstop.transfer.compress import Compression
from pitstop.transfer.stream import DirectoryTail
from pitstop.wire.agent_client import AgentClient

log = structlog.get_logger("pitstop.agent.sending")


class ImageSender:
    def __init__(self, settings: AgentSettings) -> None:
        self.s = settings

    def send(self, dest_url: str, image_id: str, tail: DirectoryTail, errors: list[BaseException],
             done: list[float]) -> None:
        """Stream `tail` to `dest_url` as image `image_id`; what went wrong is appended to
        `errors` (this runs on a thread of its own), and `done[0]` set to when it ended."""
        url = f"{dest_url.rstrip('/')}/v1/images/{image_id}"
        try:
            with AgentClient(dest_url, self.s.cluster_token, timeout=self.s.transfer_timeout_s) as dest:
                port = dest.data_port() if self.s.data_stream else None
                pieces = _cut(iter(tail), faults.value("transfer:cut_after"))
                if port:  # the fast path: a socket of its own (transfer/dataport.py)
                    dataport.send(pieces, httpx.URL(url).host, port, image_id, self.s.cluster_token,
                                  timeout_s=self.s.transfer_timeout_s, compression=tail.compression)
                    return
                try:
                    dest.put_images(image_id, pieces, timeout=httpx.Timeout(self.s.transfer_timeout_s, connect=10))
                except (Unavailable, DeadlineExceeded):
                    raise
                except PitstopError as e:
                    errors.append(TransferFailed(f"destination refused the images: {e.message}",
                                                 action=e.action or "check the destination agent",
                                                 details={"status": e.http_status}))
        except (Unavailable, DeadlineExceeded) as e:
            errors.append(TransferFailed(f"transfer to {url} failed: {e.message}",
                                         action="the source was resumed; check the destination agent"))
        except PitstopError as e:
            errors.append(e)
        except OSError as e:  # the data port: refused, reset, timed out
            errors.append(TransferFailed(f"transfer to {dest_url} failed: {e!r}",
                                         action="the source was resumed; check the destination agent"))
        finally:
            done[0] = time.monotonic()

    def discard_at(self, dest_url: str, image_id: str) -> None:
        """Ask `dest_url` to drop an image nobody will use; a failure is only logged (the
        destination drops unclaimed images on its own, later)."""
        try:
            with AgentClient(dest_url, self.s.cluster_token, timeout=PRECOPY_DISCARD_TIMEOUT_S) as dest:
                dest.discard(image_id, timeout=PRECOPY_DISCARD_TIMEOUT_S)
        except PitstopError as e:
            log.warning("could not discard an image nobody will use", dest=dest_url, image=image_id, error=e.message)

    def compression(self, dest_url: str) -> Compression:
        """A stream's compression, with what this agent learned of sending to `dest_url` before;
        `auto` never compresses towards this machine's own loopback (compress.same_host)."""
        mode, why = self.s.compress, None
        if mode == "auto" and compress.same_host(httpx.URL(dest_url).host):
            mode, why = "off", "auto: the destination is on this machine's loopback"
        return Compression(mode, level=self.s.compress_level, threads=self.s.compress_threads,
                           link=compress.link_for(dest_url), reason=why)


class StreamingSend:
    """The thread that streams one capture's images to its destination while they are written,
    and its way back."""

    def __init__(self, sender: ImageSender, dest_url: str, image_id: str, tail: DirectoryTail, t0: float,
                 name: str) -> None:
        self.tail = tail
        self.errors: list[BaseException] = []
        self._done = [t0]
        self.thread = threading.Thread(target=sender.send, args=(dest_url, image_id, tail, self.errors, self._done),
                                       name=name, daemon=True)
        self.started = False
        self.dest = dest_url
        self._abandoned = False  # it outlived the transfer's deadline: not waited for again

    @property
    def done(self) -> float:
        return self._done[0]

    def start(self) -> None:
        self.started = True
        self.thread.start()

    def finish(self, timeout_s: float) -> None:
        """Wait for the stream to end; raise what went wrong (its error, or the deadline)."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self._abandoned = True
            raise TransferFailed(f"transfer to {self.dest} did not finish within {timeout_s:.0f} s",
                                 action="check the destination agent and the network between the hosts")
        if self.errors:
            e = self.errors[0]
            raise e if isinstance(e, PitstopError) else TransferFailed(f"transfer to {self.dest} failed: {e!r}")

    def stop(self, error: BaseException) -> None:
        """Undo: the stream ends with an error frame (the destination discards what it got)."""
        self.tail.failure = error if isinstance(error, Exception) else Exception(str(error))
        if self.started and not self._abandoned and self.thread.is_alive():
            self.thread.join(STREAM_STOP_WAIT_S)


def dedup_pages(setting: str, processes: int, over_tls: bool) -> bool:
    """Send copy-on-write pages once (transfer/dedup.py)?  Only a tree has them, and finding them
    pays where a byte on the wire costs more than the search: over TLS, or on slower links
    (`on`); on this testbed's plain loopback it costs more than it saves (docs/benchmarks.md)."""
    return processes > 1 and (setting == "on" or (setting == "auto" and over_tls))


def _cut(chunks: Iterator[bytes | memoryview], after: str | None) -> Iterator[bytes | memoryview]:
    """A fault hook: the stream breaks mid-way, after `after` bytes."""
    sent = 0
    for c in chunks:
        sent += len(c)
        if after and sent > int(after):
            raise TransferFailed(f"injected fault: stream cut after {after} bytes", action="this is a test")
        yield c
