"""Agent configuration: command-line flags over PITSTOP_* environment over defaults."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pitstop.endpoints import DataListenAddress, HostName, ListenAddress, ServiceURL, ServiceURLs, split_host_port

IMAGE_ROOT = Path("/run/pitstop/images")
"""Not /dev/shm: any local user may create entries there, a directory the agent would then
write root's memory into (safepath.py)."""


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PITSTOP_AGENT_", extra="ignore", populate_by_name=True)

    name: HostName = Field(default_factory=socket.gethostname)
    # CPU priority of the agent among the job's busy processes (pitstop/priority.py)
    nice: int = Field(default=-10, ge=-20, le=19)
    # the pause and resume of ranks done, and answered, on SCHED_FIFO (pitstop/priority.py)
    realtime: bool = True
    listen: ListenAddress = "127.0.0.1:7070"
    advertise_url: ServiceURL | None = None  # what peers and the coordinator use; default http://<listen>
    # Every coordinator, comma-separated: the agent reports to the one that leads, and finds it
    # again when the leader changes (agent/heartbeat.py)
    coordinator: ServiceURLs | None = Field(default=None, validation_alias=AliasChoices(
        "PITSTOP_AGENT_COORDINATOR", "PITSTOP_COORDINATOR"))
    state_dir: Path = Path("/var/lib/pitstop/agent")
    # default: /run/pitstop/images/<name>; every component must be root's (safepath.py), and the
    # agent mounts a tmpfs of its own there (agent/imagefs.py)
    image_dir: Path | None = None
    # A tmpfs of the agent's own with huge pages at the image directory (agent/imagefs.py):
    # dumps, deltas and restores read and write every byte there while the job waits.
    image_mount: bool = True
    image_mount_size: str | None = Field(default=None, pattern=r"^\d+[kKmMgG%]?$")  # tmpfs's default: half of RAM
    socket_path: Path | None = None    # default: <state_dir>/agent.sock
    cluster_token: str | None = Field(default=None, validation_alias=AliasChoices(
        "PITSTOP_CLUSTER_TOKEN", "PITSTOP_AGENT_CLUSTER_TOKEN"))
    insecure: bool = False             # run without a cluster token: development only
    spare: bool = False
    # The Slurm node this host is (`pitstop slurm-watch` maps a drained node to its host by it);
    # default: the short host name, which is what slurmd calls itself unless told otherwise.
    slurm_node: str | None = Field(default=None, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    # What this host fails together with (a rack, a power feed, a switch): a snapshot's replica of
    # this host's ranks is kept outside it where the cluster has a host there (coordinator/snapshots.py).
    failure_domain: str | None = Field(default=None, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    dump_timeout_s: int = 60
    # A reception here may last dump_timeout_s + transfer_timeout_s from its hello to its manifest
    # (a source streams while it dumps, then gives the transfer transfer_timeout_s).
    transfer_timeout_s: float = 600.0
    # Image streams received at once (each a move or pre-copy to this agent); one more is refused (503)
    max_receptions: int = Field(default=32, ge=1)
    # A reception fails (507) rather than leave less than this free where images are received: the
    # image directory is a tmpfs, the host's memory, and filling it would starve the jobs it hosts.
    image_free_reserve_mb: int = Field(default=256, ge=0)
    # What snapshots (this host's parts and the replicas it keeps for others) may hold in the image
    # directory, MiB; None: half of that file system.  A snapshot that would not fit is refused
    # before its job pauses, saying so (agent/snapshots.py).
    snapshot_budget_mb: int | None = Field(default=None, ge=1)
    restore_timeout_s: float = 120.0
    # A rollback that failed keeps the source's images this long (for a retry, or an operator's look),
    # then deletes them: they hold the worker's whole memory, in the host's RAM
    failed_rollback_keep_s: float = Field(default=3600.0, gt=0)
    heartbeat_s: float = 1.0
    # A connection's request line and headers must all arrive this long after its first byte (httpapi.py)
    header_timeout_s: float = Field(default=10.0, gt=0)
    # Connections one address may hold at once on the peer API (httpapi.py): the coordinator and
    # another agent use a few each; a flood from one address takes no more than this from the others
    max_connections_per_source: int = Field(default=64, ge=1)
    # A host that cannot reach its coordinator this long isolates the ranks of jobs with snapshots
    # (SIGSTOP and their network locked): their job may be recovered elsewhere meanwhile.  They run
    # on once the coordinator answers and has not fenced them (agent/snapshots.py).  0: never.
    self_fence_s: float = Field(default=6.0, ge=0)
    full_report_s: float = 60.0        # a full report at least this often, even when nothing changed
    local_group: str | None = "pitstop"  # besides root and the agent's user, who may use the local socket
    worker_link: str | None = None     # uplink for workers' own addresses (default: the default route's)
    gpu_lock_timeout_s: float = 10.0   # cuCheckpointProcessLock: longer kernels abort the capture cleanly
    # False: dump whole to disk, then send (plain dump-copy-restore).  Slower; the baseline that
    # bench/compare.py measures pitstop against, and a fallback should a CRIU ever rewrite an image.
    stream_while_dumping: bool = True
    # Image streams arrive on a plain socket of their own (transfer/dataport.py); port 0: any free
    # port, announced in /v1/info.  Set a fixed one (e.g. 0.0.0.0:7071) where firewalls need it.
    data_listen: DataListenAddress | None = None     # default: the listen host, port 0
    # Post-copy from the local copy (memory/lazy_pages.py): the restored worker runs before its
    # memory is all in place; a lazy-pages daemon fills it.  Shorter downtime; after the commit
    # the worker depends on that daemon until the fill ends (it is stopped if the daemon fails).
    lazy_restore: bool = False
    # How long a fill after the resume may take, post-copy from the local copy or over the network
    # (memory/postcopy.py; whether a move uses the latter is the coordinator's PITSTOP_COORDINATOR_POST_COPY):
    # the destination waits this long for its pages, the source serves them this long.
    lazy_fill_timeout_s: float = 600.0
    # A source's page server silent this long while the destination waits on a page: the moved
    # worker is stopped (memory/page_relay.py) rather than left hanging or reading zeros.
    lazy_page_idle_timeout_s: float = Field(default=60.0, gt=0)
    # A capture of a worker whose post-copy fill has not ended yet waits this long for it (a dump
    # before then would lose the pages not yet filled), then fails and leaves the worker running.
    capture_fill_wait_s: float = Field(default=60.0, ge=0)
    # A tree's copy-on-write pages go once (transfer/dedup.py).  auto: where the stream is TLS,
    # whose per-byte cost makes that pay; on: also for plain links slower than about 2 GB/s per
    # stream (on this testbed's loopback it costs more CPU than it saves); off: never.
    dedup_pages: Literal["auto", "on", "off"] = "auto"
    # Image pieces compressed with zstd where that wins (transfer/compress.py).  auto: the sender
    # measures, per destination, how fast pieces move raw and compressed and sends each the faster
    # way (on this testbed's loopback: raw); on: every piece that shrinks; off: never.
    compress: Literal["auto", "on", "off"] = "auto"
    compress_level: int = Field(default=1, ge=-7, le=19)
    compress_threads: int | None = Field(default=None, ge=0, le=64)  # zstd's workers; default: a quarter of the cores past 4
    # A pre-copy asks the kernel which pages the worker wrote since (memory/writetrack.py: async
    # userfaultfd write-protection, Linux 6.7+) instead of hashing every page during the pause;
    # off, or where the kernel or the worker cannot, it hashes (memory/precopy.py).
    precopy_write_tracking: bool = True
    # The release frees the stopped source's TCP ports and kills it without waiting for its exit,
    # which frees its memory while the destination restores (proc/proctree.py let_go); set, it
    # waits for the exit first, as before (0.1-0.2 s per 770 MB rank on the test VM).
    release_wait_exit: bool = False
    # With the writes tracked, CRIU itself dumps only what changed since the pre-copy, the rest left
    # in the pre-copy as its parent (criu/criutrack.py); off, or where that is unavailable, CRIU
    # dumps everything and pitstop cuts the delta out of it (memory/precopy.py).
    precopy_criu_parent: bool = True
    # CRIU's eager restore of images with a parent fills the worker's memory with UFFDIO_COPY, not
    # page faults into zeroed pages (criu/criufill.py); off: CRIU's own read.
    restore_uffd_fill: bool = True
    # How long a pre-copy kept for CRIU's incremental dump waits for its move (it holds as much of
    # the image directory as the worker's memory); longer than the coordinator's pre-copy deadline.
    precopy_keep_s: float = Field(default=900.0, gt=0)
    data_stream: bool = True           # False: send images as an HTTP PUT (the slower path)
    data_advertise_port: int | None = Field(default=None, ge=1, le=65535)  # what peers connect to, behind NAT

    def data_host_port(self) -> tuple[str, int]:
        return split_host_port(self.data_listen or f"{self.listen.rpartition(':')[0]}:0")

    @property
    def url(self) -> str:
        from pitstop.tls import scheme

        return self.advertise_url or f"{scheme()}://{self.listen}"

    @property
    def images(self) -> Path:
        return self.image_dir or IMAGE_ROOT / self.name

    @property
    def sock(self) -> Path:
        return self.socket_path or self.state_dir / "agent.sock"

    def host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)
