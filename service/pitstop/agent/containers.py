"""The agent's side of ranks in containers (container/): which container registers, what it
needs of a host, and its restore here.

A container registers through `pitstop run` inside it (launcher/incontainer.py): the worker is
the container, its root the container's init.  Its capture and rollback are the source side's
(agent/capturing.py); its restore is here.  The record kept with the worker (Worker.container)
is what travels: the container's id, name, image, OCI runtime, bind mounts and devices, and
where its runtime keeps containers on the host it left (container/config.py rewrites those).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import structlog

from pitstop.agent.settings import AgentSettings
from pitstop.agent.state import AgentState, Worker
from pitstop.container import needs, ref
from pitstop.container.podman import Podman, runtime_cannot_checkpoint
from pitstop.criu import runtime
from pitstop.errors import FailedPrecondition, InvalidRequest, PitstopError, RestoreFailed
from pitstop.proc import proctree

log = structlog.get_logger("pitstop.agent.containers")

_podmen: dict[Path, Podman] = {}
_lock = threading.Lock()


def podman(s: AgentSettings) -> Podman:
    """This agent's podman, running the CRIU this agent runs (container/podman.py)."""
    with _lock:
        p = _podmen.get(s.state_dir)
        if p is None:
            try:
                criu = runtime.locate().binary
            except PitstopError:
                criu = None
            p = _podmen[s.state_dir] = Podman(criu=criu, work=s.state_dir / "containers")
        return p


def socket_dir(s: AgentSettings) -> str:
    """The directory of this agent's local socket: what containers mount to reach it."""
    return str(s.sock.parent)


def registrant(caller: int | None, pid: int, in_container: bool) -> tuple[int, ref.Found | None]:
    """The worker a registration names, as a pid seen from here, and its container.

    A launcher in a container names itself (its own pid there): the worker is its container,
    whose init is found from the caller's credentials, never from what it says.  A launcher on
    the host names its worker by the host's pid, as always; a worker found in a container anyway
    is refused (it would be captured without its mounts)."""
    if in_container:
        if caller is None:
            raise FailedPrecondition("a container registers only over this host's agent socket",
                                     code="no_peer", action="mount the agent's socket directory into the container "
                                                            "and give `pitstop run --agent unix:/PATH`")
        found = ref.of_pid(caller)
        init = ref.container_init(caller)
        if found is None or init is None:
            raise FailedPrecondition(f"pid {caller} says it runs in a container, but no container runtime's cgroup "
                                     "or PID namespace holds it", code="not_in_container",
                                     action="run `pitstop run` on the host, or inside the container as its command")
        if proctree.ns_pids(caller)[-1:] != [pid]:
            raise FailedPrecondition(f"the caller is not pid {pid} of its container", code="not_capturable",
                                     action="register the container from `pitstop run` inside it")
        return init, found
    if pid <= 1:  # only a container's launcher names itself as its namespace's pid 1
        raise InvalidRequest(f"pid {pid} is this host's init, not a worker", code="not_capturable",
                             action="register the worker's tree root (`pitstop run` does)")
    found = ref.of_pid(pid)
    if found is not None and not ref.same_mount_ns(pid):
        raise FailedPrecondition(f"pid {pid} runs in {found.engine} container {found.id[:12]}, registered from "
                                 "outside it", code="container_outside",
                                 action="start `pitstop run` inside the container, as its command "
                                        "(docs/operator-guide.md, 'Ranks in containers')")
    return pid, None


def caller_container(pid: int) -> dict[str, str] | None:
    """The container a caller of the local socket runs in ({"engine", "id"}), or None: one whose
    cgroup a runtime named and whose mounts are not the agent's (a host whose own root was made
    from a container image still carries the image's marks, /.dockerenv, and is no container)."""
    found = ref.of_pid(pid)
    if found is None or ref.same_mount_ns(pid):
        return None
    return {"engine": found.engine, "id": found.id}


def describe(s: AgentSettings, found: ref.Found, init: int, launcher: int | None) -> dict[str, Any]:
    """The record kept with a container's worker: what its move needs to know, and why it cannot
    move where it cannot (`unmovable`: said again, before anything pauses, by the files check)."""
    rec: dict[str, Any] = {"engine": found.engine, "id": found.id, "socket_dir": socket_dir(s),
                           "launcher_ns_pid": _ns_pid(launcher) if launcher else None, "unmovable": None}
    if found.engine != ref.PODMAN:
        rec["unmovable"] = f"pitstop moves podman's containers; this one is {found.engine}'s"
        return rec
    pod = podman(s)
    try:
        info = pod.inspect(found.id)
        store = pod.storage()
    except PitstopError as e:
        rec["unmovable"] = f"podman cannot be asked about it here: {e.message}"
        return rec
    if info is None:
        rec["unmovable"] = "podman on this host does not know it"
        return rec
    rec.update(needs.record(info), graph_root=store["graph_root"], run_root=store["run_root"])
    rec["unmovable"] = runtime_cannot_checkpoint(rec["runtime"])
    return rec


