"""Byte layout of shim/ctl.h's struct pitstop_ctl (tests/test_shim.py checks it against the C compiler).

A version-1 block (a shim built before the trail) is SIZE_V1 long, a version-2 one OFF_REFUSED, a version-3
one OFF_LOST: read (and written) as far as its version says."""

from __future__ import annotations

import struct

MAGIC = b"PITSTOP-CTL-v1"
MAX_COMMS = 64
TARGET_UNSET = 2**64 - 1

MAX_PEERS = 32
HEADER = struct.Struct("<16sIIIIIIIIiiiiQii176s")
COMM = struct.Struct(f"<QQQiiiiiiii128sii128s{MAX_PEERS}Q{MAX_PEERS}Q{MAX_PEERS}Q{MAX_PEERS}Q")
HEADER_FIELDS = ("magic", "version", "ncomms", "request", "ack", "state", "command", "command_seq", "done_seq",
                 "parked_comm", "error", "parked_op", "parked_peer", "token", "in_call", "foreign", "note")
COMM_FIELDS = ("key", "issued", "target", "nranks", "rank", "kind", "parent", "color", "key_arg", "alive",
               "newid_set", "newid", "myid_set", "want_id", "myid")
COMM_OFF_SENT = 320
COMM_OFF_RECVD = COMM_OFF_SENT + 8 * MAX_PEERS
COMM_OFF_SEND_TARGET = COMM_OFF_RECVD + 8 * MAX_PEERS
COMM_OFF_RECV_TARGET = COMM_OFF_SEND_TARGET + 8 * MAX_PEERS
OPS = {0: "coll", 1: "send", 2: "recv"}
SIZE_V1 = HEADER.size + MAX_COMMS * COMM.size
# Version 2 appends the trail of operation signatures and the rank's own pause times (ctl.h).
TRAIL_LEN = 256
# trail_n, trail, parked_ns, resumed_ns, trail_ns; then the release at the cut (CMD_TRIM, shim/trim.c):
# trim_how, trim_error, trim_before, trim_after, trim_note
TAIL = struct.Struct(f"<Q{TRAIL_LEN}IQQ{TRAIL_LEN}Qiiqq128s")
TRIM_HOW = {1: "torch", 2: "cuda_mempool"}
TRIM_ERRORS = {1: "timed_out", 2: "raised"}
OFF_TAIL = SIZE_V1
# Version 3 appends what the shim saw that it could not re-create after a move (shim/dl.c and the
# calls that leave state only in the real communicator): a count and the first one's note.
REFUSED = struct.Struct("<ii512s")
OFF_REFUSED = OFF_TAIL + TAIL.size
# Version 4 appends a peer's failure in a job that snapshots protect (ctl.h): the agent's `protect` (the
# committed snapshot's number; 0: none), then lost, lost_comm, lost_error, lost_ns, lost_deadline_ns, lost_call
LOST = struct.Struct("<IiiiQQ32s")
OFF_LOST = OFF_REFUSED + REFUSED.size
OFF_PROTECT = OFF_LOST
SIZE = OFF_LOST + LOST.size

# offsets used for single-field writes
OFF_REQUEST = 24
OFF_COMMAND = 36
OFF_COMMAND_SEQ = 40
COMM_OFF_TARGET = 16
COMM_OFF_NEWID_SET = 52
COMM_OFF_NEWID = 56
COMM_OFF_WANT_ID = 188  # version 5: CMD_MAKEIDS makes this communicator's fresh id in this process

STATES = {0: "running", 1: "parked", 2: "destroyed", 3: "ids_ready", 4: "rebuilt", 5: "failed", 6: "rebuilding"}
# prebuild, makeids, the state rebuilding and want_id: version 5 (the early rewire)
COMMANDS = {"destroy": 1, "genids": 2, "rebuild": 3, "resume": 4, "release": 5, "trim": 6, "prebuild": 7, "makeids": 8}
EARLY_REWIRE_VERSION = 5
KINDS = {1: "init", 2: "split"}
LOST_STATES = {0: None, 1: "parked", 2: "gave_up"}
RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError", 4: "ncclInvalidArgument",
           5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}


def comm_offset(idx: int) -> int:
    return HEADER.size + idx * COMM.size
