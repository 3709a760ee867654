"""Slurm as pitstop reads and changes it: its own commands (sinfo, scontrol) with their usual client
configuration (SLURM_CONF included), each with a deadline, and their errors quoted.

Why the commands and not slurmrestd: every Slurm cluster has them, they need no daemon or token
of their own, and slurmrestd of Slurm 22.05 can neither update a node nor push events.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import IO

from pitstop.errors import PitstopError

SLURM_COMMAND_TIMEOUT_S = 15.0  # one sinfo or scontrol call (slurmctld's own MessageTimeout is 10 s by default)
EXPAND_GRANT_S = 10  # salloc's wait for the spare's helper allocation (within the command's own deadline)


class SlurmError(PitstopError):
    code = "slurm"
    http_status = 502


@dataclass(frozen=True)
class Node:
    name: str
    state: str                 # idle, mixed, allocated, down, ...
    flags: tuple[str, ...]     # DRAIN, ...
    reason: str
    reason_changed_at: int
    comment: str
    extra: str

    @property
    def draining(self) -> bool:
        """Drained or draining: the operator (or a health check) wants the node empty."""
        return "DRAIN" in self.flags or self.state.upper().startswith("DRAIN")


def _run(args: list[str], what: str) -> str:
    return _call(args, what).stdout


def _call(args: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=SLURM_COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} is not installed here", code="slurm_missing",
                         action="install Slurm's client commands (Debian: slurm-client) where this runs") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{what} did not answer within {SLURM_COMMAND_TIMEOUT_S:g} s ({' '.join(args)})",
                         code="slurm_timeout", action="check that slurmctld runs and SLURM_CONF points at it") from None
    if p.returncode != 0:
        said = (p.stderr or p.stdout).strip().splitlines()
        raise SlurmError(f"{what} failed (exit {p.returncode}): {' / '.join(said[-3:]) or 'no output'}",
                         action="check Slurm's controller and this host's Slurm client configuration (SLURM_CONF)")
    return p


def _listed(command: str, key: str) -> list[dict]:
    """What `command --json` lists under `key` (sinfo's nodes, squeue's jobs)."""
    out = _run([command, "--json"], command)
    try:
        raw = json.loads(out)[key]
    except (ValueError, KeyError, TypeError) as e:
        raise SlurmError(f"{command} --json printed something unexpected: {e!r}",
                         action="check the Slurm version (21.08 or later has --json)") from None
    return [x for x in raw if isinstance(x, dict)]


def nodes() -> list[Node]:
    """Every node, as `sinfo --json` describes it."""
    return [Node(name=str(n.get("name", "")), state=str(n.get("state", "")),
                 flags=tuple(str(f).upper() for f in n.get("state_flags") or ()),
                 reason=str(n.get("reason") or ""), reason_changed_at=int(n.get("reason_changed_at") or 0),
                 comment=str(n.get("comment") or ""), extra=str(n.get("extra") or ""))
            for n in _listed("sinfo", "nodes") if n.get("name")]


@dataclass(frozen=True)
class Job:
    id: str
    state: str                 # RUNNING, PENDING, COMPLETED, CANCELLED, ...
    nodes: tuple[str, ...]     # expanded
    batch_host: str
    user_id: int | None = None  # whose job it is, as Slurm knows it

    @property
    def running(self) -> bool:
        return self.state.upper() in ("RUNNING", "SUSPENDED", "COMPLETING")


def hostnames(spec: str) -> tuple[str, ...]:
    """A Slurm host list (`a,b`, `n[1-3]`) expanded."""
    if not spec or spec == "(null)":
        return ()
    if "[" not in spec:
        return tuple(x for x in spec.split(",") if x)
    return tuple(_run(["scontrol", "show", "hostnames", spec], "expanding a node list").split())


def jobs() -> list[Job]:
    """Every job Slurm knows, as `squeue --json` describes it."""
    return [Job(id=str(j["job_id"]), state=str(j.get("job_state", "")), nodes=hostnames(str(j.get("nodes") or "")),
                batch_host=str(j.get("batch_host") or ""),
                user_id=int(j["user_id"]) if isinstance(j.get("user_id"), int) else None)
            for j in _listed("squeue", "jobs") if "job_id" in j]


def shrink(job: str, nodes: list[str]) -> None:
    """Job `job` keeps only `nodes`: Slurm ends its tasks on the others, which leave the job."""
    _run(["scontrol", "update", f"jobid={job}", f"NodeList={','.join(nodes)}"], f"shrinking job {job}")


def expand(job: str, node: str, reservation: str | None) -> None:
    """Add `node` to running job `job`'s allocation, as Slurm's job expansion does it: a helper
    allocation of the node that depends on the job (`--dependency=expand`), taken from the spares'
    reservation, whose node is then handed to the job (`NumNodes=0`).  Slurm must permit it
    (SchedulerParameters=permit_job_expansion).  Without slurmdbd, Slurm 22.05 takes one resize of
    a job and refuses later ones ("the DB index is being set"): that refusal is raised like any."""
    args = ["salloc", "--no-shell", "-N1", "-n1", "-w", node, f"--dependency=expand:{job}",
            f"--immediate={EXPAND_GRANT_S}", f"--job-name=pitstop-expand-{job}"]
    if reservation:
        args.append(f"--reservation={reservation}")
    p = _call(args, f"allocating {node} to add it to job {job}")
    m = re.search(r"Granted job allocation (\d+)", p.stderr + p.stdout)
    if not m:
        raise SlurmError(f"salloc did not say which allocation it granted for {node}: "
                         f"{(p.stderr or p.stdout).strip()[-300:]!r}", action="check slurmctld's log")
    helper = m.group(1)
    try:
        _run(["scontrol", "update", f"jobid={helper}", "NumNodes=0"], f"handing {node} over to job {job}")
        if not any(j.id == job and node in j.nodes for j in jobs()):
            raise SlurmError(f"job {job} did not take {node} from the helper allocation {helper}",
                             action="check SchedulerParameters=permit_job_expansion and slurmctld's log")
    finally:
        subprocess.run(["scancel", helper], capture_output=True, timeout=SLURM_COMMAND_TIMEOUT_S)


def steps(job: str) -> list[str]:
    """The names of job `job`'s running steps."""
    out = _run(["squeue", "-h", "-s", "-j", job, "-o", "%j"], f"listing the steps of job {job}")
    return [x.strip() for x in out.splitlines() if x.strip()]


