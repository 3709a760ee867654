"""`pitstop run -- CMD`: the zero-code launcher.

It starts CMD so that CRIU can capture it later and keeps behaving like CMD
for whoever waits on it (a scheduler, a script), even after CMD has moved to
another host:

- CMD runs in a PID namespace and session of its own, under pitstop's init
  (`pitstop-init --pid-namespace DIR -- CMD`, native/pitinit.c, which makes the
  namespace and waits outside it as `unshare --pid --fork setsid` would, minus the
  error unshare prints when a move kills the tree):
  restore then needs no free PIDs on the destination, and CRIU accepts the tree
  as a whole.  The init works in DIR, a directory of its own (nsinit.py), so that
  dumps of ranks sharing a working directory need not take turns; CMD keeps the
  directory it was started in.  Without the init built, CMD is the namespace's
  init itself (`unshare --pid --fork setsid CMD`), as before it existed.  Not --kill-child: that sets
  PR_SET_PDEATHSIG, which CRIU restores faithfully, and the restored worker
  would be killed the moment CRIU (its parent during restore) exits.
- stdin is /dev/null; stdout and stderr are pipes this launcher drains, one pipe for both
  where the launcher's own are one stream (`2>&1`: launcher/stdio.py).  CRIU
  hands pipes at the tree's edge back on restore (inherit-fd), where the
  destination agent drains them; this launcher then follows the output through
  its own agent, which forwards to wherever the worker runs.
- The environment is made dumpable: USE_LIBUV=0 keeps torch's TCPStore off
  libuv, and a seccomp rule makes io_uring_setup(2) fail with ENOSYS for the
  whole tree (torchrun's store ignores USE_LIBUV), since CRIU cannot dump io_uring.
- Signals are forwarded, through the init, which passes them on to CMD: they do
  what they would do outside a namespace.  Without the init, CMD is PID 1 of its
  namespace and the kernel drops signals it has no handler for, so a forwarded
  SIGTERM/SIGINT/SIGHUP that CMD does not handle is turned into SIGKILL.
- The NCCL shim is preloaded (when built): communicators get virtual handles and
  the job can be brought to a consistent cut and rewired (shim/).  --host-nccl makes
  the host NCCL (native/) the process's libnccl.so.2, for CPU jobs and tests.
- The worker keeps the host's mount namespace, so its /proc is the parent pid
  namespace's: native/procself.c (preloaded) rewrites the /proc paths a program
  builds from its own pid or tid (CUDA's cuInit needs /proc/self/task/<tid>).
- Exit status: CMD's, also when CMD finished on another host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pitstop import nsinit
from pitstop.endpoints import check_url
from pitstop.errors import InvalidRequest, NotFound, PitstopError
from pitstop.launcher import environment, incontainer, stdio
from pitstop.launcher.timeouts import (
    AGENT_ANSWER_AFTER_END_S,
    AGENT_GONE_S,
    AGENT_INFO_TIMEOUT_S,
    ENDED_AT_ONCE_WAIT_S,
    HANDLE_TIMEOUT_S,
    NS_INIT_FIND_S,
    PUMP_DRAIN_S,
    SIGNAL_MOVING_FOR_S,
)
from pitstop.proc import caps, proctree, signals
from pitstop.undo import Undo
from pitstop.wire.agent_client import AgentClient, health
from pitstop.wire.agent_requests import (
    JOB_NAME_MAX,
    JOB_PATTERN,
    MAX_SNAPSHOT_EVERY_S,
    MIN_SNAPSHOT_EVERY_S,
    NetworkRequest,
    RegisterRequest,
    body,
)
from pitstop.wire.coordinator_client import HandleClient
from pitstop.wire.worker_report import WorkerReport

MOVING = ("capturing", "stopped", "released", "moved")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def agent_client(agent_url: str) -> AgentClient:
    """Prefer the agent's Unix socket (no token needed locally); else TCP with the cluster token."""
    token = os.environ.get("PITSTOP_CLUSTER_TOKEN")
    if agent_url.startswith("unix:"):
        return AgentClient("http://agent", uds=agent_url[len("unix:"):])
    sock = (health(agent_url, AGENT_INFO_TIMEOUT_S) or {}).get("socket")
    if isinstance(sock, str) and sock and os.access(sock, os.W_OK):
        return AgentClient("http://agent", uds=sock)
    return AgentClient(agent_url, token)


