"""A local cluster of real pitstop processes, for the demo, the benches and the tests.

Every agent and the coordinator run as separate processes (the real `pitstop`
command), each with its own port, state directory and image directory; a
training job's ranks run through the real `pitstop run`.  `close()` stops all
of it and removes every directory it made, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import secrets
import shutil
import signal
import socket
import ssl  # noqa: F401 - type names in annotations
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pitstop.agent import imagefs
from pitstop.dev import devleases
from pitstop.dev.netns import NetHosts
from pitstop.network import workerns
from pitstop.proc import proctree
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.worker_report import WorkerReport

_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now that the kernel will not hand to anyone else before its user binds it.

    Why not bind(0): that port comes from the ephemeral range, the same range every outgoing
    connection's local port and every other bind(0) comes from.  Between choosing a port and the
    process binding it (an agent's imports, a second or more; agents start side by side) a
    heartbeat's connection or another agent's data port could take it, and the process then
    exits with "address in use".  Ports below the ephemeral range are only ever taken by name."""
    lo, hi = _ephemeral_range()
    below = (max(1024, lo - 16384), lo) if lo > 2048 else None
    above = (hi + 1, 65536) if hi < 65535 - 1024 else None
    spans = [devleases.in_share(*r) for r in (below, above) if r]  # this run's part of each
    rng = random.Random()  # its own: a test that seeds the global one must not replay our ports
    for _ in range(256 if spans else 0):
        port = rng.randrange(*rng.choice(spans))
        if port in _handed_out:
            continue
        with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT is passed over too
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # every port tried was busy (or no range outside): the old way
        s.bind((host, 0))
        return s.getsockname()[1]


def pitstop_cmd() -> list[str]:
    return [sys.executable, "-m", "pitstop.cli"]


def wait_for_step(log: Path, step: int, timeout_s: float = 120.0) -> None:
    """Wait until a workload's log shows `step N ` (the workloads print one such line per step)."""
    end = time.monotonic() + timeout_s
    pat = re.compile(rf"^step {step} ", re.M)
    while time.monotonic() < end:
        if log.exists() and pat.search(log.read_text(errors="replace")):
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise TimeoutError(f"step {step} never appeared in {log}:\n{tail}")