def start_step(job: str, node: str, name: str, cmd: list[str], env: dict[str, str],
               out: IO[bytes]) -> subprocess.Popen:
    """Start `cmd` as a step of running job `job` on `node` (one task, sharing the job's resources
    with its other steps: `--overlap`), so that Slurm counts it to the job and ends it with the job.
    The srun that holds the step runs here, in a session of its own: a restarted caller leaves it.
    What the step and srun print goes to `stderr` and `stdout` (a refused step says why there)."""
    try:
        return subprocess.Popen(["srun", f"--jobid={job}", "--overlap", "-N1", "-n1", "-w", node,
                                 f"--job-name={name}", *cmd],
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    except FileNotFoundError:
        raise SlurmError("srun is not installed here", code="slurm_missing",
                         action="install Slurm's client commands (Debian: slurm-client) where this runs") from None


def drain(node: str, reason: str) -> None:
    """Drain `node` (again) with `reason`: Slurm places no new work there and says why."""
    _run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"], f"draining {node}")


def reservation_nodes(name: str) -> list[str] | None:
    """The nodes of reservation `name`, expanded; None if there is no such reservation."""
    try:
        out = _run(["scontrol", "-o", "show", "reservation", name], f"reading reservation {name}")
    except SlurmError as e:
        if "not found" in e.message.lower() or "invalid reservation" in e.message.lower():
            return None
        raise
    if "not found" in out.lower() or not out.strip():
        return None
    for field in out.split():
        if field.startswith("Nodes="):
            return list(hostnames(field.removeprefix("Nodes=")))
    return []


def set_reservation(name: str, nodes: list[str], users: str = "root") -> None:
    """Reservation `name` holds exactly `nodes` (made, changed or deleted as needed): ordinary jobs
    cannot be placed there, so a spare stays free for the ranks it may take."""
    have = reservation_nodes(name)
    want = sorted(set(nodes))
    if have is not None and sorted(have) == want:
        return
    if not want:
        if have is not None:
            _run(["scontrol", "delete", f"ReservationName={name}"], f"deleting reservation {name}")
        return
    spec = ",".join(want)
    if have is None:
        _run(["scontrol", "create", "reservation", f"ReservationName={name}", f"Nodes={spec}", f"Users={users}",
              "StartTime=now", "Duration=infinite", "Flags=IGNORE_JOBS"], f"creating reservation {name}")
    else:
        _run(["scontrol", "update", f"ReservationName={name}", f"Nodes={spec}"], f"updating reservation {name}")
