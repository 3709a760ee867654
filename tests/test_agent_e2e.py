"""End to end, real: agents, CRIU, pitstop run, a torch gloo DDP job with no pitstop code.

Invariant (zdtm style): the job's final parameters are bit-for-bit those of an
uninterrupted run, whatever happened in between.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pitstop.criu import runtime
from pitstop.errors import IntegrityError, PitstopError, TransferFailed
from pitstop.migration.move import move_worker
from pitstop.proc import proctree

from .helpers import (
    WORKLOADS,
    CuttingProxy,
    assert_same_as_reference,
    ddp_cmd,
    free_port,
    let_finish,
    reference_hashes,
    step_times,
    wait_for_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _job(cluster, tmp_path, world=2, placement=None, **kw):
    with cluster.starting():
        a = cluster.agents.get("a") or cluster.start_agent("a")
        b = cluster.agents.get("b") or cluster.start_agent("b", spare=True)
    out = tmp_path / "out"
    ranks = cluster.start_job("j", ddp_cmd(out, **kw), world, placement or {r: "a" for r in range(world)})
    for r in range(world):
        cluster.wait_registered(placement[r] if placement else "a", f"j.{r}")
    return a, b, out, ranks


def _finish(ranks, out, timeout=120):
    let_finish(out)
    codes = [r.proc.wait(timeout) for r in ranks]
    logs = {r.rank: r.log.read_text(errors="replace")[-1500:] for r in ranks}
    assert codes == [0] * len(ranks), logs
    return logs


def test_move_rank_mid_training_bitwise_equal(cluster, tmp_path):
    a, b, out, ranks = _job(cluster, tmp_path, steps=100)
    wait_for_step(ranks[1].log, 10)
    src_pid = a.client().worker("j.1").root_pid
    rep = move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    assert rep.bytes > 10_000_000 and rep.restored_pid
    for phase in ("freeze", "dump", "transfer", "verify", "restore"):
        assert phase in rep.phases, rep.phases
    # The moved tree is gone from A, and runs on B.
    assert not proctree.exists(src_pid)
    wa = a.client().worker("j.1")
    assert wa.state == "moved" and wa.moved_to is not None and wa.moved_to["agent"] == "b"
    assert b.client().worker("j.1").state == "running"
    logs = _finish(ranks, out)
    # pitstop run on A kept streaming rank 1's output after the move, to the end.
    assert "done rank=1 steps=100" in logs[1]
    assert [s for s, _ in step_times(ranks[1].log)][-1] == 100
    # Nothing of pitstop's own in the job's output: util-linux unshare, when the move killed the
    # source's tree, printed "unshare: sigprocmask unblock failed" there (native/pitinit.c).
    whole = ranks[1].log.read_text(errors="replace")
    assert "unshare:" not in whole and "pitstop-init:" not in whole, whole[-1500:]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=100))
    # No images left on either side.
    assert not any(a.image_dir.iterdir()) and not any(b.image_dir.iterdir())
    assert b.client().worker("j.1").state == "exited" and b.client().worker("j.1").exit_code == 0


@pytest.mark.parametrize("shape", ["parent reads child", "piped through tee"])
def test_move_a_tree_with_a_pipe_inside_it(cluster, tmp_path, shape):
    """A pipe with both ends in the tree (a parent reading its child's stdout; `job | tee log`,
    as tenants launch jobs) moves as it is: after the move the reader still gets every line, in
    order, and only the tree's own output reaches the job's."""
    with cluster.starting():
        a = cluster.start_agent("a")
        b = cluster.start_agent("b", spare=True)
    job = [sys.executable, str(WORKLOADS / "pipe_tree.py"), "--lines", "150"]
    tee = tmp_path / "tee.log"
    if shape == "piped through tee":
        job = ["sh", "-c", f'"$@" | tee "{tee}"', "sh", *job]
    ranks = cluster.start_job("p", job, 1, {0: "a"})
    cluster.wait_registered("a", "p.0")
    wait_for_step(ranks[0].log, 20)
    rep = move_worker(a.client(), b.client(), "p.0", dest_name="b")
    assert rep.restored_pid and len(proctree.tree(rep.restored_pid)) >= 3  # init, parent, child
    assert ranks[0].proc.wait(120) == 0, ranks[0].log.read_text(errors="replace")[-1500:]
    log = ranks[0].log.read_text(errors="replace")
    assert "done in order n=150" in log and "child " not in log, log[-1500:]
    assert [s for s, _ in step_times(ranks[0].log)] == list(range(1, 151))  # each line once, none lost
    if shape == "piped through tee":
        assert tee.read_text().splitlines()[-1] == "done in order n=150"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_move_whole_tree_with_dataloader_children(cluster, tmp_path):
    cluster.start_agent("a", env={"PITSTOP_AGENT_DEDUP_PAGES": "on"})
    a, b, out, ranks = _job(cluster, tmp_path, steps=80, workers=2)
    wait_for_step(ranks[1].log, 8)
    root = a.client().worker("j.1").root_pid
    before = proctree.tree(root)
    assert len(before) >= 3, "the rank should have DataLoader worker children"
    rss = sum(_rss_bytes(p) for p in before)  # each process's pages, shared ones counted in each
    rep = move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    after = proctree.tree(rep.restored_pid)
    assert len(after) == len(before)
    assert all(not proctree.exists(p) for p in before)
    cap = next(c for c in a.client().captures() if c.id == rep.capture_id)
    if runtime.locate().carried:
        # The children's copy-on-write pages are not in the images at all: the CRIU pitstop carries
        # marks them as their parent's (PE_COW, criu/patches/), so the tree dumps about its unique memory.
        assert cap.bytes_total is not None and cap.bytes_total < 0.6 * rss, (cap, rss)
    else:
        # A stock CRIU dumps them in each child; they went as references to their parent's (transfer/dedup.py).
        assert cap.bytes_total and cap.bytes_deduplicated > 0.3 * cap.bytes_total, cap
    _finish(ranks, out)
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80, workers=2))
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80, workers=2))


def test_a_move_to_a_host_whose_criu_cannot_read_shared_pages_rolls_back(cluster, tmp_path):
    """The carried CRIU writes a worker child's shared pages as its parent's (PE_COW); a host that
    runs a stock CRIU would restore garbage there, so it refuses the image before CRIU runs, and
    the move rolls back: the rank trains on where it was, bitwise as if never touched."""
    if not runtime.locate().carried:
        pytest.skip("the carried CRIU is not built here (scripts/build-criu.sh)")
    cluster.start_agent("b", spare=True, env={"PITSTOP_CRIU_STOCK": "1"})
    a, b, out, ranks = _job(cluster, tmp_path, steps=80, workers=2)
    wait_for_step(ranks[1].log, 8)
    with pytest.raises(PitstopError) as e:
        move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    assert "PE_COW" in str(e.value) and "pitstop provision-criu" in str(e.value), e.value
    assert a.client().worker("j.1").state == "running"
    _finish(ranks, out)
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80, workers=2))


def test_corrupt_image_refused_before_criu_and_source_resumes(cluster, tmp_path):
    a, b, out, ranks = _job(cluster, tmp_path, steps=80)
    wait_for_step(ranks[1].log, 8)
    ca, cb = a.client(), b.client()
    ca.pause("j.0")  # as the coordinator does: nothing flows into j.1's connections while it is dumped
    cap = ca.capture("j.1", dest_url=b.url, image_id="img-corrupt")
    cap = ca.wait_capture(cap["id"], 120)
    assert cap.state == "sent"
    pages = max((b.image_dir / "in-img-corrupt").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError) as e:
        cb.verify("img-corrupt")
    assert "differs from the manifest" in e.value.message and pages.name in e.value.message
    assert not (b.image_dir / "in-img-corrupt").exists(), "a bad copy must be discarded"
    assert ca.rollback(cap.id)["state"] == "rolled_back"
    ca.resume("j.0")
    assert ca.worker("j.1").state == "running"
    _finish(ranks, out)
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80))


@pytest.mark.parametrize("path", ["data port", "http"])
def test_transfer_cut_halfway_source_resumes(cluster, tmp_path, path):
    """The network breaks mid-stream, on the data port and on the HTTP fallback alike."""
    if path == "http":
        cluster.start_agent("a", env={"PITSTOP_AGENT_DATA_STREAM": "0"})
        b = cluster.start_agent("b", spare=True)
        proxy = CuttingProxy(int(b.url.rsplit(":", 1)[1]), cut_after=20_000_000)
    else:  # b's data port behind the cutting proxy, which b announces as its data port
        data = free_port()
        proxy = CuttingProxy(data, cut_after=20_000_000)
        b = cluster.start_agent("b", spare=True, env={"PITSTOP_AGENT_DATA_LISTEN": f"127.0.0.1:{data}",
                                                      "PITSTOP_AGENT_DATA_ADVERTISE_PORT": str(proxy.port)})
    a, b, out, ranks = _job(cluster, tmp_path, steps=80)
    wait_for_step(ranks[1].log, 8)
    try:
        dst = b.client()
        if path == "http":
            dst.url = proxy.url  # the source streams through the cutting proxy
        with pytest.raises(TransferFailed) as e:
            move_worker(a.client(), dst, "j.1", peers=[(a.client(), "j.0")])
        assert proxy.cuts == 1
    finally:
        proxy.close()
    assert "transfer" in e.value.message
    assert a.client().worker("j.1").state == "running"
    caps = [c for c in a.client()._req("GET", "/v1/captures")]
    assert caps[-1]["state"] == "failed" and caps[-1]["error"]["code"] == "transfer_failed"
    _finish(ranks, out)
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80))
    assert not any(b.image_dir.iterdir()), "the partial copy must be discarded"
    assert not any(a.image_dir.iterdir())


def test_bad_requests_change_nothing(cluster, tmp_path):
    a, b, out, ranks = _job(cluster, tmp_path, steps=60)
    ca = a.client()
    # Unregistered worker.
    with pytest.raises(PitstopError) as e:
        ca.capture("no-such.0")
    assert e.value.http_status == 404 and "pitstop run" in e.value.action
    # No token, wrong token: refused, nothing happens.
    r = httpx.post(a.url + "/v1/captures", json={"worker_id": "j.1"})
    assert r.status_code == 401 and "PITSTOP_CLUSTER_TOKEN" in r.json()["error"]["action"]
    r = httpx.post(a.url + "/v1/captures", json={"worker_id": "j.1"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert ca.worker("j.1").state == "running" and ca._req("GET", "/v1/captures") == []
    # Registering a dead pid, or a process that is not a capturable tree root.
    local = httpx.Client(transport=httpx.HTTPTransport(uds=str(a.state_dir / "agent.sock")), base_url="http://a")
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = local.post("/v1/workers", json={"job": "x", "rank": 0, "pid": dead.pid})
    assert r.status_code == 412 and r.json()["error"]["code"] == "no_such_process"
    plain = subprocess.Popen(["sleep", "30"])
    try:
        r = local.post("/v1/workers", json={"job": "x", "rank": 0, "pid": plain.pid})
        assert r.status_code == 412 and "pitstop run" in r.json()["error"]["action"]
    finally:
        plain.kill()
        plain.wait()
    r = local.post("/v1/workers", json={"job": "bad job!", "rank": -1, "pid": 1})
    assert r.status_code == 400 and "job" in r.json()["error"]["message"]
    # A worker that has exited cannot be captured.
    _finish(ranks, out)
    with pytest.raises(PitstopError) as e:
        ca.capture("j.0")
    assert e.value.http_status in (409, 412)
    assert ca._req("GET", "/v1/captures") == []


def test_agent_refuses_to_start_without_cluster_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_CLUSTER_TOKEN"}
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", "agent", "--name", "x", "--listen", "127.0.0.1:1",
                        "--state-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "cluster token" in p.stderr and "PITSTOP_CLUSTER_TOKEN" in p.stderr


@pytest.mark.parametrize("command,var,value,says", [
    ("agent", "PITSTOP_AGENT_DEDUP_PAGES", "1", "'auto', 'on' or 'off'"),
    ("agent", "PITSTOP_AGENT_COMPRESS", "zstd", "'auto', 'on' or 'off'"),
    ("agent", "PITSTOP_AGENT_COMPRESS_LEVEL", "30", "less than or equal to 19"),
    ("coordinator", "PITSTOP_COORDINATOR_FLUSH_S", "abc", "valid number")])
def test_a_bad_setting_is_named_not_a_traceback(tmp_path, command, var, value, says):
    args = (["--name", "x", "--state-dir", str(tmp_path)] if command == "agent" else ["--db", str(tmp_path / "c.db")])
    p = subprocess.run([sys.executable, "-m", "pitstop.cli", command, "--insecure", "--listen", "127.0.0.1:1", *args],
                       env={**os.environ, var: value}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    out = " ".join(p.stderr.split())
    assert f"bad setting: {var}='{value}'" in out and says in out
    assert not any(tmp_path.iterdir())  # nothing created


def test_command_line_flags_win_over_the_environment(monkeypatch):
    """`--coordinator` was once dropped when no PITSTOP_COORDINATOR was set (an aliased field takes
    only its alias unless populate_by_name): an agent under systemd then never joined its cluster."""
    from pitstop.agent.settings import AgentSettings
    from pitstop.coordinator.settings import CoordinatorSettings

    monkeypatch.delenv("PITSTOP_COORDINATOR", raising=False)
    monkeypatch.delenv("PITSTOP_AGENT_COORDINATOR", raising=False)
    assert AgentSettings(coordinator="http://c:7000").coordinator == "http://c:7000"
    monkeypatch.setenv("PITSTOP_COORDINATOR", "http://env:7000")
    assert AgentSettings(coordinator="http://flag:7000").coordinator == "http://flag:7000"
    assert AgentSettings().coordinator == "http://env:7000"
    monkeypatch.setenv("PITSTOP_CLUSTER_TOKEN", "from-env")
    assert CoordinatorSettings(cluster_token="given").cluster_token == "given"


def test_local_socket_checks_peer_credentials(tmp_path):
    """Even if the socket file were opened to everyone, the kernel's SO_PEERCRED decides."""
    import shutil
    import tempfile

    from pitstop.dev.devcluster import free_port, wait_http

    state = Path(tempfile.mkdtemp(prefix="pitstop-peercred-", dir="/tmp"))
    state.chmod(0o711)
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "pitstop.cli", "agent", "--name", "pc", "--insecure",
                          "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
                          "--image-dir", str(state / "images")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=p)
        sock = state / "agent.sock"
        for _ in range(100):
            if sock.exists() and sock.stat().st_mode & 0o777 == 0o660:
                break
            time.sleep(0.05)
        sock.chmod(0o666)
        ok = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://a").get("/v1/info")
        assert ok.status_code == 200 and ok.json()["name"] == "pc"
        # Raw HTTP over the socket as uid 65534 (everything imported before dropping root: the
        # interpreter's own files may not be readable by that user).
        probe = ("import os, socket, sys; s = socket.socket(socket.AF_UNIX); os.setgid(65534); os.setuid(65534); "
                 f"s.connect({str(sock)!r}); "
                 "s.sendall(b'POST /v1/workers HTTP/1.1\\r\\nhost: a\\r\\ncontent-length: 2\\r\\n\\r\\n{}'); "
                 "d = b''\nwhile (c := s.recv(65536)): d += c\nsys.stdout.write(d.decode())")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith("HTTP/1.1 403"), (out.stdout, out.stderr[-1500:])
        err = json.loads(out.stdout.split("\n\n", 1)[1])["error"]  # text mode turned CRLF into LF
        assert err["code"] == "forbidden_peer" and "uid 65534" in err["message"], err
        assert "pitstop" in err["action"]
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
        shutil.rmtree(state, ignore_errors=True)


