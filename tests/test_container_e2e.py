"""Ranks in containers, end to end and real: podman (Debian's) with runc, an image built from this
host's own files (scripts/build-test-image.sh), two hosts with a podman each, the agents, CRIU,
and a torch gloo DDP job whose ranks run as `podman run ... IMAGE pitstop run -- python train.py`.

Invariants: a moved rank's job ends with final parameters bitwise those of an uninterrupted run;
afterwards the spare's podman lists the container (its log there has the whole run, it can be
stopped there) and the source's lists none; what cannot move is refused before anything pauses,
each lack named."""

from __future__ import annotations

import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.dev.containers import PodmanHost, image_store, image_tarball, podman_missing
from pitstop.dev.devcluster import free_port
from pitstop.errors import PitstopError
from pitstop.migration.move import move_worker
from pitstop.wire.worker_report import WorkerReport

from .helpers import WORKLOADS, assert_same_as_reference, ddp_cmd, let_finish, reference_hashes

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
STEPS = 80


class Pods:
    """Hosts of a local cluster, each with a podman of its own (pitstop/dev/containers.py)."""

    def __init__(self, cluster, tmp_path) -> None:
        self.c, self.tmp = cluster, tmp_path
        self.store, self.image = image_store(image_tarball())
        self.hosts: dict[str, PodmanHost] = {}
        self.socks: dict[str, Path] = {}
        self.jobdir = tmp_path / "job"  # what the ranks write: mounted into their containers
        self.jobdir.mkdir()
        self.port = free_port()

    def agents(self, *names: str, without_image: tuple[str, ...] = (), env: dict[str, dict] | None = None) -> dict:
        with self.c.starting():
            for n in names:
                self.hosts[n] = PodmanHost(n, self.c.root / f"podman-{n}",
                                           None if n in without_image else self.store)
                self.socks[n] = self.c.root / f"sock-{n}"  # what its containers mount as /run/pitstop
                self.socks[n].mkdir()
                self.c.start_agent(n, spare=n.startswith("spare"),
                                   env={**self.hosts[n].env, "PITSTOP_AGENT_SOCKET_PATH": str(self.socks[n] / "agent.sock"),
                                        **((env or {}).get(n, {}))})
        return {n: self.c.agents[n] for n in names}

    def rank(self, host: str, name: str, rank: int, world: int, cmd: list[str], **kw) -> str:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}
        return self.hosts[host].run_rank(name, self.image, "j", rank, world, self.socks[host], cmd, env,
                                         mounts=[(str(self.jobdir), str(self.jobdir)), *kw.pop("mounts", [])], **kw)

    def wait_registered(self, host: str, wid: str, timeout_s: float = 90.0) -> WorkerReport:
        try:
            return self.c.wait_registered(host, wid, timeout_s=timeout_s)
        except TimeoutError:
            names = self.hosts[host].names()
            raise AssertionError(f"{wid} never registered with {host}; containers {names}: "
                                 + " || ".join(self.hosts[host].logs(n)[-800:] for n in names)) from None

    def wait_for_step(self, host: str, name: str, step: int, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if re.search(rf"^step {step} ", self.hosts[host].logs(name), re.M):
                return
            time.sleep(0.5)
        raise AssertionError(f"step {step} never appeared in {name}'s log on {host}: {self.hosts[host].logs(name)[-1500:]}")

    def log_with(self, host: str, name: str, text: str, timeout_s: float = 30.0) -> str:
        """The container's log once it holds `text` (conmon may still be writing its last lines
        as the container is reported exited)."""
        end = time.monotonic() + timeout_s
        while True:
            log = self.hosts[host].logs(name)
            if text in log or time.monotonic() > end:
                assert text in log, f"{text!r} not in {name}'s log on {host}: {log[-1500:]}"
                return log
            time.sleep(0.3)

    def close(self) -> None:
        for h in self.hosts.values():
            h.close()


def _provision() -> None:
    """podman and runc, installed where missing by scripts/provision-podman.sh (as tests/postgres.py
    provisions PostgreSQL); skipped saying why only where they cannot be installed, never in CI."""
    if podman_missing() is None:
        return
    p = subprocess.run([str(ROOT / "scripts" / "provision-podman.sh")], capture_output=True, text=True, timeout=900)
    why = podman_missing()
    if why is None:
        return
    said = (p.stderr or p.stdout).strip().splitlines()[-1:] or [why]
    if os.environ.get("CI"):
        raise RuntimeError(f"scripts/provision-podman.sh failed: {said[0]}")
    pytest.skip(f"podman cannot be installed here ({said[0]})")


@pytest.fixture
def pods(cluster, tmp_path):
    _provision()
    p = Pods(cluster, tmp_path)
    try:
        yield p
    finally:
        p.close()


def _job(pods, steps=STEPS):
    out = pods.jobdir / "out"
    cmd = ddp_cmd(out, steps=steps)
    for r in (0, 1):
        pods.rank("a", f"j-{r}", r, 2, cmd)
    ws = [pods.wait_registered("a", f"j.{r}") for r in (0, 1)]
    return out, ws


def test_a_rank_in_a_container_moves_mid_training_bitwise_equal(pods, tmp_path):
    a, b = pods.agents("a", "b").values()
    out, ws = _job(pods)
    # The worker is the container: its root is the container's init, its record names it.
    for r, w in enumerate(ws):
        assert w.container["name"] == f"j-{r}" and w.container["runtime"] == "runc", w.container
        assert w.container["unmovable"] is None
        assert w.root_pid == pods.hosts["a"].inspect(f"j-{r}")["State"]["Pid"]
    pods.wait_for_step("a", "j-1", 10)
    rep = move_worker(a.client(), b.client(), "j.1", dest_name="b", peers=[(a.client(), "j.0")])
    assert rep.bytes > 10_000_000 and rep.restored_pid
    # The spare's runtime knows the container, the source's has none.
    assert pods.hosts["b"].names() == ["j-1"] and pods.hosts["a"].names() == ["j-0"]
    assert rep.restored_pid == pods.hosts["b"].inspect("j-1")["State"]["Pid"]
    moved = b.client().worker("j.1")
    assert moved.state == "running" and moved.container["name"] == "j-1"
    assert a.client().worker("j.1").state == "moved"
    let_finish(out)
    assert pods.hosts["a"].wait("j-0") == 0, pods.hosts["a"].logs("j-0")[-1500:]
    assert pods.hosts["b"].wait("j-1") == 0, pods.hosts["b"].logs("j-1")[-1500:]
    log = pods.log_with("b", "j-1", f"done rank=1 steps={STEPS}")  # read where it ran last: the whole run
    assert re.search(r"^step 1 ", log, re.M), log[:1500]
    assert "pitstop run: warning" not in log, log[:1500]  # io_uring: refused already by podman's profile
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))
    w = b.client().worker("j.1")
    assert w.state == "exited" and w.exit_code == 0, w
    assert not any(a.image_dir.iterdir()) and not any(b.image_dir.iterdir())


