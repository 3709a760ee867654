"""launcher/stdio.py: when `pitstop run`'s stdout and stderr are one stream (the worker then gets one
pipe for both, so that their order is its own), on real descriptors of this process."""

from __future__ import annotations

import os

import pytest

from pitstop.launcher import stdio


@pytest.fixture
def fds():
    opened: list[int] = []

    def keep(*fd: int) -> tuple[int, ...]:
        opened.extend(fd)
        return fd

    yield keep
    for fd in opened:
        os.close(fd)


def test_one_description_is_one_stream(fds, tmp_path):
    r, w = fds(*os.pipe())
    assert stdio.one_stream(w, *fds(os.dup(w)))  # `2>&1` into a pipe
    f, = fds(os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT))
    assert stdio.one_stream(f, *fds(os.dup(f)))  # `>log 2>&1`


def test_a_file_opened_twice_is_one_stream_only_when_both_append(fds, tmp_path):
    if stdio._kcmp_same(0, 0) is None:
        pytest.skip("no kcmp(2) here: two opens of one file at the same offset cannot be told from one")
    log = tmp_path / "log"
    a, b = fds(os.open(log, os.O_WRONLY | os.O_CREAT), os.open(log, os.O_WRONLY))
    assert not stdio.one_stream(a, b)  # `>log 2>log`: a plain run overwrites, no order to keep
    a, b = fds(os.open(log, os.O_WRONLY | os.O_APPEND), os.open(log, os.O_WRONLY | os.O_APPEND))
    assert stdio.one_stream(a, b)  # `>>log 2>>log`: every write at the end, in program order


def test_a_pipe_fifo_or_terminal_shared_is_one_stream(fds, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r, = fds(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert stdio.one_stream(*fds(os.open(fifo, os.O_WRONLY), os.open(fifo, os.O_WRONLY)))


def test_different_targets_or_a_closed_fd_are_not(fds, tmp_path):
    a, b = fds(os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT), os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT))
    assert not stdio.one_stream(a, b)
    r, w = fds(*os.pipe())
    assert not stdio.one_stream(a, w)
    closed = os.dup(w)
    os.close(closed)
    assert not stdio.one_stream(w, closed)
