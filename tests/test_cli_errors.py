"""What an operator sees when the CLI cannot do what was asked: one plain line saying what was
wrong and what to do, exit status 1 (2 for a malformed command line), nothing else started."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from pitstop.dev.devcluster import pitstop_cmd

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str, url: str | None = None, env_add: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_COORDINATOR"}
    if url is not None:
        env["PITSTOP_COORDINATOR"] = url
    env.update(env_add or {})
    return subprocess.run([*pitstop_cmd(), *args], env=env, capture_output=True, text=True, timeout=60)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@pytest.mark.parametrize("command", [["hosts"], ["jobs"], ["ops"], ["evacuate", "host-b"], ["cancel", "op-1"]])
def test_no_coordinator_says_how_to_give_one(command):
    p = _cli(*command)
    assert p.returncode == 1, p.stderr
    assert "no coordinator given" in p.stderr and "--coordinator" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("bad", ["10.0.0.5:7000", "ftp://10.0.0.5:7000", "http://"])
def test_a_url_without_its_scheme_is_refused_before_any_request(bad):
    p = _cli("evacuate", "host-b", "--coordinator", bad)
    assert p.returncode == 1
    assert f"coordinator URL {bad!r} is not http(s)://HOST:PORT" in p.stderr and "e.g. http://" in p.stderr


def test_the_option_wins_over_the_environment_and_an_unreachable_one_is_named():
    url = f"http://127.0.0.1:{_closed_port()}"
    p = _cli("ops", "--coordinator", url, url="http://192.0.2.1:9")  # the env's URL would time out
    assert p.returncode == 1
    assert f"cannot reach the coordinator at {url}" in p.stderr and "--coordinator" in p.stderr


def test_json_callers_get_the_error_as_json():
    p = _cli("hosts", "--json")
    assert p.returncode == 1
    assert json.loads(p.stdout)["error"]["code"] == "no_coordinator"


def test_a_negative_wait_is_a_usage_error():
    p = _cli("evacuate", "host-b", "--wait", "--timeout", "-1", "--coordinator", "http://127.0.0.1:1")
    assert p.returncode == 2 and "--timeout" in p.stderr


# -- pitstop run: nothing is started that its agent could not take in --------------------------

@pytest.mark.parametrize("agent, status, says", [
    ("bogus", 2, "is not http(s)://HOST:PORT or unix:/PATH"),
    ("unix:relative/agent.sock", 2, "unix:/ABSOLUTE/PATH"),
    ("ftp://127.0.0.1:7070", 2, "is not http(s)://HOST:PORT"),
    ("unreachable", 125, "cannot reach agent at"),
])
def test_run_refuses_before_starting_the_command(tmp_path, agent, status, says):
    if agent == "unreachable":
        agent = f"http://127.0.0.1:{_closed_port()}"
    marker = tmp_path / "started"
    p = _cli("run", "--job", "j", "--agent", agent, "--", "touch", str(marker))
    assert p.returncode == status, p.stderr
    assert says in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists(), "the command ran although pitstop could not take it in"


@pytest.mark.parametrize("args, env, says", [
    (["--job", "a b"], {}, "--job 'a b' is not a job name pitstop can use"),
    (["--job", ".hidden"], {}, "a letter or digit first"),
    (["--job", "j" * 129], {}, "at most 128 characters"),
    (["--job", "j"], {"SLURM_JOB_ID": "not-a-slurm-id"}, "$SLURM_JOB_ID: String should match pattern"),
    (["--job", "j"], {"WORLD_SIZE": "20000000", "RANK": "1"}, "the job's ranks ($WORLD_SIZE, $SLURM_NTASKS)"),
    (["--job", "j", "--address", "10.0.0.5"], {}, "--address: String should have at least 9 characters"),
])
def test_run_refuses_what_its_agent_would_refuse_before_starting_the_command(tmp_path, args, env, says):
    """Before: `pitstop run --job "a b"` started the command, which ran until the agent refused its
    registration.  Every value the agent checks is checked first (the agent here is never even
    asked: it does not exist, which would be exit 125)."""
    marker = tmp_path / "started"
    p = _cli("run", *args, "--agent", f"http://127.0.0.1:{_closed_port()}", "--", "touch", str(marker), env_add=env)
    assert p.returncode == 2, p.stderr
    said = " ".join(p.stderr.split())
    assert says in said and "the command was not started" in said and "Traceback" not in said, said
    assert not marker.exists(), "the command ran although its agent would refuse it"


@pytest.fixture
def agent_url(tmp_path_factory):
    """A real agent of its own (no cluster): enough for `pitstop run` to register with."""
    import shutil
    import signal
    import tempfile

    from pitstop.dev.devcluster import free_port, wait_http

    state = tempfile.mkdtemp(prefix="pitstop-cli-agent-", dir="/tmp")
    port = free_port()
    env = dict(os.environ, PITSTOP_AGENT_IMAGE_MOUNT="off")
    p = subprocess.Popen([*pitstop_cmd(), "agent", "--name", "cli", "--insecure", "--listen", f"127.0.0.1:{port}",
                          "--state-dir", state, "--image-dir", f"{state}/images"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=p)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
def test_a_command_that_ends_at_once_keeps_its_output_and_exit_status(agent_url):
    """Before: "the command did not start in its own PID namespace", exit 125, for any command
    done before the agent could register it."""
    for _ in range(5):  # whether it ends before or after its registration is a race: either is fine
        p = _cli("run", "--job", "j", "--agent", agent_url, "--", "sh", "-c", "echo done; exit 3")
        assert p.returncode == 3, p.stderr
        assert p.stdout == "done\n"
        assert p.stderr in ("", "pitstop run: sh ended before its agent could take it in (exit status 3); "
                                "nothing to move\n"), p.stderr


def test_the_worker_never_sees_pitstops_tokens_or_tls_key(agent_url, tmp_path, monkeypatch):
    """Before: with both tokens exported as the README shows, the worker printed both, and both
    were in its /proc/PID/environ and so in its image pages."""
    secrets = {"PITSTOP_CLUSTER_TOKEN": "cluster-secret-1", "PITSTOP_TOKEN": "operator-secret-2",
               "PITSTOP_READ_TOKEN": "read-secret-3", "PITSTOP_AGENT_CLUSTER_TOKEN": "cluster-secret-4",
               "PITSTOP_TLS_KEY": str(tmp_path / "host.key")}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("JOB_OWN_SETTING", "kept")
    p = _cli("run", "--job", "sec", "--agent", agent_url, "--", "sh", "-c",
             "env; tr '\\0' '\\n' < /proc/self/environ")
    assert p.returncode == 0, p.stderr
    assert "JOB_OWN_SETTING=kept" in p.stdout
    for k, v in secrets.items():
        assert k not in p.stdout and v not in p.stdout, f"{k} reached the worker"


# -- services: a malformed address or name stops them at start, named, with nothing created -----

@pytest.mark.parametrize("command, flag, value, var, says", [
    ("coordinator", "--listen", "bogus", "PITSTOP_COORDINATOR_LISTEN", "is not HOST:PORT"),
    # before: "coordinator up", listening nowhere
    ("coordinator", "--listen", "127.0.0.1:99999", "PITSTOP_COORDINATOR_LISTEN", "port 99999 is outside 1-65535"),
    ("coordinator", "--listen", "::1:7000", "PITSTOP_COORDINATOR_LISTEN", "goes in brackets"),
    ("agent", "--listen", "0.0.0.0:", "PITSTOP_AGENT_LISTEN", "is not HOST:PORT"),
    # before: an agent named '' kept its images in /dev/shm/pitstop itself
    ("agent", "--name", "", "PITSTOP_AGENT_NAME", "is not a host name"),
    ("agent", "--name", "../etc", "PITSTOP_AGENT_NAME", "is not a host name"),
    ("agent", "--coordinator", "coord:7000", "PITSTOP_AGENT_COORDINATOR", "is not http(s)://HOST:PORT"),
    ("agent", "--advertise-url", "http://gpu-17:70700", "PITSTOP_AGENT_ADVERTISE_URL", "outside 1-65535"),
])
def test_a_service_with_a_bad_address_or_name_does_not_start(tmp_path, command, flag, value, var, says):
    state = tmp_path / "state"
    state.mkdir()
    args = {"agent": ["--name", "x", "--listen", "127.0.0.1:7999", "--state-dir", str(state),
                      "--image-dir", str(state / "images")],
            "coordinator": ["--listen", "127.0.0.1:7999", "--db", str(state / "c.db")]}[command]
    i = args.index(flag) if flag in args else len(args)
    args = args[:i] + [flag, value] + args[i + 2:] if flag in args else args + [flag, value]
    p = subprocess.run([*pitstop_cmd(), command, "--insecure", *args], capture_output=True, text=True, timeout=60)
    out = " ".join(p.stderr.split())
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"bad setting: {var}='{value}'" in out and says in out, out
    assert not any(state.iterdir())  # nothing created


def test_pki_in_a_place_it_cannot_write_is_said_plainly():
    p = _cli("pki", "init", "/proc/pitstop-no-such-dir")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "cannot write in /proc/pitstop-no-such-dir" in " ".join(p.stderr.split())


def test_a_certificate_name_cannot_leave_the_ca_directory(tmp_path):
    ca = tmp_path / "ca"
    assert _cli("pki", "init", str(ca)).returncode == 0
    p = _cli("pki", "issue", str(ca), "../evil", "--role", "agent")
    assert p.returncode == 1 and "is not a host name" in p.stderr
    assert sorted(x.name for x in tmp_path.rglob("*")) == ["ca", "ca.key", "ca.pem"]


@pytest.mark.parametrize("command", ["agent", "coordinator"])
def test_a_port_in_use_stops_a_service_before_it_touches_anything(tmp_path, command):
    """Before: uvicorn's traceback, after the agent had created its directories (and mounted its
    image tmpfs)."""
    held = socket.create_server(("127.0.0.1", 0))
    port = held.getsockname()[1]
    state = tmp_path / "state"
    state.mkdir()
    args = {"agent": ["--name", "x", "--state-dir", str(state / "agent"), "--image-dir", str(state / "images")],
            "coordinator": ["--db", str(state / "db" / "c.db")]}[command]
    try:
        p = subprocess.run([*pitstop_cmd(), command, "--insecure", "--listen", f"127.0.0.1:{port}", *args],
                           capture_output=True, text=True, timeout=60)
    finally:
        held.close()
    out = " ".join(p.stderr.split())
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"cannot listen on 127.0.0.1:{port} (tcp)" in out and "Address already in use" in out, out
    assert f"ss -lnpt 'sport = :{port}'" in out
    assert not any(state.iterdir())


@pytest.mark.parametrize("command, args, says", [
    ("agent", ["--name", "x", "--state-dir", "/proc/pitstop-nope"], "cannot prepare the agent's directories"),
    ("coordinator", ["--db", "/proc/pitstop-nope/c.db"], "cannot open the database /proc/pitstop-nope/c.db"),
])
def test_an_unusable_state_directory_is_said_plainly(command, args, says):
    p = subprocess.run([*pitstop_cmd(), command, "--insecure", "--listen", f"127.0.0.1:{_closed_port()}", *args],
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PITSTOP_AGENT_IMAGE_MOUNT="off"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert says in " ".join(p.stderr.split())


@pytest.mark.parametrize("command, advice, not_advice", [
    ("kill", "`pitstop jobs` shows which ranks and where", "`pitstop kill"),
    ("stop", "`pitstop kill j` ends it", "after SIGKILL"),
])
def test_wait_that_runs_out_gives_advice_that_can_help(monkeypatch, command, advice, not_advice):
    """Before: `pitstop kill j --wait` that ran out advised `pitstop kill j`, the command just run.
    A coordinator whose job keeps reading running (the logic of the advice only: the client is a
    stand-in)."""
    from typer.testing import CliRunner

    from pitstop import cli

    class Client:
        def signal_job(self, job: str, sig: int) -> dict:
            return {"job": job, "signal": sig, "workers": [{"worker": "j.0", "host": "a", "delivered": True}]}

        def jobs(self) -> list[dict]:
            return [{"job": "j", "state": "running", "workers": []}]

    monkeypatch.setattr("pitstop.cli.operators.client", lambda *a, **kw: Client())
    r = CliRunner().invoke(cli.app, [command, "j", "--wait", "--timeout", "0"])
    said = " ".join(r.output.split())
    assert r.exit_code == 3, r.output
    assert advice in said and not_advice not in said, said