class EndedAtOnce(Exception):
    """The command ended before it could be registered (a command that has nothing to do)."""


def _find_ns_init(p: subprocess.Popen, timeout_s: float = NS_INIT_FIND_S, forks: bool = True) -> int:
    """The namespace's init, once it leads its session (CRIU needs the tree's root to) and, where it
    is pitstop's init (`forks`), has forked the command: it moves into its directory before that
    fork (native/pitinit.c), and the agent records that directory at the registration.  Found at
    its setsid alone, on a busy machine it had not moved in yet: the rank's snapshots named no init
    directory, and its restore on a spare failed with CRIU's "Can't open cwd".  Without pitstop's
    init the command itself is the init, and need fork nothing."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        kids = proctree.children(p.pid)
        if kids and proctree.session_id(kids[0]) == kids[0] and (not forks or proctree.children(kids[0])):
            return kids[0]
        if p.poll() is not None:
            raise EndedAtOnce()
        time.sleep(0.005)
    raise PitstopError("the command did not start in its own PID namespace",
                       action="check that `unshare --pid --fork` works here (pitstop doctor)")


def bad_agent_url(agent_url: str) -> str | None:
    """What is wrong with an --agent value, before anything is started (None: nothing)."""
    if agent_url.startswith("unix:"):
        return None if agent_url[len("unix:"):].startswith("/") else \
            f"--agent {agent_url!r}: a local socket is given as unix:/ABSOLUTE/PATH"
    try:
        check_url(agent_url)
    except ValueError:
        return f"--agent {agent_url!r} is not http(s)://HOST:PORT or unix:/PATH (e.g. http://127.0.0.1:7070)"
    return None


def _pump(fd: int, out) -> None:  # noqa: ANN001
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        out.buffer.write(data)
        out.flush()
    os.close(fd)


class _Exit(Exception):
    """The launch ends here: what to print (after "pitstop run: "), and the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass
class _Started:
    """The command, started under its namespace's init, and what this launcher holds of it."""

    p: subprocess.Popen
    pumps: list[threading.Thread]
    init_dir: Path | None
    undo: Undo  # what its start left behind (its init's directory, its address), undone if it fails


def run(cmd: list[str], *, job: str, agent_url: str, rank: int | None = None,
        extra_env: dict[str, str] | None = None, shim: bool = True, host_nccl: bool = False,
        address: str | None = None, snapshot_every_s: float | None = None) -> int:
    """Start `cmd` as rank `rank` of `job`, registered with the agent at `agent_url`; its exit
    status, wherever it ran last.  Each stage refuses before the command starts what it already
    knows cannot work, and what a failed start left behind is undone (one undo stack)."""
    try:
        rank, world = _checked(cmd, job, rank, address, snapshot_every_s)
        try:
            env = environment.for_worker(extra_env, shim=shim, host_nccl=host_nccl)
        except PitstopError as e:
            raise _Exit(str(e), 125) from None
        client, info = _agent(agent_url)
        if incontainer.inside(info):  # the container is the worker (launcher/incontainer.py)
            client.close()
            if client.uds is None or address:
                raise _Exit("in a container, give --agent unix:/PATH, the agent's socket mounted into the "
                            "container (its network is the container runtime's: no --address)", 2)
            return incontainer.run(cmd, env, job=job, rank=rank, world=world, sock=client.uds,
                                   snapshot_every_s=snapshot_every_s)
        started = _start(cmd, env, client, job, rank, address)
        w, root = _register(started, cmd, client, job, rank, world, address, snapshot_every_s)
    except _Exit as e:
        print(f"pitstop run: {e.message}", file=sys.stderr)
        return e.code
    return _supervise(started, client, w, root)


