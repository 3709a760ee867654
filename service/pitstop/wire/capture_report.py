"""What an agent reports of one capture (`GET /v1/captures/{id}`), as the coordinator reads it.

The agent's own record of a capture (agent/state.py `Capture`) extends this model with what only
the agent needs (its image directory, the dump's seal, the stdio pipes); the fields both sides
rely on are declared here, once.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CaptureState = Literal["dumping", "dumped", "sent", "released", "committed", "rolled_back", "failed"]


class CaptureReport(BaseModel):
    # An agent of another release may say more: what this one does not know is kept, not refused.
    model_config = ConfigDict(extra="allow")

    id: str
    worker_id: str
    state: CaptureState = "dumping"
    dest_url: str | None = None
    image_id: str | None = None
    phases: dict[str, float] = Field(default_factory=dict)  # seconds of each step, as the source measured
    bytes_total: int | None = None
    bytes_sent: int = 0
    bytes_deduplicated: int = 0  # image bytes sent as references to pages sent before (transfer/dedup.py)
    compression: dict[str, Any] | None = None  # what the stream compressed, and the rates it measured (transfer/compress.py)
    error: dict[str, Any] | None = None
    gpu: dict[str, Any] = Field(default_factory=dict)  # gpu.checkpoint.Suspended.record(); empty: no CUDA
    # post-copy over the network: the split (eager/lazy bytes) and what the fill has fetched so far
    post_copy: dict[str, Any] | None = None
    pre_copy: dict[str, Any] | None = None  # the delta against a pre-copy: bytes left in it, bytes sent now
    stopped_at: float | None = None  # wall clock: the worker stopped making progress (its network, GPUs, dump)
    # The copy being captured (pid, start time): once the move commits, the coordinator takes no
    # late report of this very copy for the worker's new whereabouts (coordinator/store.py)
    source_pid: int | None = None
    source_start_time: int | None = None
    created: float = Field(default_factory=time.time)
    updated: float = Field(default_factory=time.time)