def step_times(log: Path) -> list[tuple[int, float]]:
    """(step, unix time) of every `step N t=T` line a workload printed."""
    return [(int(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"^step (\d+) t=([0-9.]+)", log.read_text(errors="replace"), re.M)]


def step_gaps(log: Path, since: float = 0.0) -> list[float]:
    """Seconds between consecutive steps (those ending after `since`): the pause as the job sees it."""
    ts = [t for _, t in step_times(log)]
    return [b - a for a, b in zip(ts, ts[1:]) if b >= since]


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None,
              verify: "ssl.SSLContext | bool" = True, log: Path | None = None) -> None:
    """log: the process's output, whose last lines a failure quotes (why it exited)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            tail = ""
            if log is not None and log.exists():
                tail = ":\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"process for {url} exited with {proc.returncode}{tail}")
        try:
            if httpx.get(url, timeout=1, verify=verify).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not come up within {timeout_s} s")


@dataclass
class AgentProc:
    name: str
    url: str
    proc: subprocess.Popen
    state_dir: Path
    image_dir: Path
    log: Path
    token: str | None

    def client(self, timeout: float = 60.0) -> AgentClient:
        return AgentClient(self.url, self.token, timeout=timeout)


@dataclass
class CoordinatorProc:
    """One coordinator of several on a shared database (LocalCluster.start_coordinators)."""

    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    db: str
    env: dict[str, str]
    extra: list[str]


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen
    log: Path
    agent: str


@dataclass
class LocalCluster:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pitstop-cluster-")))
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    operator_token: str = field(default_factory=lambda: secrets.token_hex(16))
    agents: dict[str, AgentProc] = field(default_factory=dict)
    ranks: list[Rank] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    coordinator_url: str | None = None
    coordinator_db: Path | None = None
    coordinator_proc: subprocess.Popen | None = None
    coordinators: list[CoordinatorProc] = field(default_factory=list)  # several on one database, one leading
    shm: Path = field(default_factory=lambda: Path(os.environ.get("PITSTOP_DEV_SHM", "/dev/shm")) / f"pitstop-{secrets.token_hex(4)}")
    net: NetHosts | None = None  # set: every agent is a host in its own network namespace
    tls_dir: Path | None = None  # set: mutual TLS from a CA made here, a certificate per process
    lease: str = field(default_factory=lambda: "cluster-" + secrets.token_hex(6))
    _deferred: list[AgentProc] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Remove what killed runs left (dev/devleases.py), then lease what this cluster will make."""
        for line in devleases.sweep():
            print(f"pitstop devcluster: {line}", file=sys.stderr, flush=True)
        devleases.take(self.lease, marker=self.lease, paths=[str(self.shm), str(self.root)],
                       netns_prefix=self.worker_netns_prefix)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            # SIGTERM (a CI timeout, `kill`) ends a run as Ctrl-C does, through its `with` blocks,
            # `finally`s and pytest's teardowns, which stop and remove what it started
            signal.signal(signal.SIGTERM, _interrupt_on_sigterm)

    def tls_env(self, name: str, sans: list[str] | None = None) -> dict[str, str]:
        """PITSTOP_TLS_* for one process (`name`: a host, "coordinator" or "operator")."""
        if self.tls_dir is None:
            return {}
        from pitstop import tls

        if not (self.tls_dir / "ca.pem").exists():
            tls.init_ca(self.tls_dir)
        crt, key = self.tls_dir / f"{name}.pem", self.tls_dir / f"{name}.key"
        if not crt.exists():
            role = name if name in ("coordinator", "operator") else "agent"
            crt, key = tls.issue(self.tls_dir, name, sans or ["127.0.0.1"], role=role)
        return {"PITSTOP_TLS_CA": str(self.tls_dir / "ca.pem"), "PITSTOP_TLS_CERT": str(crt),
                "PITSTOP_TLS_KEY": str(key)}

    def _verify(self) -> "ssl.SSLContext | bool":
        if self.tls_dir is None:
            return True
        import ssl as _ssl

        e = self.tls_env("operator")
        ctx = _ssl.create_default_context(cafile=e["PITSTOP_TLS_CA"])
        ctx.load_cert_chain(e["PITSTOP_TLS_CERT"], e["PITSTOP_TLS_KEY"])
        return ctx

    @property
    def scheme(self) -> str:
        return "https" if self.tls_dir else "http"

    @property
    def worker_netns_prefix(self) -> str:
        """Its workers' network namespaces are named under this (network/workerns.py): one
        machine may run several local clusters at once, whose jobs may have the same names."""
        return f"{workerns.NETNS_PREFIX}{self.lease.rsplit('-', 1)[-1]}-"

    def env(self) -> dict[str, str]:
        e = dict(os.environ, PITSTOP_CLUSTER_TOKEN=self.token, PITSTOP_TOKEN=self.operator_token,
                 PYTHONUNBUFFERED="1", PITSTOP_INIT_DIRS=str(self.root / "init"),
                 **{workerns.NETNS_PREFIX_ENV: self.worker_netns_prefix},
                 **{devleases.MARKER: self.lease}, **self.tls_env("operator"))
        if self.coordinator_url:
            e["PITSTOP_COORDINATOR"] = self.coordinator_url
        return e

    def start_coordinator(self, port: int | None = None, extra: list[str] | None = None,
                          env: dict[str, str] | None = None) -> str:
        port = port or free_port()
        host = "127.0.0.1"
        if self.net:
            self.net.setup()
            host = self.net.gateway  # reachable from every host namespace
        self.coordinator_db = self.coordinator_db or self.root / "coordinator.db"
        log_path = self.root / "coordinator.log"
        log = open(log_path, "ab")
        p = subprocess.Popen([*pitstop_cmd(), "coordinator", "--listen", f"{host}:{port}",
                              "--db", str(self.coordinator_db), *(extra or [])],
                             env={**self.env(), **self.tls_env("coordinator", [host, "127.0.0.1"]), **(env or {})},
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.coordinator_proc = p
        self.coordinator_url = f"{self.scheme}://{host}:{port}"
        wait_http(self.coordinator_url + "/healthz", proc=p, verify=self._verify(), log=log_path)
        return self.coordinator_url

    def start_coordinators(self, dbs: list[str], envs: list[dict[str, str]] | None = None,
                           extra: list[str] | None = None, at_once: bool = True) -> list[CoordinatorProc]:
        """One coordinator per entry of `dbs`, each on that database (a postgresql:// URL: the same
        one for all, or one each through a proxy a test can cut), with its own environment
        (`envs`, e.g. fault points).  at_once: all started side by side (one of them leads);
        else one after another, each up before the next starts (the first leads).  The agents, the
        CLI and the launchers started after this are given every coordinator's URL
        (comma-separated) and find the leader (coordinator/leadership.py)."""
        host = "127.0.0.1"
        if self.net:
            self.net.setup()
            host = self.net.gateway  # reachable from every host namespace
        ports = [free_port() for _ in dbs]
        self.coordinator_url = ",".join(f"{self.scheme}://{host}:{p}" for p in [*[c.port for c in self.coordinators],
                                                                                 *ports])
        envs = envs or [{} for _ in dbs]
        got = []
        for port, db, env in zip(ports, dbs, envs):
            c = self._spawn_coordinator(host, port, db, dict(env), list(extra or []))
            got.append(c)
            if not at_once:
                wait_http(c.url + "/healthz", proc=c.proc, verify=self._verify(), log=c.log)
        for c in got:
            wait_http(c.url + "/healthz", proc=c.proc, verify=self._verify(), log=c.log)
        self.coordinators += got
        return got

    def _spawn_coordinator(self, host: str, port: int, db: str, env: dict[str, str],
                           extra: list[str]) -> CoordinatorProc:
        log_path = self.root / f"coordinator-{port}.log"
        log = open(log_path, "ab")
        p = subprocess.Popen([*pitstop_cmd(), "coordinator", "--listen", f"{host}:{port}", "--db", db, *extra],
                             env={**self.env(), **self.tls_env("coordinator", [host, "127.0.0.1"]), **env},
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(p)
        return CoordinatorProc(f"{self.scheme}://{host}:{port}", port, p, log_path, db, env, extra)

    def restart_coordinator(self, c: CoordinatorProc, env: dict[str, str] | None = None,
                            db: str | None = None) -> CoordinatorProc:
        """Start a coordinator of start_coordinators again (after it was killed), on its port (its
        database and environment, unless given)."""
        host = c.url.rsplit(":", 1)[0].split("://", 1)[1]
        again = self._spawn_coordinator(host, c.port, db or c.db, c.env if env is None else env, c.extra)
        wait_http(again.url + "/healthz", proc=again.proc, verify=self._verify(), log=again.log)
        self.coordinators[self.coordinators.index(c)] = again
        return again

    def leader(self) -> CoordinatorProc | None:
        """The coordinator of start_coordinators that says it leads now (None: none does)."""
        for c in self.coordinators:
            if c.proc.poll() is not None:
                continue
            try:
                if httpx.get(c.url + "/v1/leader", timeout=2, verify=self._verify()).json().get("role") == "leader":
                    return c
            except (httpx.HTTPError, ValueError):
                continue
        return None

    def start_agent(self, name: str, spare: bool = False, port: int | None = None,
                    env: dict[str, str] | None = None, image_dir: Path | None = None,
                    wrap: list[str] | None = None) -> AgentProc:
        """wrap: a command the agent runs under (setpriv, to give it a unit's capability set)."""
        port = port or free_port()
        addr, prefix = "127.0.0.1", list(wrap or [])
        if self.net:
            _, addr = self.net.add(name)
            prefix = self.net.exec_prefix(name) + prefix
        state = self.root / name
        images = image_dir or self.shm / name
        state.mkdir(parents=True, exist_ok=True)
        log = state / "agent.log"
        cmd = [*prefix, *pitstop_cmd(), "agent", "--name", name, "--listen", f"{addr}:{port}",
               "--state-dir", str(state), "--image-dir", str(images)]
        if self.coordinator_url:
            cmd += ["--coordinator", self.coordinator_url]
        if spare:
            cmd.append("--spare")
        p = subprocess.Popen(cmd, env={**self.env(), **self.tls_env(name, [addr, "127.0.0.1"]), **(env or {})},
                             stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        a = AgentProc(name, f"{self.scheme}://{addr}:{port}", p, state, images, log, self.token)
        self.agents[name] = a
        if self._deferred is not None:
            self._deferred.append(a)
        else:
            self._wait_up(a)
        return a

    def _wait_up(self, a: AgentProc) -> None:
        wait_http(a.url + "/healthz", proc=a.proc, verify=self._verify(), log=a.log)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Agents started in this block start side by side: each is waited for when it ends.
        Why: an agent takes about 1.3 s to come up, nearly all of it Python's imports on one core;
        two or three of them one after another were a tenth of the test suite's time."""
        if self._deferred is not None:  # nested: the outer block waits
            yield
            return
        self._deferred = []
        try:
            yield
            for a in self._deferred:
                self._wait_up(a)
        finally:
            self._deferred = None

    def stop_agent(self, name: str, sig: int = signal.SIGTERM) -> None:
        a = self.agents[name]
        _stop(a.proc, sig)

    def kill_host(self, name: str, processes_first_s: float | None = None) -> list[str]:
        """Host `name` dies outright, as one that loses power: its agent, its workers and the launchers
        of ranks started there SIGKILLed, its link cut (`net.cut`), its workers' namespaces gone with
        it.  The ids of the workers it ran.

        processes_first_s: the order hosts often die in instead: the kernel (the OOM killer, a
        crashing driver) kills the workers' processes first, their peers elsewhere see their
        connections reset and the agent reports the ranks ended; this long after, the agent, the
        launchers and the link go."""
        a = self.agents[name]
        with AgentClient(a.url, self.token) as c:
            ws = [w for w in c.workers() if w.state in ("running", "paused")]
        if processes_first_s is not None:
            self._kill_sessions(ws)
            time.sleep(processes_first_s)
        if self.net:  # first: a host that loses power sends no reset for its connections
            self.net.cut(name)
        a.proc.kill()
        a.proc.wait(10)
        self._kill_sessions(ws)
        for r in self.ranks:
            if r.agent == name:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
        for w in ws:
            if w.net:
                subprocess.run(["ip", "netns", "delete", w.net["netns"]], capture_output=True, timeout=10)
        return [w.id for w in ws]

    @staticmethod
    def _kill_sessions(ws: list[WorkerReport]) -> None:
        """SIGKILL every process of the workers' sessions (a rank and its DataLoader workers)."""
        for w in ws:
            with contextlib.suppress(ProcessLookupError):
                sid = os.getsid(w.root_pid)
                subprocess.run(["pkill", "-KILL", "-s", str(sid)], capture_output=True, timeout=10)

    def worker_address(self, index: int) -> str:
        """An address for a worker of its own on the hosts' segment (`pitstop run --address`)."""
        assert self.net is not None, "worker addresses need hosts with their own network (net=NetHosts())"
        return f"10.213.{self.net.subnet}.{100 + index}/24"

    def start_job(self, job: str, script: list[str], world: int, placement: dict[int, str],
                  env: dict[str, str] | None = None, run_args: list[str] | None = None,
                  addresses: dict[int, str] | None = None) -> list[Rank]:
        """Start the ranks in `placement` (rank -> agent name) of `script` through `pitstop run`.

        addresses: rank -> its own address (A.B.C.D/P); rank 0's is then MASTER_ADDR."""
        master_port = free_port()
        master = addresses[0].split("/")[0] if addresses else "127.0.0.1"
        out = []
        for r in sorted(placement):
            a = self.agents[placement[r]]
            log = self.root / f"{job}.rank{r}.log"
            e = dict(self.env(), RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR=master,
                     MASTER_PORT=str(master_port), **(env or {}))
            prefix = self.net.exec_prefix(a.name) if self.net else []
            own = ["--address", addresses[r]] if addresses else []
            p = subprocess.Popen([*prefix, *pitstop_cmd(), "run", "--job", job, "--agent", a.url, *own,
                                  *(run_args or []), "--", *script],
                                 env=e, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
            rk = Rank(r, p, log, a.name)
            self.ranks.append(rk)
            out.append(rk)
        return out

    def wait_registered(self, agent: str, worker_id: str, timeout_s: float = 30.0) -> WorkerReport:
        c = self.agents[agent].client()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for w in c.workers():
                if w.id == worker_id and w.state == "running":
                    return w
            time.sleep(0.05)
        raise TimeoutError(f"{worker_id} did not register with {agent}")

    def close(self) -> None:
        _stop_all([rk.proc for rk in self.ranks], signal.SIGTERM, timeout=5)
        # Workers restored by an agent are its children: stopping the agent must not orphan them.
        for a in self.agents.values():
            _kill_restored(a)
        _stop_all([a.proc for a in self.agents.values()] + [p for p in [self.coordinator_proc] if p] + self.procs,
                  signal.SIGTERM)
        for a in self.agents.values():  # an agent stopped just as its worker ended had no time to drop its address
            _drop_worker_nets(a)
        if self.net:
            self.net.close()
        if self.shm.exists():
            imagefs.unmount_under(self.shm)  # an agent killed mid-way leaves its image mount
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
        devleases.drop(self.lease)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *a: object) -> None:
        self.close()


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _kill_restored(a: AgentProc) -> None:
    import json

    try:
        st = json.loads((a.state_dir / "agent-state.json").read_text())
    except (OSError, ValueError):
        return
    for w in st.get("workers", {}).values():
        if w.get("state") in ("running", "paused", "capturing", "stopped"):
            proctree.kill_if_same(w["root_pid"], w.get("start_time"))
        if k := w.get("keeper"):  # agent/exitkeeper.py: outlives the agent by design
            proctree.kill_if_same(k["pid"], k.get("start_time"))


def _drop_worker_nets(a: AgentProc) -> None:
    """Remove the network namespaces of the workers an agent's state names (its workers are gone by
    now).  An agent drops a worker's namespace when it sees the worker end, and a restarted agent
    drops those of workers that ended while it was away; a cluster closed in between must not leave
    them to the next test."""
    import json

    from pitstop.network import workerns

    try:
        st = json.loads((a.state_dir / "agent-state.json").read_text())
    except (OSError, ValueError):
        return
    for w in st.get("workers", {}).values():
        wn = workerns.from_dict(w.get("net"))
        if wn:
            workerns.destroy(wn)


def _stop_all(procs: list[subprocess.Popen], sig: int, timeout: float = 10.0) -> None:
    """Signal every process group first, then wait for each: their shutdowns overlap (an agent
    drains its deletions and unmounts its tmpfs; one after another that was a second per test)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                p.send_signal(sig)
    end = time.monotonic() + timeout
    for p in procs:
        _stop(p, sig, timeout=max(0.1, end - time.monotonic()), signalled=True)


def _stop(p: subprocess.Popen, sig: int, timeout: float = 10.0, signalled: bool = False) -> None:
    if p.poll() is not None:
        return
    if not signalled:  # a second SIGTERM would cut uvicorn's graceful shutdown short
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            p.send_signal(sig)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(5)