def _checked(cmd: list[str], job: str, rank: int | None, address: str | None,
             snapshot_every_s: float | None) -> tuple[int, int | None]:
    """The rank and world size, once the arguments are known good (exit status 2 else)."""
    if not cmd:
        raise _Exit("no command given; usage: pitstop run --job JOB --agent URL -- CMD [ARGS...]", 2)
    why = bad_snapshot_every(snapshot_every_s)
    if why:
        raise _Exit(why, 2)
    try:
        rank, world = rank_and_world(os.environ, rank)
    except ValueError as e:
        raise _Exit(str(e), 2) from None
    why = refused_registration(job, rank, world, address, os.environ.get("SLURM_JOB_ID") or None)
    if why:
        raise _Exit(f"{why}; the command was not started", 2)
    return rank, world


def _agent(agent_url: str) -> tuple[AgentClient, dict]:
    """The agent, asked before the command starts: a worker its agent cannot take in is one nobody
    can move."""
    bad = bad_agent_url(agent_url)
    if bad:
        raise _Exit(bad, 2)
    client = agent_client(agent_url)
    try:
        info = client.info(timeout=AGENT_INFO_TIMEOUT_S)
    except PitstopError as e:
        raise _Exit(f"{e}; the command was not started", 125) from None
    _limit_caps(info)
    return client, info


def _start(cmd: list[str], env: dict[str, str], client: AgentClient, job: str, rank: int,
           address: str | None) -> _Started:
    """Start the command under its namespace's init, in its own network namespace where it has an
    address, its output pumped to this launcher's."""
    undo = Undo(resumed_by="")
    prefix: list[str] = []
    if address:  # its own network namespace and address, made by the agent (network/workerns.py)
        try:
            net = client.prepare_network(job, rank, address)
        except PitstopError as e:
            raise _Exit(f"cannot give the worker address {address}: {e}", 125) from None
        undo.push("network", lambda e: _safe(client.drop_network, f"{job}.{rank}"))
        prefix = ["nsenter", f"--net={net['path']}", "--"]
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")  # gloo's default (the hostname's address) is not here
    init, init_dir = nsinit.binary(), None
    if init is None:
        print("pitstop run: warning: native/build/pitstop-init is not built: the worker's dumps take turns with "
              "those of its neighbours sharing its directory; run `make native`", file=sys.stderr)
    else:
        init_dir = nsinit.prepare(job, rank)
        if init_dir is None:
            print(f"pitstop run: warning: cannot make a directory under {nsinit.init_dirs()}: the worker starts "
                  "without pitstop's init, and its dumps take turns with its neighbours'", file=sys.stderr)
        undo.push("init directory", lambda e: nsinit.remove_unused(init_dir))
    start = nsinit.command(init, init_dir, cmd) if init and init_dir else \
        ["unshare", "--pid", "--fork", "setsid", *cmd]
    # One pipe for both where our stdout and stderr are one stream (`>log 2>&1`): the worker's
    # order is then the only order (launcher/stdio.py); two pipes otherwise.
    rout, wout = os.pipe()
    rerr, werr = (None, wout) if stdio.one_stream() else os.pipe()
    try:
        p = subprocess.Popen([*prefix, *start], env=env, stdin=subprocess.DEVNULL, stdout=wout, stderr=werr)
    except OSError as e:
        undo.unwind(e)
        raise _Exit(f"cannot start {cmd[0]}: {e}", 127) from None
    os.close(wout)
    if rerr is not None:
        os.close(werr)
    pumps = [threading.Thread(target=_pump, args=(rout, sys.stdout), daemon=True)]
    if rerr is not None:
        pumps.append(threading.Thread(target=_pump, args=(rerr, sys.stderr), daemon=True))
    for t in pumps:
        t.start()
    return _Started(p, pumps, init_dir if init else None, undo)


