"""Torch jobs across hosts with their own addresses (network namespaces on one bridge): each
worker has an address of its own that moves with it, so the TCPStore, gloo's connections
and everything else the program holds survive the move; unrelated connections are reset.
All real: agents, coordinator, CRIU, torch gloo, namespaces, macvlan, nftables."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pitstop.dev.devcluster import step_gaps
from pitstop.dev.netns import NetHosts
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import WORKLOADS, assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, wait_for_step
from .test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _netns_left(cluster) -> list[str]:  # noqa: ANN001
    """This cluster's workers' namespaces (others may run beside it, under prefixes of their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(cluster.worker_netns_prefix)]


def _finish(ranks, out=None, timeout=240):
    if out is not None:  # a ddp_cmd job: no sleep in its remaining steps
        let_finish(out)
    codes = [r.proc.wait(timeout) for r in ranks]
    assert codes == [0] * len(ranks), {r.rank: r.log.read_text(errors="replace")[-1500:] for r in ranks}


def _evacuate(cc, node):
    op = _wait_op(cc, cc.evacuate(node)["name"])
    assert op["metadata"]["result"] == "succeeded", (op.get("error") or {}).get("message", op)
    return op


def _cluster(cluster, spares):
    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        for name in ("host-a", "host-b", *[f"spare-{i + 1}" for i in range(spares)]):
            cluster.start_agent(name, spare=name.startswith("spare"))
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def test_gloo_job_survives_evacuating_a_host_then_the_store_host(cluster, tmp_path):
    cc = _cluster(cluster, spares=2)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(4)}
    ranks = cluster.start_job("train", ddp_cmd(out, steps=220), 4,
                              {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, addresses=addrs)
    job = _wait_jobs(cc, "train", 4)
    assert {w["address"] for w in job["workers"]} == set(addrs.values())
    wait_for_step(ranks[3].log, 20)
    t0 = time.time()
    op1 = _evacuate(cc, "host-b")            # ranks 2 and 3
    assert op1["metadata"]["destination"] == "spare-1"
    assert op1["metadata"]["keep_peers"] == sorted(a.split("/")[0] for a in addrs.values())
    wait_for_step(ranks[0].log, 120)
    t1 = time.time()
    op2 = _evacuate(cc, "host-a")            # rank 0 serves the TCPStore; rank 1
    assert op2["metadata"]["destination"] == "spare-2"
    _finish(ranks, out)
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=220))
    hosts = {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 0)["workers"]}
    assert hosts == {0: "spare-2", 1: "spare-2", 2: "spare-1", 3: "spare-1"}
    g1 = max(step_gaps(ranks[0].log, since=t0)[:60])
    g2 = max(step_gaps(ranks[2].log, since=t1))
    print(f"\npause seen by the job: evacuating host-b {g1:.2f} s (downtime "
          f"{op1['metadata']['downtime_s']:.2f} s); evacuating host-a (the store) {g2:.2f} s "
          f"(downtime {op2['metadata']['downtime_s']:.2f} s)")
    assert _netns_left(cluster) == [], "every worker's namespace goes with the worker"


def test_torchrun_tree_moves_whole_and_the_job_finishes(cluster, tmp_path):
    """Two hosts, each one `pitstop run -- torchrun` with 2 local ranks; torchrun's agent on
    host-a serves the store.  Evacuating host-b moves its torchrun tree (agent and both
    workers), then evacuating host-a moves the store's."""
    from pitstop.dev.devcluster import free_port

    cc = _cluster(cluster, spares=2)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    port = str(free_port())
    trun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--master-addr", addrs[0].split("/")[0], "--master-port", port, "--monitor-interval", "0.2"]
    script = ddp_cmd(out, steps=220)[1:]
    nodes = []  # one `pitstop run -- torchrun` per host, registered as ranks 0 and 1 of job "trun"
    for r, host in ((0, "host-a"), (1, "host-b")):
        logs = ["--log-dir", str(tmp_path / f"torchrun{r}")]  # else torchrun leaves a mkdtemp in $TMPDIR
        nodes += cluster.start_job("trun", [*trun, "--node-rank", str(r), *logs, *script], 2, {r: host},
                                   addresses=addrs)
    _wait_jobs(cc, "trun", 2, timeout=60)
    wait_for_step(nodes[0].log, 30)
    _evacuate(cc, "host-b")
    wait_for_step(nodes[0].log, 120)
    _evacuate(cc, "host-a")
    # At the old pace to the end: with let_finish, rank 0 once aborted as it exited, after its last
    # step ("terminate called without an active exception", SIGABRT), the job ending about a second
    # after its store's host was evacuated (1 of 7 runs, 2026-12-03; not yet understood).
    _finish(nodes)
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=220))
    assert _netns_left(cluster) == []


def test_unrelated_connection_is_reset_not_hung_and_the_worker_continues(cluster, tmp_path):
    import http.server
    import threading

    cc = _cluster(cluster, spares=1)
    seen: list[str] = []

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_GET(self):  # noqa: N802
            seen.append(f"{self.client_address[1]} {self.path}")
            body = f"ok {self.path.rsplit('/', 1)[1]}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer((cluster.net.gateway, 0), H)  # outside every host
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://{cluster.net.gateway}:{srv.server_address[1]}"
        ranks = cluster.start_job("web", [sys.executable, str(WORKLOADS / "keepalive_worker.py"), "--url", url,
                                          "--steps", "150"], 1, {0: "host-a"},
                                  addresses={0: cluster.worker_address(0)})
        _wait_jobs(cc, "web", 1)
        wait_for_step(ranks[0].log, 20)
        t0 = time.time()
        op = _evacuate(cc, "host-a")
        _finish(ranks, timeout=120)
    finally:
        srv.shutdown()
        srv.server_close()
    log = ranks[0].log.read_text()
    assert "reset at step" in log and "done connections=2" in log, log[-2000:]
    assert len({s.split()[0] for s in seen}) == 2  # the old connection, then exactly one new one
    gap = max(step_gaps(ranks[0].log, since=t0))
    assert gap < op["metadata"]["downtime_s"] + 5, "the reset must come at once, not after a timeout"
    assert _netns_left(cluster) == []
