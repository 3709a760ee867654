"""Every fixed wait of the coordinator, in one table: how long it waits for an answer, for a
thread or for a state, and how often it looks.  Each is named once, with why it is that long.

The deadlines an operator tunes (a move's, a capture's, a snapshot's, a fill's) are settings
(coordinator/settings.py, PITSTOP_COORDINATOR_*); these are the ones that follow from what is
waited for, not from the size of a job.  A wait on an agent that has no deadline here or in the
settings is a bug: an agent that stops answering would hold the operation for ever.
"""

from __future__ import annotations

# --- One call to an agent -------------------------------------------------------------------
# A quick question to a live agent (its info, a worker's fill, the post-copy it can serve when
# settling a plan): it answers from memory, so no answer by then means it is not answering, not
# that it is busy.
AGENT_QUESTION_TIMEOUT_S = 10.0
# The source's post-copy support, asked while an evacuation request waits for its answer (the
# operator waits too): shorter than a question asked from the operation's own thread.
POST_COPY_CHECK_TIMEOUT_S = 5.0
# Each agent's worker list, asked of every agent in parallel while a request is planned: an agent
# that needs longer is planned with what its last heartbeat said.
PLAN_SYNC_TIMEOUT_S = 3.0
# A worker's output, read from its agent for `pitstop attach`: a file read and a reply.
ATTACH_OUTPUT_TIMEOUT_S = 10.0
# Each agent asked to deliver a signal to a job's rank: it may pass it on once more, to the agent
# the rank just moved to, so longer than one question.
SIGNAL_TIMEOUT_S = 15.0
# One agent told a new leader's term; one that does not answer learns it from its next beat.
ANNOUNCE_TIMEOUT_S = 2.0
# Every call of a recovery to an agent (fence, check, restore's preparation): a host that is
# dying answers late or never, and the recovery must move on to another spare.
RECOVERY_AGENT_TIMEOUT_S = 10.0
# A snapshot's quick calls (pause, lock, unlock, resume, check): no answer by then is a host in
# trouble, and the snapshot is given up rather than the job held paused.
SNAPSHOT_STEP_TIMEOUT_S = 5.0
# Dropping a snapshot's parts on their holders: a directory removal.
SNAPSHOT_DROP_TIMEOUT_S = 10.0
# One read of the job's collective counts after a move: a late one is a missed sample, not a wait.
PROGRESS_READ_TIMEOUT_S = 2.0

# --- Pauses that must end by themselves -----------------------------------------------------
# A move's peers may stay paused its whole deadline and this; past it their agents resume them
# without being told (a coordinator that died mid-move must not leave a job stopped).
MOVE_PAUSE_MARGIN_S = 60.0
# The same for a snapshot: its pause may last its dumps' deadline and this.
SNAPSHOT_PAUSE_MARGIN_S = 60.0

# --- Threads and background work ------------------------------------------------------------
# A stopped pre-copy ends within one 4 MiB read; this is the bound on a stuck one.
PRECOPY_STOP_WAIT_S = 15.0
# The early rewire's thread, told to stop: each of its calls has the cut's deadline; three of
# them and a margin.
PREWIRE_JOIN_EXTRA_S = 30.0
# The lease's threads, when a coordinator stops: each looks every STANDBY_LOOK_S or less.
LEASE_THREAD_JOIN_S = 2.0
# The watchdog's longest wait between two takeovers of one operation (an evacuation or a recovery
# whose thread keeps ending): it backs off, and goes on trying this rarely.
TAKEOVER_BACKOFF_MAX_S = 300.0
# A leader stepping down waits this long, so that answers to requests it already refused reach
# their clients before its port closes.
STEP_DOWN_PAUSE_S = 0.2
# A job with no live rank keeps its snapshots this long: a recovery may be about to start.
ENDED_JOB_SNAPSHOTS_KEEP_S = 60.0

# --- How often it looks ---------------------------------------------------------------------
# The snapshot schedule and the failure detection each run once a tick.
DUTY_TICK_S = 1.0
# How often a pre-copy's progress is read from the source.
PRECOPY_PROGRESS_EVERY_S = 1.0
# How often a standby reads the lease (and tries to take an expired one): a leader lost is
# replaced within the lease's expiry and this.
STANDBY_LOOK_S = 0.5
# How often the leader checks its own lease deadline, whatever its renewals do: it must stop
# acting before a standby may take over.
DEADLINE_LOOK_S = 0.05
# How often a call to an agent, while it runs, looks whether the agent's host is still heard
# (fanout.while_heard): a host that lost power is given up within a heartbeat's silence and this.
HEARD_POLL_S = 0.5

# --- The database ---------------------------------------------------------------------------
# Connecting to PostgreSQL: a server that does not accept by then is down or unreachable.
PG_CONNECT_TIMEOUT_S = 5
# A statement that waits longer than this (a lock held by a stuck session, a server too loaded to
# answer) fails as StoreUnavailable rather than holding the coordinator's only connection for ever.
PG_STATEMENT_TIMEOUT_MS = 15000
