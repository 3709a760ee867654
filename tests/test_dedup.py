"""Copy-on-write pages sent once (transfer/dedup.py): references on the wire, exact files on arrival."""

import os
import struct
import threading

import numpy as np
import pytest

from pitstop.errors import TransferFailed
from pitstop.transfer.dedup import PAGE, Copy, Data, PageIndex
from pitstop.transfer.manifest import Manifest
from pitstop.transfer.stream import DirectoryTail, StreamReceiver, verify_directory

from .test_stream import _writer


def _pages(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=n * PAGE, dtype=np.uint8).tobytes()


def _flip(page: bytes, word: int) -> bytes:
    """The same page but for one 8-byte word (word 1 is not among the sampled ones)."""
    b = bytearray(page)
    b[word * 8] ^= 0xFF
    return bytes(b)


def _images():
    parent = _pages(300, 1) + bytes(4 * PAGE)  # some zero pages too
    # a child: most pages as in its parent (copy-on-write), some written since the fork,
    # one differing only in a word the index does not sample (a key collision to catch)
    child = (parent[:100 * PAGE] + _pages(20, 2) + parent[120 * PAGE:200 * PAGE]
             + _flip(parent[200 * PAGE:201 * PAGE], 1) + parent[201 * PAGE:])
    tail_bytes = b"x" * 1000  # a piece that is not whole pages
    return {"core-1.img": os.urandom(777), "pages-1.img": parent, "pages-2.img": child,
            "pages-3.img": parent[50 * PAGE:60 * PAGE] + tail_bytes}


def _stream(tmp_path, files, dedup, chunk=100_000):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    tail = DirectoryTail(src, dedup=dedup)
    tail.manifest_base = Manifest(capture_id="c1")
    t = threading.Thread(target=_writer, args=(src, files, tail.finished.set), kwargs={"chunk": chunk})
    t.start()
    rx = StreamReceiver(dst)
    wire = 0
    for piece in tail:
        wire += len(piece)
        rx.feed(piece)
    t.join()
    return tail, rx, dst, wire


@pytest.mark.parametrize("chunk", [PAGE * 64, 100_000], ids=["page-aligned writes", "unaligned writes"])
def test_cow_pages_go_as_references_and_arrive_exact(tmp_path, chunk):
    files = _images()
    tail, rx, dst, wire = _stream(tmp_path, files, dedup=True, chunk=chunk)
    assert rx.complete
    for name, data in files.items():
        assert (dst / name).read_bytes() == data, name
    verify_directory(dst)
    total = sum(map(len, files.values()))
    assert tail.sent == total  # progress counts file bytes
    # The child's 283 unchanged pages, the 10 pages of pages-3 and 3 of the 4 zero pages could
    # go as references (unaligned pieces lose a few); the collision page never does.
    assert tail.index.pages_referenced >= 250
    assert wire < total - 250 * PAGE
    if chunk % PAGE == 0:
        assert tail.index.pages_referenced == 283 + 10 + 3


def test_without_dedup_every_byte_is_sent(tmp_path):
    files = _images()
    tail, rx, dst, wire = _stream(tmp_path, files, dedup=False)
    assert tail.index is None and wire > sum(map(len, files.values()))
    for name, data in files.items():
        assert (dst / name).read_bytes() == data


def test_a_key_collision_is_caught_by_the_compare(monkeypatch):
    """Every page gets the same key: only pages whose bytes really match may become references."""
    from pitstop.transfer import dedup

    class Colliding:
        @staticmethod
        def xxh3_64_intdigest(_):
            return 42

    monkeypatch.setattr(dedup, "xxhash", Colliding)
    a = _pages(3, 7)
    b = a[:PAGE] + _flip(a[PAGE:2 * PAGE], 1) + a[2 * PAGE:]
    idx = PageIndex()
    sent = {"pages-1.img": a}
    assert [type(s) for s in idx.split("pages-1.img", 0, a, None, None)] == [Data]
    segs = idx.split("pages-2.img", 0, b, lambda n, o, k: memoryview(sent[n])[o:o + k], lambda n: len(sent[n]))
    rebuilt = b"".join(bytes(s.data) if isinstance(s, Data) else a[s.src_offset:s.src_offset + s.length]
                       for s in segs)
    assert rebuilt == b
    assert [type(s) for s in segs] == [Copy, Data] and idx.pages_referenced == 1


def test_index_stops_growing_at_its_cap():
    idx = PageIndex(max_pages=5)
    idx.split("pages-1.img", 0, _pages(10, 3), None, None)
    assert len(idx._where) == 5


@pytest.mark.parametrize("src,soff,n", [("pages-9.img", 0, PAGE), ("pages-1.img", PAGE, PAGE),
                                         ("pages-1.img", 0, 0)],
                         ids=["unknown file", "bytes not received", "empty"])
def test_receiver_refuses_references_to_what_it_does_not_have(tmp_path, src, soff, n):
    rx = StreamReceiver(tmp_path / "d")
    name = b"pages-1.img"
    rx.feed(b"D" + struct.pack("!HQI", len(name), 0, PAGE) + name + bytes(PAGE))
    dst = b"pages-2.img"
    with pytest.raises(TransferFailed, match="not received"):
        rx.feed(b"C" + struct.pack("!HQIHQ", len(dst), 0, n, len(src), soff) + dst + src.encode())


def test_receiver_refuses_path_tricks_in_references(tmp_path):
    rx = StreamReceiver(tmp_path / "d")
    name, src = b"pages-1.img", b"../etc/passwd"
    with pytest.raises(TransferFailed, match="refusing image file name"):
        rx.feed(b"C" + struct.pack("!HQIHQ", len(name), 0, PAGE, len(src), 0) + name + src)


@pytest.mark.parametrize("setting,processes,over_tls,want", [
    ("auto", 3, True, True), ("auto", 3, False, False), ("auto", 1, True, False),
    ("on", 3, False, True), ("on", 1, False, False), ("off", 3, True, False)])
def test_when_the_sender_looks_for_copy_on_write_pages(setting, processes, over_tls, want):
    from pitstop.agent.sending import dedup_pages

    assert dedup_pages(setting, processes, over_tls) is want
