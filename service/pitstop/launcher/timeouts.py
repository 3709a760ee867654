"""Every fixed wait of `pitstop run`, in one table: how long it waits for its agent, for the
coordinator and for the rank's own processes.  Each is named once, with why it is that long.
The one an operator tunes (how long a failed rank waits to be recovered) is
PITSTOP_RUN_RECOVERY_WAIT_S (launcher/run.py, recovery_wait_s)."""

from __future__ import annotations

# The agent's health or info, asked before the command starts: nothing has started yet, so an
# agent that does not answer by then is a refusal with nothing to undo.
AGENT_INFO_TIMEOUT_S = 10.0
# The namespace's init, from the start of the outer process until it leads its session and (for
# pitstop's init) has forked the command: exec and a fork, seconds only on a machine in trouble.
NS_INIT_FIND_S = 10.0
# The command ended while the agent looked at it (the agent refused a process that was gone):
# its exit status, collected before the launcher reports it.
ENDED_AT_ONCE_WAIT_S = 10.0
# The rank's record, asked of this host's agent once the rank's process here has ended (a move, or
# its own end): an agent busy with that very move may answer late, and no answer is not an end.
AGENT_ANSWER_AFTER_END_S = 30.0
# The output pumps, to pass on what the ended command wrote last.
PUMP_DRAIN_S = 5.0
# This host's agent silent this long while the launcher follows a moved rank: it follows the
# rank through the coordinator instead (the rank's handle).
AGENT_GONE_S = 5.0
# One call to the coordinator with the rank's handle.
HANDLE_TIMEOUT_S = 10.0
# A signal for a rank in the middle of a move is retried until the move has ended; a move's
# pause is seconds, its whole deadline minutes.
SIGNAL_MOVING_FOR_S = 120.0
# One call to the agent over its socket, from inside a container.
CONTAINER_AGENT_CALL_TIMEOUT_S = 10.0