def _ns_pid(pid: int) -> int | None:
    nsp = proctree.ns_pids(pid)
    return nsp[-1] if nsp else None


def lacking(s: AgentSettings, container: dict[str, Any]) -> list[dict[str, str]]:
    """What this host lacks to run that container (container/needs.py)."""
    return needs.lacking(podman(s), container, socket_dir(s))


def mapping(s: AgentSettings, container: dict[str, Any]) -> dict[str, str]:
    """The paths in the container's configuration that name the host it left, to this host's."""
    store = podman(s).storage()
    pairs = {container.get("graph_root"): store["graph_root"], container.get("run_root"): store["run_root"],
             container.get("socket_dir"): socket_dir(s)}
    return {k: v for k, v in pairs.items() if k and v}


def restore(s: AgentSettings, images: Path, container: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, float]]:
    """Restore the container whose checkpoint is in `images` with this host's podman: its init's
    pid here, its record here, and the restore's figures."""
    pod = podman(s)
    t0 = time.monotonic()
    rec, stats = pod.restore(images, mapping(s, container), timeout_s=s.restore_timeout_s)
    init = int(rec["State"]["Pid"])
    if not proctree.exists(init):
        raise RestoreFailed(f"container {container.get('name')} was restored but its init {init} is gone",
                            action=f"see `podman logs {container.get('name')}` on this host")
    here = {**container, **needs.record(rec), "socket_dir": socket_dir(s), **{
        k: v for k, v in pod.storage().items() if k in ("graph_root", "run_root")}}
    phases = {"podman_restore": stats.get("podman_restore", time.monotonic() - t0),
              "runtime_restore": stats.get("runtime_restore", 0.0),
              "criu_restore": stats.get("restore_time", 0.0), "criu_forking": stats.get("forking_time", 0.0)}
    return init, here, phases


def launcher_pid(init: int, container: dict[str, Any]) -> dict[str, int] | None:
    """The restored container's `pitstop run`, by the pid it has there (CRIU keeps it): its end
    ends the worker, as a launcher's does (agent/handles.py)."""
    want = container.get("launcher_ns_pid")
    if not want:
        return None
    pid = init if want == 1 else ref.host_pid(init, want)
    start = proctree.start_time(pid) if pid else None
    return {"pid": pid, "start": start} if pid and start is not None else None


def restored_worker(init: int, here: dict[str, Any], wk: dict[str, Any], owner_uid: int) -> Worker:
    """The record of a container restored here (`restore`), from its manifest's worker entry."""
    return Worker(id=wk["id"], job=wk["job"], rank=int(wk["rank"]), root_pid=init,
                  start_time=proctree.start_time(init) or 0, restored=True, container=here,
                  launcher=launcher_pid(init, here), world=wk.get("world"),
                  slurm_job=wk.get("slurm_job"), snapshot_every_s=wk.get("snapshot_every_s"),
                  owner_uid=owner_uid, running_since=time.time())


def watch(s: AgentSettings, state: AgentState, w: Worker) -> None:
    """Until a restored container ends: its status is the container's, as its runtime says
    (its `pitstop run` reports it first, as a rule)."""
    while proctree.is_running(w.root_pid, w.start_time):
        time.sleep(0.5)
    if w.state != "running":
        return
    code = None
    try:
        rec = podman(s).inspect((w.container or {}).get("id", ""))
        code = (rec or {}).get("State", {}).get("ExitCode")
    except PitstopError:
        pass
    if w.state == "running":
        state.update_worker(w, state="exited", exit_code=code, ended_at=time.time())
    log.info("restored container ended", worker=w.id, code=code)


def forget(s: AgentSettings, w: Worker, why: str) -> None:
    """Remove a container this host's runtime still lists but that runs elsewhere now (its move
    committed) or must not run at all (a copy whose move was rolled back); a failure is logged
    with what to do, never raised: the container does not run either way."""
    try:
        podman(s).remove((w.container or {}).get("id", ""))
    except PitstopError as e:
        log.warning("could not remove a container from this host's runtime", worker=w.id, why=why,
                    container=(w.container or {}).get("name"), error=e.message,
                    action="remove it with `podman rm`; it does not run")
