"""Day 2 for an operator: settings that hold, an address peers can dial, hosts that come back into
service (and only then), operations that say why and who, and metrics that can alert.

The unit tests drive the real `pitstop` command (typer's runner) with the services' start stubbed
out; the end-to-end test runs a coordinator, three agents and real jobs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from pitstop import cli
from pitstop.agent.server import check_advertised
from pitstop.agent.settings import AgentSettings
from pitstop.dev.devcluster import pitstop_cmd
from pitstop.errors import FailedPrecondition, PitstopError
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import WORKLOADS, until
from .test_coordinator_e2e import _cli, _wait_jobs, _wait_op

SLEEPER = [sys.executable, str(WORKLOADS / "sleeper.py"), "120"]
AGENT_ENV = {"PITSTOP_AGENT_NAME": "from-env", "PITSTOP_AGENT_LISTEN": "127.0.0.1:7123",
             "PITSTOP_AGENT_STATE_DIR": "/srv/pitstop-state", "PITSTOP_AGENT_IMAGE_DIR": "/run/pitstop/images/x",
             "PITSTOP_AGENT_ADVERTISE_URL": "http://gpu-9:7123", "PITSTOP_AGENT_SPARE": "true",
             "PITSTOP_AGENT_INSECURE": "true", "PITSTOP_AGENT_WORKER_LINK": "eth9"}
AGENT_FLAGS = {"name": ("--name", "from-flag"), "listen": ("--listen", "127.0.0.1:7456"),
               "state_dir": ("--state-dir", "/srv/flag-state"), "image_dir": ("--image-dir", "/run/pitstop/images/y"),
               "advertise_url": ("--advertise-url", "http://gpu-10:7456"), "spare": ("--active", None),
               "worker_link": ("--worker-link", "eth3")}


def _started(monkeypatch, module: str, args: list[str]):  # noqa: ANN202
    """Run `pitstop ARGS` with the service's serve() replaced: the settings it would have started with."""
    got = []
    monkeypatch.setattr(f"pitstop.{module}.server.serve", got.append)
    # the runner's stderr is closed after it returns: a logging set up on it would break every later
    # log line of this process (the suite's own teardowns log through the same structlog)
    monkeypatch.setattr("pitstop.logs.setup", lambda **kw: None)
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 0, r.output
    return got[0]


def test_the_environment_holds_where_no_flag_is_given_and_a_flag_wins_where_one_is(monkeypatch):
    """Before: the command line passed every flag's default, so PITSTOP_AGENT_SPARE=true left a host
    active, and the same for LISTEN, STATE_DIR and the coordinator's LISTEN and DB."""
    for k, v in AGENT_ENV.items():
        monkeypatch.setenv(k, v)
    s = _started(monkeypatch, "agent", ["agent"])
    assert (s.name, s.listen, str(s.state_dir), str(s.image_dir)) == \
        ("from-env", "127.0.0.1:7123", "/srv/pitstop-state", "/run/pitstop/images/x")
    assert (s.advertise_url, s.spare, s.insecure, s.worker_link) == ("http://gpu-9:7123", True, True, "eth9")
    flags = [x for flag, value in AGENT_FLAGS.values() for x in ((flag, value) if value else (flag,))]
    s = _started(monkeypatch, "agent", ["agent", *flags])
    assert (s.name, s.listen, str(s.state_dir), str(s.image_dir)) == \
        ("from-flag", "127.0.0.1:7456", "/srv/flag-state", "/run/pitstop/images/y")
    assert (s.advertise_url, s.spare, s.worker_link) == ("http://gpu-10:7456", False, "eth3")

    monkeypatch.setenv("PITSTOP_COORDINATOR_LISTEN", "127.0.0.1:7777")
    monkeypatch.setenv("PITSTOP_COORDINATOR_DB", "/srv/c.db")
    monkeypatch.setenv("PITSTOP_COORDINATOR_INSECURE", "true")
    c = _started(monkeypatch, "coordinator", ["coordinator"])
    assert (c.listen, str(c.db), c.insecure) == ("127.0.0.1:7777", "/srv/c.db", True)
    c = _started(monkeypatch, "coordinator", ["coordinator", "--listen", "127.0.0.1:7778", "--db", "/srv/d.db"])
    assert (c.listen, str(c.db)) == ("127.0.0.1:7778", "/srv/d.db")


