"""Coordinator configuration: flags over PITSTOP_* environment over defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PITSTOP_COORDINATOR_", extra="ignore")

    listen: str = "127.0.0.1:7000"
    db: Path = Path("/var/lib/pitstop/coordinator.db")
    operator_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_TOKEN"))
    read_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_READ_TOKEN"))  # reads only
    cluster_token: str | None = Field(default=None, validation_alias=AliasChoices("PITSTOP_CLUSTER_TOKEN"))
    insecure: bool = False
    heartbeat_timeout_s: float = 5.0      # a host silent this long is not offered as a spare
    capture_deadline_s: float = 300.0     # dump + stream of one worker
    step_timeout_s: float = 180.0         # any other single agent call
    operation_deadline_s: float = 900.0   # the whole evacuation, before commit
    cut_deadline_s: float = 30.0          # every rank of an NCCL job reaches the consistent cut

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "127.0.0.1", int(port)
