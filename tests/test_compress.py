"""Compression of the image stream (transfer/compress.py): the Z frame, the receiver's checks, and
the sender's choice between raw and compressed pieces.

The choice is tested twice: against a simulated link and compressor with a fake clock (every case
decided exactly, in milliseconds), and end to end through a real data port in another network
namespace whose link is slowed with a token bucket (tests/test_compress.py::test_real_*)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from pitstop.dev.netns import NetHosts
from pitstop.errors import TransferFailed
from pitstop.transfer import compress, dataport
from pitstop.transfer.compress import Compression, Link
from pitstop.transfer.manifest import Manifest
from pitstop.transfer.stream import _D, _L, _Z, DirectoryTail, StreamReceiver, verify_directory

from .helpers import end_stdin_child

MiB = 1 << 20


def compressible(n: int) -> bytes:
    """Like a rank's memory: runs of small integers, some zeros (zstd level 1: about 0.3-0.7)."""
    a = np.arange(n // 4, dtype=np.int32)
    a[::7] = 0
    return a.tobytes()


def frames(stream: bytes) -> list[str]:
    """The frame types of a whole stream, in order."""
    out, i = [], 0
    while i < len(stream):
        k = stream[i:i + 1]
        out.append(k.decode())
        if k == b"D":
            nlen, _, n = _D.unpack_from(stream, i + 1)
            i += 1 + _D.size + nlen + n
        elif k == b"Z":
            nlen, _, _, zn = _Z.unpack_from(stream, i + 1)
            i += 1 + _Z.size + nlen + zn
        elif k == b"M":
            (n,) = _L.unpack_from(stream, i + 1)
            i += 1 + _L.size + n
        else:
            raise AssertionError(f"unexpected frame {k!r}")
    return out


def send_all(src: Path, c: Compression | None) -> bytes:
    tail = DirectoryTail(src, compression=c)
    tail.manifest_base = Manifest(capture_id="c")
    tail.finished.set()
    return b"".join(bytes(p) for p in tail)


@pytest.fixture
def images(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(compressible(10 * MiB) + os.urandom(5 * MiB))
    (src / "core-1.img").write_bytes(b"core" * 300)
    return src


@pytest.mark.slow
def test_compressed_pieces_arrive_whole_however_the_stream_is_cut(images, tmp_path):
    c = Compression("on")
    c.accept(["zstd"])
    stream = send_all(images, c)
    kinds = frames(stream)
    assert kinds.count("Z") == 3 and kinds.count("D") >= 2, kinds  # the random 4 MiB pieces go raw
    assert c.compressed_pieces == 3 and c.wire_bytes < c.raw_bytes
    assert len(stream) < sum(p.stat().st_size for p in images.iterdir())
    small = tmp_path / "small"
    small.mkdir()
    (small / "pages-2.img").write_bytes(compressible(200 << 10))
    one = Compression("on")
    one.accept(["zstd"])
    for src, s, cuts in ((images, stream, (7, 4096, 1 << 20)), (small, send_all(small, one), (1, 3))):
        for cut in cuts:
            d = tmp_path / f"d-{src.name}-{cut}"
            rx = StreamReceiver(d)
            for i in range(0, len(s), cut):
                rx.feed(memoryview(s)[i:i + cut])
            assert rx.complete
            verify_directory(d)  # the digests are of the raw bytes, as sent
            for f in src.iterdir():
                assert (d / f.name).read_bytes() == f.read_bytes()
    assert one.compressed_pieces == 1


@pytest.mark.parametrize("mode,encodings", [("on", None), ("on", []), ("on", ["lz4"]), ("off", ["zstd"])])
def test_nothing_is_compressed_unless_the_receiver_decodes_it(images, mode, encodings):
    c = Compression(mode)
    c.accept(encodings)  # an older agent's hello names no encodings
    assert set(frames(send_all(images, c))) == {"D", "M"}
    assert c.compressed_pieces == 0 and c.wire_bytes == c.raw_bytes


def _z_frame(name: bytes, raw: int, body: bytes) -> bytes:
    return b"Z" + _Z.pack(len(name), 0, raw, len(body)) + name + body


@pytest.mark.parametrize("frame,says", [
    (_z_frame(b"pages-1.img", 4096, b"not zstd at all" * 10), "corrupt compressed piece of pages-1.img"),
    (_z_frame(b"pages-1.img", 100, zstandard.ZstdCompressor().compress(bytes(4096))), "pages-1.img"),
    (_z_frame(b"pages-1.img", 8192, zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4096))),
     "gave 4096 bytes, its frame said 8192"),
    (b"Z" + _Z.pack(11, 0, 1 << 31, 16) + b"pages-1.img", "claims 16 -> 2147483648 bytes"),
    (b"Z" + _Z.pack(11, 0, 4096, 0) + b"pages-1.img", "claims 0 -> 4096 bytes"),
])
def test_a_bad_compressed_piece_fails_the_transfer_and_says_which(tmp_path, frame, says):
    rx = StreamReceiver(tmp_path / "d")
    with pytest.raises(TransferFailed) as e:
        rx.feed(frame)
    assert says in e.value.message and "send again" in e.value.action


