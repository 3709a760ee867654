"""What an operator sees when the CLI cannot do what was asked: one plain line saying what was
wrong and what to do, exit status 1 (2 for a malformed command line), nothing else started."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from pitstop.devcluster import pitstop_cmd

pytestmark = pytest.mark.timeout(120)


def _cli(*args: str, url: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_COORDINATOR"}
    if url is not None:
        env["PITSTOP_COORDINATOR"] = url
    return subprocess.run([*pitstop_cmd(), *args], env=env, capture_output=True, text=True, timeout=60)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@pytest.mark.parametrize("command", [["hosts"], ["jobs"], ["ops"], ["evacuate", "host-b"]])
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


@pytest.fixture
def agent_url(tmp_path_factory):
    """A real agent of its own (no cluster): enough for `pitstop run` to register with."""
    import shutil
    import signal
    import tempfile

    from pitstop.devcluster import free_port, wait_http

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


def test_a_command_that_ends_at_once_keeps_its_output_and_exit_status(agent_url):
    """Before: "the command did not start in its own PID namespace", exit 125, for any command
    done before the agent could register it."""
    p = _cli("run", "--job", "j", "--agent", agent_url, "--", "sh", "-c", "echo done; exit 3")
    assert p.returncode == 3, p.stderr
    assert p.stdout == "done\n"
    assert "ended before its agent could take it in (exit status 3)" in p.stderr
