"""Coordinator configuration: flags over PITSTOP_* environment over defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pitstop.coordinator.database import DatabaseURL
from pitstop.endpoints import ListenAddress, ServiceURL, split_host_port

if TYPE_CHECKING:
    from pitstop.coordinator.health_policy import HealthPolicy


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PITSTOP_COORDINATOR_", extra="ignore", populate_by_name=True)

    listen: ListenAddress = "127.0.0.1:7000"
    # How agents, operators and the other coordinators reach this one: its identity in the lease
    # (coordinator/leadership.py) and the URL a standby sends clients to.  Default http(s)://<listen>;
    # required where --listen is a wildcard (0.0.0.0) and the database is shared.
    advertise_url: ServiceURL | None = None
    # The leader's lease (coordinator/leadership.py): renewed every third of it; a standby takes over
    # within about this long of the leader's loss.  Why 3 s: see leadership.py.
    lease_s: float = Field(default=3.0, ge=0.5, le=120)
    nice: int = Field(default=-10, ge=-20, le=19)  # CPU priority beside busy jobs (pitstop/priority.py)
    realtime: bool = True  # the pause and resume rounds' calls on SCHED_FIFO (pitstop/priority.py)
    # A SQLite path (one coordinator on one host) or a postgresql:// URL (two or more coordinators
    # sharing it, one leading): coordinator/database.py
    db: DatabaseURL = "/var/lib/pitstop/coordinator.db"
    operator_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_TOKEN"))
    # A connection's request line and headers must all arrive this long after its first byte (httpapi.py)
    header_timeout_s: float = Field(default=10.0, gt=0)
    # Connections one address may hold at once (httpapi.py): an agent uses one or two, the CLI and
    # a scheduler's watcher a few; a flood from one address takes no more than this from the others
    max_connections_per_source: int = Field(default=128, ge=1)
    # Finished operations are forgotten this long after they ended (their record, their idempotency key)
    ops_retention_days: float = Field(default=30.0, gt=0)
    read_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_READ_TOKEN"))  # reads only
    cluster_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_CLUSTER_TOKEN"))
    insecure: bool = False
    heartbeat_timeout_s: float = 5.0      # a host silent this long is not offered as a spare
    # A host of a job with snapshots that is silent this long is declared failed for its jobs, and
    # each is recovered from its last complete snapshot (coordinator/recovery.py)
    failure_deadline_s: float = Field(default=10.0, gt=0)
    # A job that ended by failing (no rank exited 0, no end asked for) keeps its last committed
    # snapshot this long after its end, for a recovery (coordinator/snapshots.py forget_ended)
    failed_snapshot_keep_s: float = Field(default=3600.0, ge=0)
    # The most of a job's time its snapshots may pause it: a job whose snapshots pause it longer
    # than this share of its interval gets a longer interval, and is told so (coordinator/snapshots.py)
    snapshot_pause_share: float = Field(default=0.05, gt=0, le=1)
    beat_udp: bool = True                 # also take beats as datagrams on the listen port (wire/beats.py)
    flush_s: float = 1.0                  # how often beats kept in memory are written to the database
    # How often the coordinator looks for an operation whose driving thread ended without ending it
    # (operations.Operations.watch): its rollback (or commit) is then driven again, and a last write the
    # database refused (a full file system) is tried again.
    watchdog_s: float = Field(default=5.0, gt=0)
    capture_deadline_s: float = 300.0     # dump + stream of one worker
    step_timeout_s: float = 180.0         # any other single agent call
    operation_deadline_s: float = 900.0   # the whole evacuation, before commit
    cut_deadline_s: float = 30.0          # every rank of an NCCL job reaches the consistent cut
    # At the cut, the leaving ranks release the device memory their allocators hold reserved but
    # unused (PyTorch's cache, CUDA's memory pools: shim/trim.c) before their CUDA checkpoint, so
    # that only live bytes move.  False: every reserved byte moves, as a job that cannot be reached.
    release_device_cache: bool = True
    # The early rewire: a move's ranks that stay begin re-creating their NCCL communicators as the
    # leaving ranks' capture begins (coordinator/cut.py), so that the restored ranks only join them.
    # False: every rank re-creates them after the restore, inside the pause.
    early_rewire: bool = True
    # After a move, how long the job's collectives are watched for its time to useful progress
    # (coordinator/progress.py; 0: not watched)
    progress_window_s: float = Field(default=10.0, ge=0, le=600)
    # Network post-copy: after the resume, how long the operation waits for the moved workers'
    # fills (their memory still comes from the node).  Past it the operation ends saying so and
    # the node stays `draining`: powering it off could still take a rank with it.
    fill_deadline_s: float = 900.0
    # After the resume, how long an operation keeps asking the node to free the moved workers'
    # images and network locks (cleanup.py, SourceCleanup); what is left is asked again when the
    # node's agent reports, at most every source_cleanup_retry_s.  The job never waits on it.
    source_cleanup_deadline_s: float = 60.0
    source_cleanup_retry_s: float = 10.0
    fill_poll_s: float = 0.25
    # Pre-copy (memory/precopy.py): before anything pauses, the leaving workers' memory is sent
    # while the job runs; the pause then sends only what changed.  A pre-copy that fails, passes
    # its deadline, or sends nothing for precopy_stall_s is stopped and the move sends
    # everything, as without it.  The deadline is long because a GPU host's ranks can hold tens
    # of GB each; the stall deadline is what catches a stuck one.  Both count against
    # operation_deadline_s.
    pre_copy: bool = True
    precopy_deadline_s: float = 600.0
    precopy_stall_s: float = 30.0
    # Post-copy over the network (memory/postcopy.py), for evacuations that do not say: only the
    # pages a restore must place travel before it; the destination fetches the rest from the
    # source after the job resumes.  Shortest pause; until every fill has ended the moved ranks
    # depend on the source host, so the operation (and the node, `draining`) stays open.  Off by
    # default: a node drained for a failing part should leave at once.  A source that cannot serve
    # it (a TLS data port, none at all) moves without it, logged; asked for in the request, it is
    # refused instead, before anything pauses.
    post_copy: bool = False
    # GPU health policy (health_policy.py): a host past any of these is degraded.
    auto_evacuate: bool = True            # start an evacuation of a degraded host by itself
    health_max_temperature_c: float = 90.0
    health_max_ecc_uncorrected: int = 0   # volatile uncorrected ECC errors since the last reset
    health_max_retired_pages: int = 60
    health_max_remapped_rows_uncorrectable: int = 512
    health_throttle_reasons: str = "hw_slowdown,hw_thermal_slowdown,hw_power_brake_slowdown"
    health_retry_s: float = 30.0          # a blocked automatic evacuation is tried again after this

    def health_policy(self) -> "HealthPolicy":
        from pitstop.coordinator.health_policy import HealthPolicy

        return HealthPolicy(max_temperature_c=self.health_max_temperature_c,
                            max_ecc_uncorrected=self.health_max_ecc_uncorrected,
                            max_retired_pages=self.health_max_retired_pages,
                            max_remapped_rows_uncorrectable=self.health_max_remapped_rows_uncorrectable,
                            throttle_reasons=tuple(r.strip() for r in self.health_throttle_reasons.split(",")
                                                   if r.strip()))

    def host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    def url(self) -> str:
        """This coordinator's URL: --advertise-url, else its listen address."""
        from pitstop.tls import scheme

        return (self.advertise_url or f"{scheme()}://{self.listen}").rstrip("/")
