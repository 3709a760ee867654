"""A real Slurm for the tests whose subject it is: slurmctld and one slurmd per node, all on this
machine, in a private directory with free ports, without munge (Slurm 22.05's auth/none).

Installed if missing by scripts/provision-slurm.sh (as the Makefile provisions CRIU).  Every
daemon is stopped and the directory removed at the end; jobs are cancelled first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from pitstop.dev.devcluster import free_port

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0


def provision() -> None:
    subprocess.run([str(ROOT / "scripts" / "provision-slurm.sh")], check=True, timeout=600)


class SlurmCluster:
    def __init__(self, nodes: list[str], cpus: int = 4) -> None:
        provision()
        self.nodes = nodes
        self.dir = Path(tempfile.mkdtemp(prefix="pitstop-slurm-"))
        os.chmod(self.dir, 0o755)
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        host = socket.gethostname().split(".")[0]
        ctl_port = free_port()
        ports = {n: free_port() for n in nodes}
        for d in ("state", "spool", "log"):
            (self.dir / d).mkdir()
        lines = [
            "ClusterName=pitstoptest", f"SlurmctldHost={host}(127.0.0.1)", "AuthType=auth/none",
            "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root", f"SlurmctldPort={ctl_port}",
            f"StateSaveLocation={self.dir}/state", f"SlurmdSpoolDir={self.dir}/spool/%n",
            f"SlurmctldPidFile={self.dir}/slurmctld.pid", f"SlurmdPidFile={self.dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.dir}/log/slurmctld.log", f"SlurmdLogFile={self.dir}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides", "ReturnToService=2",
            "SlurmdTimeout=10", "MessageTimeout=5", "KillWait=2", "MinJobAge=60",
            "SchedulerParameters=permit_job_expansion",
        ]
        lines += [f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={cpus} "
                  f"RealMemory=1000" for n in nodes]
        lines.append(f"PartitionName=train Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        try:
            self._start(["slurmctld", "-D", "-i"], "slurmctld")
            for n in nodes:
                self._start(["slurmd", "-D", "-N", n], f"slurmd-{n}")
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return dict(base if base is not None else os.environ, SLURM_CONF=str(self.conf))

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(args, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        log.close()

    def run(self, *args: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr or p.stdout}\n{self.logs()}")
        return p

    def node(self, name: str) -> dict:
        return next(n for n in json.loads(self.run("sinfo", "--json").stdout)["nodes"] if n["name"] == name)

    def _wait_idle(self) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            p = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(ln.split() for ln in p.stdout.splitlines() if ln.strip())
            if p.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} ended with {proc.returncode}:\n{self.logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"Slurm's nodes were not idle within {START_TIMEOUT_S:g} s:\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            text = f.read_text(errors="replace")
            out.append(f"--- {f.name}\n{text[-1500:]}")
        return "\n".join(out)

    def _ours(self) -> list[int]:
        """Every process of this cluster's (tasks, steps, a step's slurmstepd) by the SLURM_CONF
        each one carries: a slurmstepd whose slurmd is gone outlives it, orphaned, otherwise."""
        key = f"SLURM_CONF={self.conf}".encode()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if key in f.read().split(b"\0"):
                        out.append(int(d))
            except OSError:
                continue
        return out

    def close(self) -> None:
        if self.procs and self.procs[0].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(), capture_output=True, timeout=30)
            end = time.monotonic() + 20  # the jobs end (KillWait=2) while their slurmds can still see to it
            while time.monotonic() < end:
                p = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True,
                                   timeout=30)
                if p.returncode != 0 or not p.stdout.strip():
                    break
                time.sleep(0.3)
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        for pid in self._ours():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