# -- the choice, against a simulated link --------------------------------------------------------------


class Sim:
    """A link of `link_bps` and a compressor of `zstd_bps`, on a fake clock: the sender compresses a
    piece (the clock moves by its size over the compressor's speed), then sends it (by its wire size
    over the link's)."""

    def __init__(self, monkeypatch, link_bps: float, zstd_bps: float, in_socket: float = 1.0) -> None:
        self.t = 0.0
        self.in_socket = in_socket  # the share of a piece's time spent in sendall (the rest: waiting for it)
        self.link_bps, self.zstd_bps = link_bps, zstd_bps
        monkeypatch.setattr(compress.time, "perf_counter", lambda: self.t)
        monkeypatch.setattr(compress, "START_UNMEASURED", 0)  # the simulated link has no buffers to fill

    def stream(self, c: Compression, data: bytes, pieces: int) -> list[bool]:
        real = c._zc
        sim = self

        class Timed:
            def compress(self, b):  # noqa: ANN001, ANN202
                sim.t += len(b) / sim.zstd_bps
                return real.compress(b)

        c._zc = Timed()
        c.accept(["zstd"])
        c.started()
        wire_total, chosen = 0, []
        for _ in range(pieces):
            z, tried = c.encode(data)
            wire = len(z) if z is not None else len(data)
            wire_total += wire + 30
            c.record(wire_total, len(data), wire, tried, z is not None)
            self.t += (wire + 30) / self.link_bps
            c.sent(wire_total, self.in_socket * (wire + 30) / self.link_bps)
            chosen.append(z is not None)
        return chosen


PIECE = compressible(256 << 10)  # the simulated pieces are small: the choice counts pieces, not bytes


def test_a_slow_link_gets_compressed_pieces(monkeypatch):
    sim = Sim(monkeypatch, link_bps=50e6, zstd_bps=500e6)
    c = Compression("auto", threads=0)
    chosen = sim.stream(c, PIECE, 120)
    assert not any(chosen[:compress.SETTLE[False] + 1])  # the link is measured raw first
    assert sum(chosen[-60:]) >= 50, chosen  # then compressed, with a few raw pieces now and then to re-check
    assert c.link.rate(True) > c.link.rate(False) * 1.5


def test_a_fast_link_is_never_slowed_by_trying(monkeypatch):
    """Faster than the compressor: a sample says compressing cannot win, so no piece is compressed
    and the samples get rarer."""
    sim = Sim(monkeypatch, link_bps=3e9, zstd_bps=500e6)
    c = Compression("auto", threads=0)
    chosen = sim.stream(c, PIECE, 400)
    assert not any(chosen)
    assert 1 <= c.samples <= 7, c.samples  # 8, 16, 32, ... pieces apart


def test_a_stream_that_waits_for_its_pieces_is_not_compressed(monkeypatch):
    """Slow, but not because of the link: the pieces come as fast as CRIU writes the dump (or the
    pre-copy reads memory), and the socket takes each at once.  Compressing would only take CPU
    from the dump."""
    sim = Sim(monkeypatch, link_bps=300e6, zstd_bps=500e6, in_socket=0.1)
    c = Compression("auto", threads=0)
    assert not any(sim.stream(c, PIECE, 200))
    assert c.link.socket_share(False) < 0.2


def test_incompressible_data_is_sent_raw_even_on_a_slow_link(monkeypatch):
    sim = Sim(monkeypatch, link_bps=50e6, zstd_bps=2e9)
    c = Compression("auto", threads=0)
    assert not any(sim.stream(c, os.urandom(256 << 10), 200))
    assert c.samples >= 1 and c.link.sample_ratio > 0.99