def _register(s: _Started, cmd: list[str], client: AgentClient, job: str, rank: int, world: int | None,
              address: str | None, snapshot_every_s: float | None) -> tuple[dict, int]:
    """The started tree registered with its agent: (its record there, the namespace's init).  A
    command that ended at once ends the launch with its status; a refusal kills the tree."""
    root: int | None = None
    try:
        root = _find_ns_init(s.p, forks=s.init_dir is not None)
        try:
            w = client.register(job, rank, root, address, world=world,
                                slurm_job=os.environ.get("SLURM_JOB_ID") or None, snapshot_every_s=snapshot_every_s)
        except PitstopError as refused:
            if proctree.exists(root):
                raise
            try:
                s.p.wait(ENDED_AT_ONCE_WAIT_S)  # it ended while the agent looked at it: the refusal is only that
            except subprocess.TimeoutExpired:
                raise refused from None  # not ended after all: the refusal stands
            raise EndedAtOnce() from None
    except EndedAtOnce as e:
        for t in s.pumps:
            t.join(PUMP_DRAIN_S)
        s.undo.unwind(e)
        raise _Exit(f"{cmd[0]} ended before its agent could take it in (exit status "
                    f"{shell_code(s.p.returncode)}); nothing to move", shell_code(s.p.returncode)) from None
    except PitstopError as e:
        # The command runs as the namespace's init's child, the init as unshare's: killing the
        # outer process alone would leave the others running.  Where the init was never found
        # (it did not lead its session in time), the tree is taken from the outer process.
        proctree.kill_tree(root if root is not None else s.p.pid)
        s.p.kill()
        s.p.wait()
        s.undo.unwind(e)
        raise _Exit(f"could not register with the agent: {e}" + (f"; {e.action}" if e.action else ""), 125) from None
    return w, root


def _supervise(s: _Started, client: AgentClient, w: dict, root: int) -> int:
    """Forward signals to the rank wherever it runs, wait for its end here, and follow it where a
    move or a recovery took it; its exit status."""
    wid = w["id"]
    handle = _handle(w, wid)
    asked: list[int] = []  # termination signals forwarded to the rank: its end was asked for

    def forward(sig: int, _frame: object) -> None:
        if sig in signals.ASKS_FOR_END:
            asked.append(sig)
        info = _worker(client, wid)
        if info is None and handle is not None and s.p.poll() is not None:  # moved, and this host's agent is gone
            threading.Thread(target=_safe, args=(handle.signal, sig), daemon=True).start()
            return
        if info is not None and info.state in MOVING:  # its agent delivers it where the worker runs now (agent/handles.py)
            threading.Thread(target=_signal_moved, args=(client, wid, sig), daemon=True).start()
            return
        signals.send(info.root_pid if info else root, sig, under_init=s.init_dir is not None)

    for sig in FORWARDED:
        signal.signal(sig, forward)

    code = _wait_handling_signals(s.p)
    ended_at = time.time()
    for t in s.pumps:
        t.join(PUMP_DRAIN_S)
    info = _after_end(client, wid)
    if info is None or (info.state not in MOVING and not info.restored):
        _safe(lambda: client.exited(wid, code, at=ended_at, asked=bool(asked)))
        if not (code != 0 and info and info.snapshot_every_s and _recovered(client, wid, info.root_pid)):
            now = _worker(client, wid)
            if not (now and now.fenced_epoch):  # a fenced rank's directory is its agent's to remove
                nsinit.remove_unused(s.init_dir)  # its init's, where the tree was killed
            return code
    return _follow_recoveries(client, wid, handle)


def _after_end(client: AgentClient, wid: str) -> WorkerReport | None:
    """The rank's record once its process here has ended: whether a move took it (then it is
    followed where it runs now) or it ended.  An agent that does not answer is asked again: it may
    be busy with the very move that ended the process (a capture, the commit) on a loaded machine,
    and a launcher that took no answer for "ended" exited with the killed process's status while
    its rank trained on elsewhere.  No answer by the deadline: taken as ended, as before."""
    end = time.monotonic() + AGENT_ANSWER_AFTER_END_S
    while True:
        try:
            return client.worker(wid)
        except NotFound:
            return None
        except PitstopError as e:
            if time.monotonic() >= end:
                print(f"pitstop run: this host's agent did not say what became of worker {wid} "
                      f"({e.message}); taking it as ended", file=sys.stderr)
                return None
        time.sleep(0.5)


