"""The local socket's group members act only on their own processes and workers (agent/api.py
local_app, agent/peercred.py), against a real agent, a real worker and a real uid 65534.

Before the fix a member of the socket's group registered a root process (its memory then went into
an image at the next move) and marked another tenant's running worker as exited (which also
deleted its network link, and the coordinator then saw nothing to evacuate)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .helpers import ddp_cmd, until, wait_for_step

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _as_nobody(sock: Path, method: str, path: str, body: dict) -> tuple[int, dict]:
    """One request on the local socket from uid 65534 in group 65534 (nogroup), connected after
    dropping root, so that the kernel's SO_PEERCRED names that user."""
    data = json.dumps(body).encode()
    request = (f"{method} {path} HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
               f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data
    probe = ("import os, socket, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
             "s = socket.socket(socket.AF_UNIX); "
             f"s.connect({str(sock)!r}); s.sendall({request!r}); "
             "d = b''\nwhile (c := s.recv(65536)): d += c\nsys.stdout.buffer.write(d)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60)
    assert out.stdout.startswith(b"HTTP/1.1 "), out.stderr[-1500:]
    head, _, payload = out.stdout.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_a_group_member_cannot_register_or_end_what_is_not_theirs(cluster, tmp_path):
    run = Path(tempfile.mkdtemp(prefix="pitstop-sock-", dir="/run"))
    run.chmod(0o755)
    try:
        a = cluster.start_agent("a", env={"PITSTOP_AGENT_LOCAL_GROUP": "nogroup",
                                          "PITSTOP_AGENT_SOCKET_PATH": str(run / "agent.sock")})
        sock = run / "agent.sock"
        until(lambda: sock.stat().st_gid == 65534, timeout=10, what="the socket given to its group")
        st = sock.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534, "the socket is the configured group's"
        assert stat.S_IMODE(run.stat().st_mode) == 0o750 and run.stat().st_gid == 65534
        out = tmp_path / "out"
        ranks = cluster.start_job("j", ddp_cmd(out, steps=400), 1, {0: "a"})
        w = cluster.wait_registered("a", "j.0")
        wait_for_step(ranks[0].log, 2)
        assert w.owner_uid == 0

        status, body = _as_nobody(sock, "POST", "/v1/workers", {"job": "mine", "rank": 0, "pid": w.root_pid})
        assert status == 403 and body["error"]["code"] == "not_your_process", body
        status, body = _as_nobody(sock, "POST", "/v1/workers/j.0:exited", {"code": 0})
        assert status == 403 and body["error"]["code"] == "not_your_worker", body
        status, body = _as_nobody(sock, "DELETE", "/v1/networks/j.0", {})
        assert status == 403, body

        ids = {x.id: x for x in a.client().workers()}
        assert "mine.0" not in ids and ids["j.0"].state == "running"
        # what is theirs they may do: a process of their own
        mine = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "setsid",
                                 "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
        try:
            from pitstop.agent import peercred
            from pitstop.proc import proctree

            until(lambda: proctree.children(mine.pid))  # unshare's child: init of its namespace
            init = proctree.children(mine.pid)[0]
            until(lambda: proctree.session_id(init) == init and peercred.process_uids(init) == {65534})
            status, body = _as_nobody(sock, "POST", "/v1/workers", {"job": "mine", "rank": 0, "pid": init})
            assert status == 201 and body["owner_uid"] == 65534, body
            status, body = _as_nobody(sock, "POST", "/v1/workers/mine.0:exited", {"code": 0})
            assert status == 200 and body["state"] == "exited", body
        finally:
            mine.kill()
            mine.wait(10)
        for r in ranks:
            r.proc.terminate()
            r.proc.wait(30)
    finally:
        shutil.rmtree(run, ignore_errors=True)