def test_what_a_stream_learned_serves_the_next_one_to_the_same_destination(monkeypatch):
    """The pause's delta is a few pieces: it goes the way the pre-copy to the same spare found fastest."""
    sim = Sim(monkeypatch, link_bps=50e6, zstd_bps=500e6)
    link = Link()
    sim.stream(Compression("auto", threads=0, link=link), PIECE, 120)
    delta = Compression("auto", threads=0, link=link)
    assert sim.stream(delta, PIECE, 3) == [True, True, True]


def test_a_link_that_becomes_fast_goes_back_to_raw(monkeypatch):
    sim = Sim(monkeypatch, link_bps=50e6, zstd_bps=500e6)
    c = Compression("auto", threads=0)
    assert sum(sim.stream(c, PIECE, 120)[-20:]) >= 18
    sim.link_bps = 5e9  # the other streams to that spare ended
    later = sim.stream(c, PIECE, 600)
    assert not any(later[-100:]), later[-100:]


@pytest.mark.parametrize("host,same", [("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True), ("::1", True),
                                       ("[::1]", True), ("10.213.40.11", False), ("spare-1.example", False)])
def test_auto_never_compresses_towards_this_machines_loopback(host, same):
    assert compress.same_host(host) is same


def test_the_agent_reports_what_it_compressed(images):
    c = Compression("on", threads=0)
    c.accept(["zstd"])
    send_all(images, c)
    s = c.summary()
    assert s["mode"] == "on" and s["encoding"] == "zstd" and s["compressed_pieces"] == 3
    assert s["raw_bytes"] == 15 * MiB + 1200 and s["wire_bytes"] < s["raw_bytes"]


# -- the choice, through a real data port on a real, slower link ---------------------------------------

RECEIVER = r"""
import json, sys, threading, time
from pathlib import Path
from types import SimpleNamespace
from pitstop.transfer.dataport import DataPort
from pitstop.transfer.stream import StreamReceiver, verify_directory
dest = Path(sys.argv[1])
def open_slot(image_id):
    return SimpleNamespace(image_id=image_id, receiver=StreamReceiver(dest / image_id))
def finished(slot):
    m = verify_directory(dest / slot.image_id)
    return {"bytes": m.total_bytes, "files": len(m.files)}
port = DataPort(sys.argv[2], 0, token="t", open_slot=open_slot, fail_slot=lambda s: None, finished=finished,
                on_error=lambda slot, e: e).start()
print(port.port, flush=True)
sys.stdin.readline()
port.close()
"""


@pytest.fixture
def slow_host(tmp_path):
    """A host behind a 400 Mbit/s link, running a data port."""
    net = NetHosts()
    proc = None
    try:
        ns, addr = net.add("rx")
        net.shape("rx", 400)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "service")}
        proc = subprocess.Popen([*net.exec_prefix("rx"), sys.executable, "-c", RECEIVER, str(tmp_path / "rx"), addr],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        port = int(proc.stdout.readline())
        yield addr, port, tmp_path / "rx"
    finally:
        if proc is not None:
            end_stdin_child(proc)
        net.close()


def _stream(src: Path, addr: str, port: int, image_id: str, c: Compression) -> dict:
    tail = DirectoryTail(src, compression=c)
    tail.manifest_base = Manifest(capture_id=image_id)
    tail.finished.set()
    return dataport.send(iter(tail), addr, port, image_id, "t", timeout_s=60, compression=c)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_real_slow_link_compresses_what_compresses_and_nothing_else(slow_host, tmp_path):
    addr, port, rx_dir = slow_host
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(compressible(160 * MiB))
    c = Compression("auto", threads=0)
    reply = _stream(src, addr, port, "compressible", c)
    assert reply["bytes"] == 160 * MiB  # the receiver checked every digest against the manifest
    assert (rx_dir / "compressible" / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
    s = c.summary()
    assert s["compressed_pieces"] >= 10 and s["wire_bytes"] < 0.9 * s["raw_bytes"], s
    assert s["compressed_gbps"] > s["raw_gbps"], s

    (src / "pages-1.img").write_bytes(os.urandom(64 * MiB))  # the same link, data that does not compress
    r = Compression("auto", threads=0)
    _stream(src, addr, port, "random", r)
    assert r.compressed_pieces == 0 and r.samples >= 1, r.summary()
    assert (rx_dir / "random" / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()