def _handle(w: dict, wid: str) -> HandleClient | None:
    """The rank's handle at the coordinator (its agent gave it at registration), for following it
    when this host's agent is gone; None where there is no coordinator or it is out of reach
    (mutual TLS: a launcher holds no certificate)."""
    h = w.get("handle") or {}
    if not h.get("coordinator"):
        return None
    try:
        return HandleClient(h["coordinator"], wid, h.get("token") or "", timeout=HANDLE_TIMEOUT_S)
    except PitstopError:
        return None


def recovery_wait_s() -> float:
    """How long a rank of a job with snapshots that ended with an error is held for a recovery:
    past the coordinator's failure deadline (10 s) and the recovery's own time."""
    try:
        return float(os.environ.get("PITSTOP_RUN_RECOVERY_WAIT_S", "60"))
    except ValueError:
        return 60.0


def _recovered(client: AgentClient, wid: str, ended_pid: int | None) -> bool:
    """Whether the rank, which just ended with an error, was restored meanwhile: a rank of a job with
    snapshots ends so when a peer's host dies under it (its collective fails), and the job's recovery
    then restores it here from the snapshot.  The launcher stays its handle rather than report an
    end that the recovery undoes; a rank that failed on its own is reported after the wait."""
    end = time.monotonic() + recovery_wait_s()
    while time.monotonic() < end:
        info = _worker(client, wid)
        if info is not None and (info.fenced_epoch or info.state == "moved"):  # it runs on elsewhere, or never here again
            return False
        if info is not None and info.end_asked:  # `pitstop stop|kill`: an end asked for, never recovered
            return False
        if info is not None and info.root_pid != ended_pid and info.state not in ("exited", "lost"):
            return True
        time.sleep(0.5)
    return False


def _follow_recoveries(client: AgentClient, wid: str, handle: OutputSource | None = None) -> int:
    """Follow the rank where it runs now, and again after each recovery that restores it."""
    while True:
        code = shell_code(follow(client, wid, fallback=handle))
        info = _worker(client, wid)
        if code == 0 or info is None or not info.snapshot_every_s or not _recovered(client, wid, info.root_pid):
            return code


def bad_snapshot_every(every_s: float | None) -> str | None:
    """What is wrong with `--snapshot-every`, said before the command starts."""
    if every_s is None:
        return None
    if not MIN_SNAPSHOT_EVERY_S <= every_s <= MAX_SNAPSHOT_EVERY_S:
        return (f"--snapshot-every {every_s:g}: give between {MIN_SNAPSHOT_EVERY_S:g} and {MAX_SNAPSHOT_EVERY_S:g} "
                "seconds (every snapshot pauses the whole job)")
    return None


def refused_registration(job: str, rank: int, world: int | None, address: str | None,
                         slurm_job: str | None) -> str | None:
    """What the agent would refuse when this worker registers, said before the command starts: a
    refusal after the start meant a command that had already run (and written, and maybe trained)
    for nothing.  Checked by the same models the agent checks with (wire/agent_requests.py), this
    process's pid standing in for the worker's."""
    if not re.fullmatch(JOB_PATTERN, job) or len(job) > JOB_NAME_MAX:
        return (f"--job {job!r} is not a job name pitstop can use: a letter or digit first, then letters, "
                f"digits, '.', '_' or '-', at most {JOB_NAME_MAX} characters (it names directories on every host)")
    try:
        body(RegisterRequest, job=job, rank=rank, pid=os.getpid(), address=address, world=world,
             slurm_job=slurm_job)
        if address:
            body(NetworkRequest, job=job, rank=rank, address=address)
    except InvalidRequest as e:
        named = {"rank": "the rank (--rank, $RANK, $SLURM_PROCID)", "world": "the job's ranks ($WORLD_SIZE, "
                 "$SLURM_NTASKS)", "slurm_job": "$SLURM_JOB_ID", "address": "--address"}
        return "; ".join(f"{named.get(p.split(':')[0], p.split(':')[0])}: {p.split(': ', 1)[-1]}"
                         for p in e.details.get("problems", [e.message]))
    return None


