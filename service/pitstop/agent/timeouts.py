"""Every fixed wait of the agent, in one table: how long it waits for an answer, a stream or a
process, how long it keeps what it may still be asked about, and how often it looks.  Each is
named once, with why it is that long.

The deadlines an operator tunes (a capture's fill wait, a kept pre-copy, a fill's) are settings
(agent/settings.py, PITSTOP_AGENT_*); those the coordinator sets per call (a dump's, a pause's)
come with the call.  These follow from what is waited for.
"""

from __future__ import annotations

# --- Calls to others ------------------------------------------------------------------------
# The coordinator, asked at a rank's registration whether another host runs it: the launcher
# waits on this answer before the rank may start.
CLAIM_TIMEOUT_S = 3.0
# The agent a worker moved to, asked to deliver a signal that reached the worker's old host.
FORWARD_SIGNAL_TIMEOUT_S = 10.0
# Asking a destination to drop a pre-copy nobody will use: best effort, it expires there anyway.
PRECOPY_DISCARD_TIMEOUT_S = 10.0
# systemd, asked over D-Bus to put a restored worker into a scope of its own (busctl's own
# timeout, and the process's: the bus may be slow on a loaded host, never needed for the move).
SCOPE_BUS_TIMEOUT_S = 10
SCOPE_CALL_TIMEOUT_S = 15.0

# --- Streams and processes ending -----------------------------------------------------------
# A failed capture's stream, told to end with an error frame, to finish sending it.
STREAM_STOP_WAIT_S = 30.0
# An abandoned pre-copy's stream: it stops within one piece.
PRECOPY_STREAM_STOP_WAIT_S = 10.0
# A restored worker's output pumps, after it ended: its last output reaches the files before its
# end is reported.
OUTPUT_PUMP_DRAIN_S = 10.0

# --- What it keeps to be asked about --------------------------------------------------------
# An ended worker is forgotten only once nobody has read its output for this long: a moved
# worker's launcher reads it through this agent every 0.2 s for as long as the job runs, and
# gives up after 10 minutes without an answer (launcher/run.py).
ENDED_WORKER_UNREAD_S = 3600.0
# A restored worker's exit keeper ends by itself after this, so that one whose agent never came
# back does not stay for ever (agent/exitkeeper.py).
EXIT_KEEPER_LIFETIME_S = 7 * 24 * 3600
# The init directory of a rank fenced on this host (its job was recovered elsewhere while the host
# was away): removed this long after, not at once, because where hosts share /run the rank's
# copy on the spare is being restored into that very path.
FENCED_INIT_DIR_KEEP_S = 60.0

# --- How often it looks and retries ---------------------------------------------------------
# How often paused workers' deadlines are looked at (Agent.resume_overdue): a pause outlives its
# deadline by at most this.
PAUSE_LOOK_S = 1.0
# How often a running worker's shim blocks (headers and notes) are read; every beat would cost a
# read per worker per second for data that changes at a job's start.
SHIM_LOOK_EVERY_S = 5.0
# How often a worker whose launcher died mid-move is looked at again.
SETTLE_EVERY_S = 0.5
# A standby coordinator answered a report: it goes to the leader it named, almost at once.
STANDBY_RETRY_S = 0.2
# Beats over UDP that went unanswered fall back to HTTP; UDP is tried again after this.
UDP_RETRY_AFTER_S = 60.0
