"""Unit tests of the image stream: tailing files being written, framing, integrity."""

import os
import threading
import time
from pathlib import Path

import pytest

from pitstop.errors import IntegrityError, TransferFailed
from pitstop.transfer.manifest import Manifest, verify
from pitstop.transfer.stream import DirectoryTail, StreamReceiver, verify_directory


def _writer(d, files, done, chunk=100_000, delay=0.001):
    for name, data in files.items():
        with open(d / name, "wb") as f:
            for i in range(0, len(data), chunk):
                f.write(data[i:i + chunk])
                f.flush()
                time.sleep(delay)
    done()


def test_tail_streams_files_while_they_are_written(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    files = {"pages-1.img": os.urandom(3_000_000), "core-1.img": os.urandom(1234), "empty.img": b""}
    tail = DirectoryTail(src)
    tail.manifest_base = Manifest(capture_id="c1", worker={"id": "j.1"})
    t = threading.Thread(target=_writer, args=(src, files, tail.finished.set))
    t.start()
    rx = StreamReceiver(dst)
    for piece in tail:
        rx.feed(piece[:7])  # arbitrary re-chunking on the wire
        rx.feed(piece[7:])
    t.join()
    assert rx.complete
    for name, data in files.items():
        assert (dst / name).read_bytes() == data
    m = verify_directory(dst)
    assert m.worker == {"id": "j.1"} and m.total_bytes == sum(map(len, files.values()))
    assert tail.sent == m.total_bytes


def _streamed(src: Path, dst: Path) -> StreamReceiver:
    """`src`, a finished dump, streamed whole into `dst`."""
    tail = DirectoryTail(src)
    tail.finished.set()
    rx = StreamReceiver(dst)
    for piece in tail:
        rx.feed(piece)
    return rx


def test_logs_and_manifest_names_are_not_streamed(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "dump.log").write_text("x")
    (src / "a.img").write_bytes(b"abc")
    rx = _streamed(src, tmp_path / "d")
    assert [f.name for f in rx.manifest.files] == ["a.img"]


def test_sender_failure_is_an_error_frame(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.img").write_bytes(b"abc")
    tail = DirectoryTail(src)
    tail.failure = RuntimeError("dump failed")
    rx = StreamReceiver(tmp_path / "d")
    with pytest.raises(TransferFailed, match="dump failed"):
        for p in tail:
            rx.feed(p)


def test_tampered_stream_fails_manifest_check(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.img").write_bytes(b"A" * 1000)
    tail = DirectoryTail(src)
    tail.finished.set()
    wire = b"".join(tail)
    assert wire.count(b"A" * 1000) == 1
    rx = StreamReceiver(tmp_path / "d")
    with pytest.raises(IntegrityError, match="differ"):
        rx.feed(wire.replace(b"A" * 1000, b"B" * 1000))  # the file's bytes changed on the way
    assert not rx.complete


@pytest.mark.parametrize("name", ["../evil", "x/y", ".hidden"])
def test_receiver_refuses_path_tricks(tmp_path, name):
    import struct
    b = name.encode()
    frame = b"D" + struct.pack("!HQI", len(b), 0, 1) + b + b"x"
    with pytest.raises(TransferFailed, match="refusing"):
        StreamReceiver(tmp_path / "d").feed(frame)


def test_verify_names_every_problem(tmp_path):
    d = tmp_path
    (d / "a.img").write_bytes(b"1234")
    (d / "b.img").write_bytes(b"5678")
    _streamed(d, tmp_path / "copy")
    copy = tmp_path / "copy"
    (copy / "a.img").write_bytes(b"1235")
    (copy / "b.img").unlink()
    with pytest.raises(IntegrityError) as e:
        verify(copy, Manifest.read(copy))
    assert "a.img: content differs" in e.value.message and "b.img: missing" in e.value.message


def test_stream_detects_shrinking_file(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "a.img").write_bytes(b"x" * 100_000)
    tail = DirectoryTail(d)
    it = iter(tail)
    for _ in range(2):  # announcement and header (small pieces go together), data
        next(it)
    (d / "a.img").write_bytes(b"x" * 10)
    with pytest.raises(TransferFailed, match="shrank"):
        list(it)


def _open_under(d) -> list[str]:
    """Files under `d` this process holds open or mapped.  Not a count of all fds: other tests'
    leftovers (a client collected by the GC) may close theirs meanwhile, as one did in a full run."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        held += [ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6]
    return sorted(h for h in held if h.startswith(str(d)))


def test_consumer_giving_up_stops_read_ahead_and_closes_files(tmp_path):
    """The sender reads ahead in a thread; a failed PUT must not leave it running or files open."""
    src = tmp_path / "s"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(3 << 20))  # mapped, not read: > 256 KiB pieces
    it = iter(DirectoryTail(src))  # never finished: the producer would poll forever
    pieces = [next(it) for _ in range(2)]  # announcement with header, data
    assert bytes(pieces[1][:16]) == (src / "pages-1.img").read_bytes()[:16]
    assert _open_under(src)  # the check below can see an open file
    del pieces  # a mapped piece holds its file until dropped
    it.close()
    assert _open_under(src) == []
    assert not any(t.name == "stream-read-ahead" for t in threading.enumerate())


def test_write_errors_surface_from_the_write_thread(tmp_path):
    import asyncio
    import errno

    from pitstop.transfer.stream import receive_into

    class Full(StreamReceiver):
        def feed_all(self, chunks):
            raise OSError(errno.ENOSPC, "No space left on device")

    async def body():
        for _ in range(4):
            yield b"x" * (3 << 20)

    with pytest.raises(OSError, match="No space"):
        asyncio.run(receive_into(Full(tmp_path / "d"), body(), batch_bytes=4 << 20))


def test_manifest_with_another_digest_is_refused(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    (src / "a.img").write_bytes(b"abc")
    tail = DirectoryTail(src)
    tail.manifest_base = Manifest(capture_id="c", digest_algorithm="sha256")
    tail.finished.set()
    rx = StreamReceiver(tmp_path / "d")
    with pytest.raises(IntegrityError, match="same pitstop version"):
        for p in tail:
            rx.feed(p)


def test_any_rechunking_of_the_stream_gives_the_same_files(tmp_path):
    """The receiver parses headers in place and buffers only a header cut by a piece boundary:
    cut the stream at random places, down to single bytes, and the files must come out whole."""
    import random

    src = tmp_path / "s"
    src.mkdir()
    files = {f"f{i}.img": os.urandom(random.Random(i).randint(0, 5000)) for i in range(12)}
    for n, data in files.items():
        (src / n).write_bytes(data)
    tail = DirectoryTail(src)
    tail.finished.set()
    stream = b"".join(bytes(p) for p in tail)
    for seed in range(5):
        rng = random.Random(seed)
        rx = StreamReceiver(tmp_path / f"d{seed}")
        i = 0
        while i < len(stream):
            k = rng.choice([1, 2, 3, 7, 16, 64, 500, 4096])
            rx.feed(memoryview(stream)[i:i + k])
            i += k
        assert rx.complete
        for n, data in files.items():
            assert (tmp_path / f"d{seed}" / n).read_bytes() == data