def hold(wid: str, *, agent_url: str, echo: bool = True) -> int:
    """Take up the handle of worker `wid`, which runs under this host's agent: this process then
    behaves as the worker's launcher would (agent/handles.py).  Its end ends the worker, signals
    it receives reach the worker, it streams the worker's output and exits with its status.  What
    a scheduler starts on the host a rank moved to, so that the rank belongs to the scheduler's job
    there (slurm/watch.py starts it as a step of the rank's Slurm job)."""
    bad = bad_agent_url(agent_url)
    if bad:
        print(f"pitstop hold: {bad}", file=sys.stderr)
        return 2
    client = agent_client(agent_url)
    if client.uds is None:
        print(f"pitstop hold: this host's agent socket is not reachable through {agent_url}; a worker's "
              "handle is taken up only over it (give --agent unix:/PATH, as root or the worker's user)",
              file=sys.stderr)
        return 2
    def forward(sig: int, _frame: object) -> None:
        threading.Thread(target=_signal_moved, args=(client, wid, sig), daemon=True).start()

    for sig in FORWARDED:  # before the handle is taken: a signal from then on must reach the worker
        signal.signal(sig, forward)
    try:
        client.hold(wid)
    except PitstopError as e:
        print(f"pitstop hold: {e}" + (f"; {e.action}" if e.action else ""), file=sys.stderr)
        return 125
    return shell_code(follow(client, wid, echo=echo))


def _wait_handling_signals(p: subprocess.Popen) -> int:
    """p's exit status, waited for in short turns.  CPython runs a Python signal handler only between
    bytecodes: a SIGTERM that lands just before a blocking waitpid() would be forwarded only once
    the rank had ended, that is never.  Popen.wait(timeout) polls, so `forward` runs within 50 ms."""
    while True:
        try:
            return p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            continue


def rank_and_world(environ: Mapping[str, str], rank: int | None = None) -> tuple[int, int | None]:
    """This process tree's rank and the job's number of ranks, from what launched it: --rank,
    else torchrun's RANK (or GROUP_RANK where `pitstop run` wraps each node's torchrun), else
    Slurm's SLURM_PROCID (`srun pitstop run -- ...`), else 0.  The world from WORLD_SIZE, else
    SLURM_NTASKS; None where nothing says.  ValueError naming the variable that is not a number."""
    def number(name: str) -> int | None:
        v = environ.get(name)
        if v is None or v == "":
            return None
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"${name}={v!r} is not a rank number; pass --rank N") from None
        if n < 0:
            raise ValueError(f"${name}={v!r} is negative; pass --rank N")
        return n

    if rank is None:
        rank = next((n for n in map(number, ("RANK", "GROUP_RANK", "SLURM_PROCID")) if n is not None), 0)
    world = number("WORLD_SIZE")
    if world is None:
        world = number("SLURM_NTASKS")
    if world is not None and world < 1:
        world = None
    if world is not None and rank >= world:
        raise ValueError(f"rank {rank} is not below the job's {world} ranks (WORLD_SIZE or SLURM_NTASKS)")
    return rank, world


def _signal_moved(client: AgentClient, wid: str, sig: int) -> None:
    """Deliver a signal to a worker that moved or is moving: through this host's agent, which
    passes it on to the agent the worker runs under now.  Mid-move the agent answers `moving`:
    asked again until the move has committed or rolled back."""
    end = time.monotonic() + SIGNAL_MOVING_FOR_S
    while True:
        try:
            client.signal(wid, sig)
            return
        except PitstopError as e:
            if e.code != "moving" or time.monotonic() > end:
                print(f"pitstop: could not pass signal {signal.Signals(sig).name} on to worker {wid}: "
                      f"{e.message}", file=sys.stderr)
                return
        time.sleep(0.2)