def test_the_agents_own_coordinator_variable_wins_over_the_shared_one(monkeypatch):
    """Before: `pitstop agent` took PITSTOP_COORDINATOR as its --coordinator flag, which beat
    PITSTOP_AGENT_COORDINATOR: a host whose shell exported the operators' coordinator joined that one."""
    monkeypatch.setenv("PITSTOP_COORDINATOR", "http://operators:7000")
    monkeypatch.setenv("PITSTOP_AGENT_COORDINATOR", "http://agents:7000")
    assert _started(monkeypatch, "agent", ["agent"]).coordinator == "http://agents:7000"
    assert _started(monkeypatch, "agent", ["agent", "--coordinator", "http://flag:7000"]).coordinator == \
        "http://flag:7000"
    monkeypatch.delenv("PITSTOP_AGENT_COORDINATOR")
    assert _started(monkeypatch, "agent", ["agent"]).coordinator == "http://operators:7000"  # the shared one still serves


def test_an_agent_on_a_wildcard_address_needs_an_address_peers_can_dial():
    """Before: the shipped unit listened on 0.0.0.0:7070 and registered as http://0.0.0.0:7070."""
    for s in (AgentSettings(name="h", listen="0.0.0.0:7070"), AgentSettings(name="h", listen="[::]:7070"),
              AgentSettings(name="h", listen="127.0.0.1:7070", advertise_url="http://0.0.0.0:7070")):
        with pytest.raises(FailedPrecondition) as e:
            check_advertised(s)
        assert e.value.code == "wildcard_advertise_url" and "--advertise-url" in e.value.action
    check_advertised(AgentSettings(name="h", listen="0.0.0.0:7070", advertise_url="http://gpu-1:7070"))
    unit = (Path(__file__).resolve().parent.parent / "systemd" / "pitstop-agent.service").read_text()
    assert "PITSTOP_AGENT_ADVERTISE_URL=http://%H:7070" in unit and "example.invalid" not in unit