def test_a_moved_container_is_its_runtimes_on_the_spare_and_stops_there(pods):
    a, b = pods.agents("a", "b").values()
    pods.rank("a", "s-0", 0, 1, [sys.executable, str(WORKLOADS / "sleeper.py"), "600"])
    pods.wait_registered("a", "j.0")
    time.sleep(1)
    move_worker(a.client(), b.client(), "j.0", dest_name="b")
    assert pods.hosts["a"].names() == [] and pods.hosts["b"].names() == ["s-0"]
    before = pods.hosts["b"].logs("s-0").count("tick ")
    time.sleep(1.5)
    assert pods.hosts["b"].logs("s-0").count("tick ") > before  # it runs there
    pods.hosts["b"].podman("stop", "--time", "10", "s-0")
    code = pods.hosts["b"].wait("s-0", 30)
    assert code == 128 + signal.SIGTERM, code  # the sleeper ends of the SIGTERM its launcher passed on
    end = time.monotonic() + 10
    while b.client().worker("j.0").state == "running" and time.monotonic() < end:
        time.sleep(0.2)
    w = b.client().worker("j.0")
    assert w.state == "exited" and w.exit_code == 128 + signal.SIGTERM, w


def test_what_the_spare_lacks_is_refused_before_anything_pauses(pods, tmp_path):
    a, spare = pods.agents("a", "spare-1", without_image=("spare-1",)).values()
    data = tmp_path / "data"  # a bind mount whose source will be gone from "every" host
    data.mkdir()
    # a device the container is given and the spare lacks: podman names a device by the /dev path of
    # its numbers, so it is made under /dev (numbers no driver has) for the container, and removed
    node = Path(f"/dev/pitstop-test-{secrets.token_hex(4)}")
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 250))
    try:
        pods.rank("a", "s-0", 0, 1, [sys.executable, str(WORKLOADS / "sleeper.py"), "600"],
                  mounts=[(str(data), "/data")], podman_args=["--device", f"{node}:/dev/extra"])
        w = pods.wait_registered("a", "j.0")
    finally:
        node.unlink()
    assert str(node) in w.container["devices"], w.container
    data.rmdir()
    with pytest.raises(PitstopError) as e:
        move_worker(a.client(), spare.client(), "j.0", dest_name="spare-1")
    msg = e.value.message
    assert e.value.code == "destination_lacks_files", e.value.to_dict()
    assert "Nothing was paused" in msg and f"image {pods.image}" in msg, msg
    assert str(data) in msg and "/data" in msg and str(node) in msg, msg
    lacking = e.value.details["lacking"]["j.0"]
    assert {x["path"] for x in lacking} >= {str(data), str(node)}
    assert all(x["why"] for x in lacking)
    # nothing moved or stopped: the container runs on where it was
    assert a.client().worker("j.0").state == "running"
    assert pods.hosts["a"].inspect("s-0")["State"]["Running"] and pods.hosts["spare-1"].names() == []
