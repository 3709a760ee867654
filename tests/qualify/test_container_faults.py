"""The fault matrix's rows for ranks in containers (podman with runc; tests/test_container_e2e.py
has the hosts): a 2-rank gloo job, each rank a container on its own host, host-b evacuated by the
coordinator to spare-1 with a fault injected.  Invariants as for bare ranks: the job finishes
bitwise equal to an uninterrupted run, and where the move did not happen the container runs on its
source, listed there and nowhere else."""

from __future__ import annotations

import pytest

from pitstop.wire.coordinator_client import CoordinatorClient

from ..helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes
from ..test_container_e2e import Pods, pods  # noqa: F401 - the fixture
from ..test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
STEPS = 120


class ContainerWorld:
    def __init__(self, pods: Pods, tmp_path, faults: dict[str, str] | None = None) -> None:  # noqa: F811
        self.p, self.tmp = pods, tmp_path
        pods.c.start_coordinator()
        env = {n: {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": f} for n, f in (faults or {}).items()}
        pods.agents("host-a", "host-b", "spare-1", env=env)
        self.cc = CoordinatorClient(pods.c.coordinator_url, pods.c.operator_token)
        self.out = pods.jobdir / "out"
        cmd = ddp_cmd(self.out, steps=STEPS)
        pods.rank("host-a", "j-0", 0, 2, cmd)
        pods.rank("host-b", "j-1", 1, 2, cmd)
        _wait_jobs(self.cc, "j", 2)
        pods.wait_for_step("host-b", "j-1", 10)

    def evacuate(self) -> dict:
        return _wait_op(self.cc, self.cc.evacuate("host-b")["name"], timeout=240)

    def finished_intact(self, rank1_on: str) -> str:
        let_finish(self.out)
        for host, name in (("host-a", "j-0"), (rank1_on, "j-1")):
            code = self.p.hosts[host].wait(name, 240)
            assert code == 0, (host, name, code, self.p.hosts[host].logs(name)[-1500:])
        assert_same_as_reference(self.out, reference_hashes(self.tmp, 2, steps=STEPS))
        return f"job finished bitwise equal, container j-1 on {rank1_on}"


def _rolled_back(w: ContainerWorld, op: dict) -> str:
    assert op["metadata"]["result"] == "failed", op
    err = op["error"]
    assert err.get("message") and not (err["details"][0].get("metadata") or {}).get("rollback_problems"), err
    assert w.p.hosts["host-b"].names() == ["j-1"] and w.p.hosts["spare-1"].names() == [], \
        (w.p.hosts["host-b"].names(), w.p.hosts["spare-1"].names())
    assert w.p.hosts["host-b"].inspect("j-1")["State"]["Running"]
    return err["message"][:160]


def test_a_containerised_rank_evacuated(pods, tmp_path, record):  # noqa: F811
    w = ContainerWorld(pods, tmp_path)
    op = w.evacuate()
    assert op["metadata"]["result"] == "succeeded", op.get("error")
    assert w.p.hosts["spare-1"].names() == ["j-1"] and w.p.hosts["host-b"].names() == []
    record("containerised rank evacuated (no fault)", "moved; " + w.finished_intact("spare-1"),
           f"downtime {op['metadata'].get('downtime_s')} s")


def test_a_containerised_ranks_restore_fails_on_the_spare(pods, tmp_path, record):  # noqa: F811
    w = ContainerWorld(pods, tmp_path, faults={"spare-1": "restore:before_criu=fail"})
    msg = _rolled_back(w, w.evacuate())
    record("containerised rank: its restore fails on the spare",
           "rolled back: its container restored on its source by podman from its own images; "
           + w.finished_intact("host-b"), msg)


def test_a_containerised_ranks_transfer_is_cut(pods, tmp_path, record):  # noqa: F811
    w = ContainerWorld(pods, tmp_path, faults={"host-b": "transfer:cut_after=20000000"})
    msg = _rolled_back(w, w.evacuate())
    record("containerised rank: transfer cut after 20 MB", "rolled back (container restored on its source); "
           + w.finished_intact("host-b"), msg)


def test_a_spare_without_the_containers_image_is_refused(pods, tmp_path, record):  # noqa: F811
    pods.c.start_coordinator()
    pods.agents("host-b", "spare-1", without_image=("spare-1",))
    cc = CoordinatorClient(pods.c.coordinator_url, pods.c.operator_token)
    pods.rank("host-b", "j-0", 0, 1, ["sleep", "600"])
    _wait_jobs(cc, "j", 1)
    op = _wait_op(cc, cc.evacuate("host-b")["name"], timeout=120)
    err = op["error"]
    assert err["details"][0]["reason"] == "destination_lacks_files" and "image" in err["message"], err
    assert "Nothing was paused" in err["message"] and "pause" not in op["metadata"]["phases"], op["metadata"]
    assert pods.hosts["host-b"].inspect("j-0")["State"]["Running"] and pods.hosts["spare-1"].names() == []
    record("containerised rank: the spare lacks its image", "refused before anything paused; it runs on",
           op["error"]["message"][:200])
