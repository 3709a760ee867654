"""The agent's side of the shim's control block (shim/ctl.h): find, read, write."""

from pitstop.shimctl.access import blocks, command, quiesce, set_targets, unmovable  # noqa: F401
