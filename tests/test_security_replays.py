"""The audit of the snapshot, recovery and local-network surface, replayed against the real
services (real agents and coordinator, CRIU, namespaces; the attacker a real uid 65534).  Each test
fails on the code the audit found it in (docs/reliability.md, "The security audit")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pitstop.dev.devcluster import pitstop_cmd

from .helpers import WORKLOADS, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs
from .test_local_socket_owners import _as_nobody as _as_nobody_on_socket
from .test_worker_network_e2e import _cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _as_nobody(script: str) -> None:
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script],
                   check=True, timeout=30)


@pytest.fixture
def open_dir():
    """A job directory any local user may write to (the audit's premise), reachable by uid 65534
    (under $TMPDIR; pytest's own directories are root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="pitstop-audit-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _appender_with_snapshots(cluster, cc, log: Path, out: Path, *args: str) -> list:
    """The one-rank appender job on host-b with its own address and a snapshot every 5 s, once a
    snapshot of it is committed."""
    ranks = cluster.start_job("app", [sys.executable, str(WORKLOADS / "appender.py"), "--log", str(log), "--out",
                                      str(out), *args], 1, {0: "host-b"},
                              addresses={0: cluster.worker_address(0)}, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "app", 1)
    until(lambda: [s for s in cc.snapshots("app")["snapshots"] if s["state"] == "committed"], timeout=90,
          what="a committed snapshot")
    return ranks


def test_c1_a_recovery_never_follows_a_users_links_to_roots_files(cluster, open_dir):
    """C1: a local user turns the job's log and its input file into links to root's files after a
    snapshot.  Before the fix the recovery truncated the root file through the link (50 -> 0 bytes)
    and the restored rank got descriptors on it and on a root-only file.  Now the recovery's plan
    refuses before anything is stopped: nothing of root's is touched, and the job trains on."""
    cc = _cluster(cluster, spares=1)
    job = open_dir / "job"
    job.mkdir()
    job.chmod(0o777)
    victim, secret = open_dir / "root-owned", open_dir / "root-only"
    victim.write_text("v" * 49 + "\n")
    victim.chmod(0o644)
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    log, data, out = job / "job.log", job / "input", job / "result"
    data.write_text("input\n")
    ranks = _appender_with_snapshots(cluster, cc, log, out, "--hold", str(data), "--steps", "500")
    wait_for_step(ranks[0].log, 150)
    _as_nobody(f"rm -f {log} {data} && ln -s {victim} {log} && ln -s {secret} {data}")
    p = subprocess.run([*pitstop_cmd(), "recover", "app", "--node", "host-b", "--wait", "--json"], env=cluster.env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout
    op = json.loads(p.stdout)
    err = op["error"]["message"]
    assert op["metadata"]["result"] == "failed" and "is a symbolic link" in err and str(log) in err, op
    assert str(data) in err, "what CRIU would reopen is checked too, before anything stops"
    assert set(op["metadata"]["phases"]) <= {"plan"}, "refused in the plan: nothing fenced, stopped or restored"
    assert victim.read_text() == "v" * 49 + "\n" and victim.stat().st_uid == 0
    assert ranks[0].proc.wait(120) == 0, "the job trained on where it was"
    assert victim.read_text() == "v" * 49 + "\n"


def _on_socket_as_nobody(sock: Path, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """One request on an agent's local socket from uid 65534 (tests/test_local_socket_owners.py)."""
    return _as_nobody_on_socket(sock, method, path, body or {})


@pytest.fixture
def group_socket():
    """An agent socket in group nogroup, in a directory uid 65534 can reach."""
    run = Path(tempfile.mkdtemp(prefix="pitstop-sock-", dir="/run"))
    run.chmod(0o755)
    try:
        yield run / "agent.sock"
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return {ln.split()[0] for ln in out.splitlines()}


def test_h1_a_network_is_named_by_its_whole_worker_id(cluster, group_socket, monkeypatch):
    """H1: `DELETE /v1/networks/victim-0` from a member of the socket's group removed the network of
    root's worker victim.0 (names mapped `.` to `-`); and the second rank of a job whose name has 39+
    characters destroyed its first rank's network (names were cut at 40 characters).  Now a network
    id names one worker exactly, and a user may remove only what they prepared."""
    from pitstop.dev.netns import NetHosts
    from pitstop.network import workerns

    cluster.net = NetHosts()
    cluster.start_coordinator()
    cluster.start_agent("host-a", env={"PITSTOP_AGENT_LOCAL_GROUP": "nogroup",
                                       "PITSTOP_AGENT_SOCKET_PATH": str(group_socket)})
    until(lambda: group_socket.exists() and group_socket.stat().st_gid == 65534, timeout=10, what="the socket")
    long_job = "j" * 45
    sleeper = [sys.executable, str(WORKLOADS / "sleeper.py"), "60"]
    ranks = cluster.start_job("victim", sleeper, 1, {0: "host-a"}, addresses={0: cluster.worker_address(0)})
    ranks += cluster.start_job(long_job, sleeper, 2, {0: "host-a", 1: "host-a"},
                               addresses={0: cluster.worker_address(1), 1: cluster.worker_address(2)})
    for wid in ("victim.0", f"{long_job}.0", f"{long_job}.1"):
        cluster.wait_registered("host-a", wid)
    monkeypatch.setenv(workerns.NETNS_PREFIX_ENV, cluster.worker_netns_prefix)  # as its agents name them
    names = {workerns.netns_name(w) for w in ("victim.0", f"{long_job}.0", f"{long_job}.1")}
    assert len(names) == 3 and names <= _netns(), "each rank its own namespace, the long job's two included"
    for alias in ("victim-0", "victim_0"):
        status, body = _on_socket_as_nobody(group_socket, "DELETE", f"/v1/networks/{alias}")
        assert status == 404 and body["error"]["code"] == "no_such_network", (alias, body)
    status, body = _on_socket_as_nobody(group_socket, "DELETE", "/v1/networks/victim.0")
    assert status == 403 and body["error"]["code"] == "not_your_worker", body
    assert names <= _netns(), "nothing of root's was removed"
    ws = {w.id: w for w in cluster.agents["host-a"].client().workers()}
    assert all(ws[w].state == "running" for w in ("victim.0", f"{long_job}.0", f"{long_job}.1"))
    for r in ranks:
        r.proc.terminate()
        r.proc.wait(30)


def _nobodys_init() -> tuple[subprocess.Popen, int]:
    """A process of uid 65534's own, capturable (init of its PID namespace and session)."""
    from pitstop.agent import peercred
    from pitstop.proc import proctree

    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "setsid",
                          "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "120"])
    until(lambda: proctree.children(p.pid))
    init = proctree.children(p.pid)[0]
    until(lambda: proctree.session_id(init) == init and peercred.process_uids(init) == {65534})
    return p, init


def test_h2_a_job_belongs_to_the_user_of_its_ranks(cluster, tmp_path):
    """H2: uid 65534 registered a process of its own as rank 7 of root's job (and with it a Slurm job
    of its choosing and a snapshot interval for the job).  Now a job is its ranks' user's: another
    user's registration into it is refused on the job's own host and on any other (the coordinator
    knows whose it is); under a name of its own it is theirs as before."""
    from pitstop.dev.netns import NetHosts
    from pitstop.wire.coordinator_client import CoordinatorClient

    socks = {}
    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        for name in ("host-a", "host-b"):
            run = Path(tempfile.mkdtemp(prefix="pitstop-sock-", dir="/run"))
            run.chmod(0o755)
            socks[name] = run / "agent.sock"
            cluster.start_agent(name, env={"PITSTOP_AGENT_LOCAL_GROUP": "nogroup",
                                           "PITSTOP_AGENT_SOCKET_PATH": str(socks[name])})
    intruder = None
    try:
        for sock in socks.values():
            until(lambda s=sock: s.exists() and s.stat().st_gid == 65534, timeout=10, what="the socket")
        cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        ranks = cluster.start_job("victim", [sys.executable, str(WORKLOADS / "sleeper.py"), "60"], 1, {0: "host-a"})
        cluster.wait_registered("host-a", "victim.0")
        _wait_jobs(cc, "victim", 1)
        intruder, init = _nobodys_init()
        body = {"job": "victim", "rank": 7, "pid": init, "slurm_job": "4242", "snapshot_every_s": 5}
        for host in ("host-a", "host-b"):
            status, got = _on_socket_as_nobody(socks[host], "POST", "/v1/workers", body)
            assert status == 403 and got["error"]["code"] == "not_your_job", (host, got)
            assert "belong to uid 0" in got["error"]["message"], got
        assert sorted(w["id"] for w in _wait_jobs(cc, "victim", 1)["workers"]) == ["victim.0"]
        assert cc.snapshots("victim")["every_s"] is None, "the job's snapshot interval is its own"
        status, got = _on_socket_as_nobody(socks["host-b"], "POST", "/v1/workers", {**body, "job": "mine"})
        assert status == 201 and got["owner_uid"] == 65534, got
        for r in ranks:
            r.proc.terminate()
            r.proc.wait(30)
    finally:
        if intruder is not None:
            intruder.kill()
            intruder.wait(10)
        for sock in socks.values():
            shutil.rmtree(sock.parent, ignore_errors=True)


class _Flood:
    """Idle TCP connections to a port, renewed every `renew_s` (inside the header deadline), from
    `sources` (loopback addresses), `per_source` each: the audit's H3 flood."""

    def __init__(self, host: str, port: int, sources: list[str], per_source: int, renew_s: float = 8.0) -> None:
        import threading

        self.addr, self.sources, self.per_source, self.renew_s = (host, port), sources, per_source, renew_s
        self.held: list = []
        self.opened = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        import socket

        for s in self.held:
            s.close()
        self.held = []
        for src in self.sources:
            for _ in range(self.per_source):
                s = socket.socket()
                s.setblocking(False)
                s.bind((src, 0))
                try:
                    s.connect(self.addr)
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    continue
                self.held.append(s)
        self.opened += len(self.held)

    def _run(self) -> None:
        while not self.stop.is_set():
            self._open()
            self.stop.wait(self.renew_s)
        for s in self.held:
            s.close()

    def __enter__(self) -> "_Flood":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.timeout(400)
def test_h3_a_flood_of_idle_connections_forces_no_recovery(cluster, tmp_path, monkeypatch):
    """H3: 4,300 silent connections, renewed every 8 s, made the agents' full reports fail (503);
    the agents stopped beating over UDP, isolated their snapshot jobs after 6 s, and the coordinator
    declared them failed and recovered a healthy job.  Now one address gets its share of the
    connections only, a beat by datagram is contact whatever the report's fate, and an agent whose
    beats are answered never isolates its ranks: from one address or from 43, no recovery is
    forced and the job never stops."""
    import resource
    import time

    from pitstop.wire.coordinator_client import CoordinatorClient

    monkeypatch.setenv("PITSTOP_COORDINATOR_FAILURE_DEADLINE_S", "6")  # as the recovery tests: quicker to fail
    monkeypatch.setenv("PITSTOP_AGENT_SELF_FENCE_S", "3")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))
    try:
        cc = _cluster(cluster, spares=1)
        log, out = tmp_path / "job.log", tmp_path / "result"
        steps = 1400
        ranks = _appender_with_snapshots(cluster, cc, log, out, "--steps", str(steps), "--step-sleep", "0.03")
        url = httpx_url(cluster.coordinator_url)
        side = []
        for n, (sources, per_source) in enumerate(((["127.0.0.2"], 4300),
                                                   ([f"127.0.0.{i}" for i in range(2, 45)], 100))):
            with _Flood(url[0], url[1], sources, per_source) as flood:
                time.sleep(2)
                # a rank starts on the host meanwhile: what it reports changed, and only a full report says so
                side += cluster.start_job(f"side{n}", [sys.executable, str(WORKLOADS / "sleeper.py"), "30"], 1,
                                          {0: "host-b"})
                time.sleep(14)  # past the failure deadline (6 s) and the self-fence (3 s) twice over
            assert flood.opened >= 4300, flood.opened
            ops = [o for o in CoordinatorClient(cluster.coordinator_url, cluster.operator_token).ops()
                   if o["metadata"].get("job") == "app"]
            assert ops == [], f"a recovery was forced by a flood from {len(sources)} address(es): {ops}"
            w = {x.id: x for x in cluster.agents["host-b"].client().workers()}["app.0"]
            assert w.state == "running" and "isolated" not in (w.reason or ""), w
        assert ranks[0].proc.wait(120) == 0
        for r in side:
            r.proc.terminate()
            r.proc.wait(30)
        total = 0
        for step in range(1, steps + 1):
            total = (total * 31 + step) % 1_000_003
        assert out.read_text().strip() == str(total)
        agent_log = (cluster.root / "host-b" / "agent.log")
        said = agent_log.read_text() if agent_log.exists() else ""
        assert "isolated" not in said, "host-b never isolated its ranks"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def httpx_url(u: str) -> tuple[str, int]:
    import httpx

    p = httpx.URL(u)
    return p.host, int(p.port or 80)


def test_m1_a_workers_output_is_its_owners_and_the_operators(cluster, group_socket):
    """M1: another user read a root worker's state and output over the local socket, and the
    read-only token read it through the coordinator (a line held WANDB_API_KEY=...).  Now output
    and state on the local socket are the worker's owner's; through the coordinator, output is a
    read for the operator token only."""
    import httpx

    cluster.start_coordinator(env={"PITSTOP_READ_TOKEN": "reader-token"})
    cluster.start_agent("host-a", env={"PITSTOP_AGENT_LOCAL_GROUP": "nogroup",
                                       "PITSTOP_AGENT_SOCKET_PATH": str(group_socket)})
    until(lambda: group_socket.exists() and group_socket.stat().st_gid == 65534, timeout=10, what="the socket")
    secret = [sys.executable, "-c", "import time; print('WANDB_API_KEY=abc123', flush=True); time.sleep(60)"]
    ranks = cluster.start_job("tenant", secret, 1, {0: "host-a"})
    cluster.wait_registered("host-a", "tenant.0")
    for path in ("/v1/workers/tenant.0/output", "/v1/workers/tenant.0"):
        status, body = _on_socket_as_nobody(group_socket, "GET", path)
        assert status == 403 and body["error"]["code"] == "not_your_worker", (path, body)
    url = f"{cluster.coordinator_url}/v1/workers/tenant.0/output"
    r = httpx.get(url, headers={"Authorization": "Bearer reader-token"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_token", r.text
    r = httpx.get(url, headers={"Authorization": f"Bearer {cluster.operator_token}"}, timeout=10)
    assert r.status_code == 200 and r.headers["X-Pitstop-State"] == "running", r.text
    for r_ in ranks:
        r_.proc.terminate()
        r_.proc.wait(30)
