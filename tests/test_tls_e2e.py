"""Mutual TLS between the services (pitstop pki): an evacuation works over it end to end, and
a peer without a certificate from the cluster's CA cannot even complete a request."""

from __future__ import annotations

import ssl

import httpx
import pytest

from pitstop import tls

from .helpers import assert_same_as_reference, ddp_cmd, reference_hashes, wait_for_step
from .test_coordinator_e2e import _cluster, _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_evacuation_over_mutual_tls_and_strangers_refused(cluster, tmp_path, monkeypatch):
    cluster.tls_dir = cluster.root / "pki"
    for k, v in cluster.tls_env("operator").items():  # this test process acts as an operator
        monkeypatch.setenv(k, v)
    cc = _cluster(cluster)
    assert cluster.coordinator_url.startswith("https://")
    assert all(a.url.startswith("https://") for a in cluster.agents.values())
    hosts = {h["name"]: h for h in cc.hosts()}
    assert hosts["host-b"]["url"].startswith("https://")  # agents advertise https to the coordinator
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=120), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 10)
    op = _wait_op(cc, cc.evacuate("host-b")["name"])
    assert op["metadata"]["result"] == "succeeded", op.get("error")
    assert [r.proc.wait(180) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=120))

    ca = str(cluster.tls_dir / "ca.pem")
    other = tmp_path / "other-ca"
    tls.init_ca(other)
    crt, key = tls.issue(other, "intruder", ["127.0.0.1"])
    no_cert = ssl.create_default_context(cafile=ca)
    wrong_ca = ssl.create_default_context(cafile=ca)
    wrong_ca.load_cert_chain(str(crt), str(key))
    auth = {"Authorization": f"Bearer {cluster.operator_token}"}
    for url in (cluster.coordinator_url + "/v1/hosts", cluster.agents["spare-1"].url + "/v1/workers"):
        with pytest.raises(httpx.HTTPError):          # plain HTTP to a TLS port
            httpx.get(url.replace("https://", "http://"), headers=auth, timeout=5)
        for ctx in (no_cert, wrong_ca):               # the right token but no certificate from our CA
            with pytest.raises((httpx.HTTPError, ssl.SSLError)):
                httpx.get(url, headers=auth, timeout=5, verify=ctx)
    good = httpx.get(cluster.coordinator_url + "/v1/hosts", headers=auth, timeout=5, verify=cluster._verify())
    assert good.status_code == 200