def _limit_caps(info: dict) -> None:
    """The worker may hold only what its agent can give back on a restore (proc/caps.py)."""
    try:
        bnd = info.get("cap_bnd")
        if bnd:
            caps.limit_bounding_set(int(bnd, 16))
    except (OSError, ValueError) as e:
        print(f"pitstop run: warning: could not limit the worker's capabilities to its agent's ({e}); "
              "a move may be refused", file=sys.stderr)


def shell_code(code: int) -> int:
    """A worker killed by signal N exits, as a shell reports it, with 128+N."""
    return 128 - code if code < 0 else code


class OutputSource(Protocol):
    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]: ...


def follow(client: OutputSource, wid: str, echo: bool = True, fallback: OutputSource | None = None) -> int:
    """Stream the output of a worker that runs elsewhere, until it exits; return its code.  The
    source is this host's agent (a launcher whose worker moved) or the coordinator (`pitstop attach`).
    fallback: where to follow it once the source has not answered for AGENT_GONE_S (the rank's
    handle at the coordinator, for a launcher whose host's agent was stopped after its rank left).
    echo=False: read it without printing it (a `pitstop hold` whose output nobody reads)."""
    offsets = {"stdout": 0, "stderr": 0}
    outs = {"stdout": sys.stdout, "stderr": sys.stderr}
    unreachable_since: float | None = None
    known: int | None = None  # the exit code, once an answer carried it
    while True:
        # Only a round that began with the exit code known has read all the output: the agent
        # gives the code once the last output is in its files, but this round's stdout may have
        # been read before that and its stderr after (a last line lost, seen in a full run).
        code = known
        got = False
        state = ""
        for stream in ("stdout", "stderr"):
            try:
                data, h = client.output(wid, stream, offsets[stream])
            except PitstopError:
                data, h = b"", {"x-pitstop-state": "unreachable"}
            state = h.get("x-pitstop-state", "")
            if data:
                if echo:
                    outs[stream].buffer.write(data)
                    outs[stream].flush()
                offsets[stream] += len(data)
                got = True
            start = int(h.get("x-pitstop-output-start") or 0)
            if not data and start > offsets[stream]:  # written where the worker ran before: not held here
                offsets[stream] = start
            if "x-pitstop-exit-code" in h:
                known = int(h["x-pitstop-exit-code"])
        if code is not None and not got:
            return code
        if known is not None and code is None:
            continue  # one more round, from the start, for what came before the exit
        if state == "exited" and code is None and not got:
            print(f"pitstop run: worker {wid} ended, but its exit status is unknown (its agent restarted "
                  "while it ran, and only a parent can collect a status)", file=sys.stderr)
            return 255
        if state in ("lost",):
            print(f"pitstop run: worker {wid} was lost (its process is gone with no exit status)",
                  file=sys.stderr)
            return 255
        if state == "unreachable":
            unreachable_since = unreachable_since or time.monotonic()
            if fallback is not None and time.monotonic() - unreachable_since > AGENT_GONE_S:
                print(f"pitstop run: this host's agent does not answer; following worker {wid} through the "
                      "coordinator", file=sys.stderr)
                client, fallback, unreachable_since = fallback, None, None
                continue
            if time.monotonic() - unreachable_since > 600:
                print(f"pitstop run: lost contact with worker {wid} for 10 minutes", file=sys.stderr)
                return 255
        else:
            unreachable_since = None
        if not got:
            time.sleep(0.2)


def _worker(client: AgentClient, wid: str) -> WorkerReport | None:
    """What this host's agent says of the worker now; None where it does not answer."""
    return _safe(client.worker, wid)


def _safe(fn, *a):  # noqa: ANN001, ANN202
    try:
        return fn(*a)
    except PitstopError:
        return None
