"""Torch jobs across hosts with their own addresses (network namespaces on one bridge): each
worker has an address of its own that moves with it, so the TCPStore, gloo's connections
and everything else the program holds survive the move; unrelated connections are reset.
All real: agents, coordinator, CRIU, torch gloo, namespaces, macvlan, nftables."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pitstop.coordinator.client import CoordinatorClient
from pitstop.devcluster import step_gaps
from pitstop.netns import NetHosts

from .helpers import WORKLOADS, assert_same_as_reference, ddp_cmd, reference_hashes, wait_for_step
from .test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _netns_left() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith("pitstop-w-")]


def _finish(ranks, timeout=240):
    codes = [r.proc.wait(timeout) for r in ranks]
    assert codes == [0] * len(ranks), {r.rank: r.log.read_text(errors="replace")[-1500:] for r in ranks}


def _evacuate(cc, node):
    op = _wait_op(cc, cc.evacuate(node)["name"])
    assert op["metadata"]["result"] == "succeeded", op
    return op


def _cluster(cluster, spares):
    cluster.net = NetHosts()
    cluster.start_coordinator()
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
    _finish(ranks)
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=220))
    hosts = {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 0)["workers"]}
    assert hosts == {0: "spare-2", 1: "spare-2", 2: "spare-1", 3: "spare-1"}
    g1 = max(step_gaps(ranks[0].log, since=t0)[:60])
    g2 = max(step_gaps(ranks[2].log, since=t1))
    print(f"\npause seen by the job: evacuating host-b {g1:.2f} s (downtime "
          f"{op1['metadata']['downtime_s']:.2f} s); evacuating host-a (the store) {g2:.2f} s "
          f"(downtime {op2['metadata']['downtime_s']:.2f} s)")
    assert _netns_left() == [], "every worker's namespace goes with the worker"
