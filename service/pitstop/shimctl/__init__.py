"""The agent's side of the shim's control block (shim/ctl.h): find, read, write."""

from pitstop.shimctl.access import (  # noqa: F401
    apply,
    blocks,
    command,
    headers,
    peer_lost,
    protect,
    quiesce,
    set_targets,
    unmovable,
)
