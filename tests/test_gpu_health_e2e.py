"""GPU health end to end: NVML readings in heartbeats, the coordinator's policy, and the
evacuation it starts by itself.  Real agents, coordinator, CRIU and torch; only NVML is a
stand-in (tests/fakes/pynvml.py), since CI has no GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from .test_coordinator_e2e import _cli, _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
FAKES = Path(__file__).parent / "fakes"


def _gpu_file(path: Path, model: str, uuid: str, **readings) -> Path:
    path.write_text(json.dumps({"driver": "580.65", "gpus": [
        {"name": model, "uuid": uuid, "memory_total": 150 * 10**9, "memory_used": 10**9, "temperature_c": 45,
         **readings}]}))
    return path


def _agent(cluster, name, nvml: Path, spare=False):
    env = {"PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]), "FAKE_NVML_FILE": str(nvml)}
    return cluster.start_agent(name, spare=spare, env=env)


def _host(cc, name):
    return {h["name"]: h for h in cc.hosts()}[name]


def test_degraded_gpu_host_is_evacuated_by_the_coordinator_itself(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # the human table, unwrapped
    cluster.start_coordinator(env={"PITSTOP_COORDINATOR_HEALTH_RETRY_S": "1"})
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    h200 = "NVIDIA H200"
    _agent(cluster, "host-a", _gpu_file(tmp_path / "a.json", h200, "GPU-0000000a-0000-0000-0000-000000000000"))
    b = _gpu_file(tmp_path / "b.json", h200, "GPU-0000000b-0000-0000-0000-000000000000")
    _agent(cluster, "host-b", b)
    _agent(cluster, "spare-1", _gpu_file(tmp_path / "s1.json", "NVIDIA A100-SXM4-80GB",
                                         "GPU-00000051-0000-0000-0000-000000000000"), spare=True)
    out = tmp_path / "out"
    ranks = cluster.start_job("train", ddp_cmd(out, steps=150), 2, {0: "host-a", 1: "host-b"})
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 10)
    hb = until(lambda: _host(cc, "host-b").get("gpu_health") and _host(cc, "host-b"), what="GPU readings")
    assert hb["gpu_model"] == h200 and hb["gpu_count"] == 1 and hb["health"] == {"degraded": False, "reasons": []}
    assert hb["gpu_health"][0]["temperature_c"] == 45 and hb["gpu_health"][0]["ecc_uncorrected_volatile"] == 0
    p = _cli(cluster, "hosts")
    assert p.returncode == 0 and "1 x NVIDIA H200, 45 C max" in p.stdout

    # The GPU overheats.  The only spare has other GPUs: the coordinator must not move the job
    # there, must say why, and must leave it running where it is.
    _gpu_file(b, h200, "GPU-0000000b-0000-0000-0000-000000000000", temperature_c=95, throttle_mask=0x40)
    blocked = until(lambda: (_host(cc, "host-b").get("auto_evacuation") or {}).get("state") == "blocked"
                     and _host(cc, "host-b"), what="a blocked automatic evacuation")
    assert blocked["health"]["degraded"] is True
    assert blocked["health"]["reasons"] == ["GPU 0 temperature 95 C > 90 C", "GPU 0 throttled: hw_thermal_slowdown"]
    err = blocked["auto_evacuation"]["error"]
    assert err["code"] == "no_compatible_spare" and "A100" in err["message"] and err["action"]
    assert cc.ops() == []
    assert {w["host"] for w in _wait_jobs(cc, "train", 2)["workers"]} == {"host-a", "host-b"}
    p = _cli(cluster, "hosts")
    assert "degraded" in p.stdout and "auto-evacuation blocked" in p.stdout

    # A matching spare arrives: the next retry evacuates host-b to it, with the reason on record.
    _agent(cluster, "spare-2", _gpu_file(tmp_path / "s2.json", h200, "GPU-00000052-0000-0000-0000-000000000000"),
           spare=True)
    ops = until(lambda: cc.ops(), timeout=60, what="an automatic evacuation")
    assert len(ops) == 1
    op = _wait_op(cc, ops[0]["name"])
    md = op["metadata"]
    assert md["result"] == "succeeded", op
    assert md["node"] == "host-b" and md["destination"] == "spare-2"
    assert md["reason"].startswith("automatic: GPU health degraded: GPU 0 temperature 95 C > 90 C")
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=150))
    assert len(cc.ops()) == 1  # a degraded host with nothing left on it is not evacuated again
