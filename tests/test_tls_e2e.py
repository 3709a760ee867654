"""Mutual TLS between the services (pitstop pki): an evacuation works over it end to end, and
a peer without a certificate from the cluster's CA cannot even complete a request."""

from __future__ import annotations

import ssl

import httpx
import pytest

from pitstop import tls

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, wait_for_step
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
    let_finish(out)
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

    # Certificates are bound to roles: the right CA and the right token are not enough.
    def ctx(name):
        c = ssl.create_default_context(cafile=ca)
        c.load_cert_chain(str(cluster.tls_dir / f"{name}.pem"), str(cluster.tls_dir / f"{name}.key"))
        return c

    cluster_auth = {"Authorization": f"Bearer {cluster.token}"}
    r = httpx.get(cluster.agents["spare-1"].url + "/v1/workers", headers=cluster_auth, timeout=5,
                  verify=ctx("operator"))  # an operator's certificate cannot act as an agent
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_certificate_role"
    assert "--role coordinator" in r.json()["error"]["action"]
    # roles per route (the audit's L6): another agent's certificate reaches only what agents call on
    # each other (images, a replica, a moved rank's signal and output), not the coordinator's routes
    for method, path in (("POST", "/v1/jobs/train:fence"), ("POST", "/v1/jobs/train:stopWorkers"),
                         ("POST", "/v1/snapshots/train/1:restore"), ("GET", "/v1/workers")):
        r = httpx.request(method, cluster.agents["spare-1"].url + path, headers=cluster_auth, timeout=5,
                          json={"job": "train", "epoch": 1, "ids": ["train.1"]}, verify=ctx("host-a"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_certificate_role", (path, r.text)
    r = httpx.get(cluster.agents["spare-1"].url + "/v1/info", headers=cluster_auth, timeout=5, verify=ctx("host-a"))
    assert r.status_code == 200, r.text
    r = httpx.get(cluster.coordinator_url + "/v1/hosts", headers=auth, timeout=5,
                  verify=ctx("host-a"))  # a GPU host's certificate cannot operate the cluster
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_certificate_role"
    r = httpx.post(cluster.coordinator_url + "/v1/agents:beat", headers=cluster_auth, timeout=5,
                   json={"name": "host-a", "generation": "x-1"}, verify=ctx("operator"))
    assert r.status_code == 403  # nor beat for a host, fast path or not
    r = httpx.get(cluster.agents["spare-1"].url + "/v1/workers", headers=cluster_auth, timeout=5,
                  verify=ctx("coordinator"))
    assert r.status_code == 200


def test_certificates_are_issued_for_a_role(tmp_path):
    import subprocess

    from pitstop.dev.devcluster import pitstop_cmd

    subprocess.run([*pitstop_cmd(), "pki", "init", str(tmp_path / "ca")], check=True, capture_output=True)
    p = subprocess.run([*pitstop_cmd(), "pki", "issue", str(tmp_path / "ca"), "gpu-1"], capture_output=True, text=True)
    assert p.returncode == 2 and "--role" in p.stderr
    p = subprocess.run([*pitstop_cmd(), "pki", "issue", str(tmp_path / "ca"), "gpu-1", "--role", "admin"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "agent, coordinator, operator" in (p.stdout + p.stderr)
    assert not (tmp_path / "ca" / "gpu-1.pem").exists()
    p = subprocess.run([*pitstop_cmd(), "pki", "issue", str(tmp_path / "ca"), "gpu-1", "--role", "agent"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "ca" / "gpu-1.pem").read_bytes())
    assert "OU=pitstop-agent" in cert.subject.rfc4514_string()