def test_version_and_exit_statuses_are_documented():
    r = CliRunner().invoke(cli.app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("pitstop ")
    r = CliRunner().invoke(cli.app, ["--help"])
    assert "3 still running" in " ".join(r.output.split())
    assert CliRunner().invoke(cli.app, ["evacuate"]).exit_code == 2  # usage


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_drained_host_is_no_destination_until_it_is_returned_to_service(cluster, tmp_path):
    """Before: right after b was evacuated (drained), `pitstop evacuate a --to b` moved a's worker onto
    b, the host the operator had just emptied."""
    cluster.start_coordinator(env={"PITSTOP_COORDINATOR_HEARTBEAT_TIMEOUT_S": "2"})
    with cluster.starting():
        a = cluster.start_agent("a")
        cluster.start_agent("b")
        cluster.start_agent("s", spare=True)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    cluster.start_job("ja", SLEEPER, 1, {0: "a"})
    cluster.start_job("jb", SLEEPER, 1, {0: "b"})
    _wait_jobs(cc, "ja", 1)
    _wait_jobs(cc, "jb", 1)

    p = _cli(cluster, "evacuate", "b", "--wait", "--reason", "disk replacement")
    assert p.returncode == 0, p.stdout + p.stderr
    op = cc.ops(node="b")[-1]
    assert op["metadata"]["reason"] == "disk replacement"
    assert "operator token" in op["metadata"]["requested_by"]
    hs = {h["name"]: h for h in cc.hosts()}
    assert hs["b"]["role"] == "drained"
    # why and since when it is out of service, and what runs where: its evacuation's reason and operation
    assert hs["b"]["role_why"]["reason"] == "disk replacement" and hs["b"]["role_why"]["operation"] == op["name"]
    assert "operator token" in hs["b"]["role_why"]["requested_by"]
    assert op["metadata"]["create_time"] <= hs["b"]["role_since"] <= time.time()
    assert (hs["b"]["live_workers"], hs["a"]["live_workers"], hs["s"]["live_workers"]) == (0, 1, 1)
    assert hs["s"]["role"] == "active" and hs["s"]["role_why"]["reason"] == "took b's workers"
    p = subprocess.run([*pitstop_cmd(), "hosts"], env={**cluster.env(), "COLUMNS": "250"}, capture_output=True,
                       text=True, timeout=60)
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("│ b "))
    assert re.search(r"│ b +│ drained for [0-9.]+s: disk replacement \(%s\) +│ 0 +│" % op["name"], row), p.stdout

    for dry in (True, False):  # refused before anything pauses, with the way back named
        with pytest.raises(PitstopError) as e:
            cc.evacuate("a", to="b", validate_only=dry)
        assert e.value.code == "no_compatible_spare" and "drained" in e.value.message
        assert "pitstop hosts uncordon b" in e.value.action
    assert len(cc.ops()) == 1

    with pytest.raises(PitstopError) as e:  # in service, with workers: not a spare
        cc.set_role("a", "spare")
    assert e.value.code == "host_runs_workers"
    p = _cli(cluster, "hosts", "uncordon", "b")
    assert p.returncode == 0 and "b is active" in p.stdout, p.stdout + p.stderr
    assert cc.evacuate("a", to="b", validate_only=True)["destination"] == "b"

    # operations: filtered and paged
    assert [o["metadata"]["node"] for o in cc.ops(node="b")] == ["b"]
    assert cc.ops(node="a") == [] and cc.ops(done=False) == [] and len(cc.ops(done=True, limit=1)) == 1

    # a host that is gone is forgotten, and only then
    with pytest.raises(PitstopError) as e:
        cc.remove_host("b")
    assert e.value.code == "host_alive"
    cluster.stop_agent("b")
    until(lambda: next(h for h in cc.hosts() if h["name"] == "b")["age_s"] > 2.5, timeout=30)
    assert cc.remove_host("b") == {"name": "b", "removed": True}
    assert "b" not in {h["name"] for h in cc.hosts()}

    # --wait that runs out: exit 3, the operation goes on
    p = _cli(cluster, "evacuate", "a", "--to", "s", "--wait", "--timeout", "0")
    assert p.returncode == 3, p.stdout + p.stderr
    _wait_op(cc, cc.ops(node="a")[-1]["name"])

    m = httpx.get(cluster.coordinator_url + "/metrics", timeout=10).text
    assert 'pitstop_coordinator_hosts{role="spare"} 0.0' in m, "the spare was consumed: its gauge must say 0"
    assert "pitstop_coordinator_evacuation_downtime_seconds_count 2.0" in m
    assert "pitstop_coordinator_operations_in_flight 0.0" in m and "pitstop_build_info{" in m
    am = httpx.get(a.url + "/metrics", headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10).text
    assert "pitstop_build_info{" in am
    assert not any(x in am for x in ('phase="uffd_fill_bytes"', 'phase="gpu_rounds"', 'phase="uffd_fill_threads"'))


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_cordoned_spare_is_kept_out_of_the_pool_through_the_cli_and_moves_nothing(cluster):
    """`pitstop hosts cordon`: a spare with suspect hardware is never chosen (nor taken when named),
    its host's workers stay where they run, `pitstop hosts` and the metrics say so, and uncordon
    lets it back; no operation is created by any of it."""
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("a")
        cluster.start_agent("s", spare=True)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    cluster.start_job("ja", SLEEPER, 1, {0: "a"})
    _wait_jobs(cc, "ja", 1)

    p = _cli(cluster, "hosts", "cordon", "s", "--reason", "ECC errors, awaiting RMA")
    assert p.returncode == 0 and re.search(r"s is spare, cordoned for [0-9.]+s: ECC errors, awaiting RMA", p.stdout), \
        p.stdout + p.stderr
    h = {h["name"]: h for h in cc.hosts()}["s"]
    assert h["role"] == "spare" and "operator token" in h["cordoned"]["requested_by"]
    p = subprocess.run([*pitstop_cmd(), "hosts"], env={**cluster.env(), "COLUMNS": "250"}, capture_output=True,
                       text=True, timeout=60)  # wide enough for the table not to wrap
    assert re.search(r"spare, cordoned for [0-9.]+s: ECC errors, awaiting RMA", p.stdout), p.stdout
    for to in (None, "s"):
        with pytest.raises(PitstopError) as e:
            cc.evacuate("a", to=to, validate_only=True)
        assert e.value.code == "no_compatible_spare" and "cordoned (ECC errors, awaiting RMA)" in e.value.message
        assert "pitstop hosts uncordon s" in e.value.action
    m = httpx.get(cluster.coordinator_url + "/metrics", timeout=10).text
    assert 'pitstop_coordinator_hosts_cordoned{role="spare"} 1.0' in m
    assert 'pitstop_coordinator_hosts{role="spare"} 1.0' in m

    p = _cli(cluster, "hosts", "cordon", "a", "--json")  # a host that runs a job: nothing moves
    assert p.returncode == 0 and json.loads(p.stdout)["cordoned"]["reason"] == "operator request", p.stdout
    assert [(w["host"], w["state"]) for j in cc.jobs() for w in j["workers"]] == [("a", "running")]
    p = _cli(cluster, "hosts", "uncordon", "s")
    assert p.returncode == 0 and "s is spare" in p.stdout and "cordoned" not in p.stdout, p.stdout + p.stderr
    assert cc.evacuate("a", validate_only=True)["destination"] == "s"  # a cordoned source may still leave
    assert cc.ops() == []
