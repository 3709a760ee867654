"""`pitstop run` after its worker moved: it follows the output from the worker's new agent and
exits with the worker's code, and the last line written before the exit is never lost."""

from __future__ import annotations

from pitstop.launcher import run


class _Agent:
    """Answers as an agent does: the worker's last line lands in its stdout file and its exit
    code is set (after the pumps drained) between the launcher's stdout and stderr reads."""

    def __init__(self) -> None:
        self.stdout = b"step 160 ok\n"
        self.reads = 0

    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        self.reads += 1
        h = {"x-pitstop-state": "running"}
        if self.reads >= 2:  # the worker printed "done" and exited just after the first stdout read
            self.stdout = b"step 160 ok\ndone\n"
            h = {"x-pitstop-state": "exited", "x-pitstop-exit-code": "0"}
        data = (self.stdout if stream == "stdout" else b"")[offset:]
        return data, h


def test_the_last_line_before_the_exit_is_not_lost(capfdbinary):
    a = _Agent()
    a.stdout = b""
    assert run.follow(a, "s.0") == 0
    assert capfdbinary.readouterr().out == b"step 160 ok\ndone\n"


class _Restored:
    """A worker restored here after an earlier move: this agent holds its output from byte 100 on
    (what came before went to the host it left), and answers a read from before with nothing."""

    def __init__(self) -> None:
        self.reads = 0

    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        self.reads += 1
        assert self.reads < 50, "a follower reading before the start of this copy would never get anywhere"
        h = {"x-pitstop-state": "exited", "x-pitstop-exit-code": "3", "x-pitstop-output-start": "100"}
        held = b"after the move\n" if stream == "stdout" else b""
        return (held[offset - 100:] if offset >= 100 else b""), h


def test_a_follower_that_starts_late_begins_where_this_hosts_copy_does(capfdbinary):
    """`pitstop attach` to a worker that moved twice: it reads what the current host holds."""
    assert run.follow(_Restored(), "s.0") == 3
    assert capfdbinary.readouterr().out == b"after the move\n"