def test_a_second_agent_on_the_same_state_directory_refuses_to_start(tmp_path):
    """Two agents on one state directory: the second once unlinked the first's local socket and bound
    its own, and every `pitstop run` there then reached an agent that did not know its workers.  The
    second must refuse, naming the first's pid; the first keeps its socket; once the first is gone
    (even killed), its lock file keeps nobody out."""
    from pitstop.dev.devcluster import wait_http

    state = tmp_path / "state"

    def start(name: str, port: int, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pitstop.cli", "agent", "--name", name, "--insecure",
                                 "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
                                 "--image-dir", str(tmp_path / f"images-{name}")],
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                start_new_session=True,  # no tmpfs of its own: the SIGKILL below would leave it
                                env={**os.environ, "PITSTOP_AGENT_IMAGE_MOUNT": "false"})

    def local_name() -> str:
        c = httpx.Client(transport=httpx.HTTPTransport(uds=str(state / "agent.sock")), base_url="http://a")
        return c.get("/v1/info", timeout=10).json()["name"]

    first_port, second_port = free_port(), free_port()
    first = start("first", first_port)
    second = None
    try:
        wait_http(f"http://127.0.0.1:{first_port}/healthz", proc=first)
        second = start("second", second_port, subprocess.PIPE)
        _, err = second.communicate(timeout=60)
        said = " ".join(err.split())
        assert second.returncode == 1, said
        assert f"pid {first.pid}" in said and "agent first" in said and str(state) in said, said
        assert "--state-dir" in said and f"kill {first.pid}" in said, said
        assert "Traceback" not in said
        assert local_name() == "first"  # its socket is still its own
        assert not (tmp_path / "images-second").exists()  # refused before anything else was made
        os.killpg(first.pid, signal.SIGKILL)  # no clean exit: the kernel drops the lock all the same
        first.wait(20)
        second = start("second", second_port)
        wait_http(f"http://127.0.0.1:{second_port}/healthz", proc=second)
        assert local_name() == "second"
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
