"""Find every shim control block in a worker's process tree; read and write it.

Blocks are memfd mappings named "pitstop-ctl".  The agent (root) reads and writes
them through /proc/PID/mem: the worker makes no system call for it.  A forked child
shares its parent's block (MAP_SHARED), so blocks are told apart by their token.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pitstop.proc import proctree
from pitstop.shimctl import layout as L


@dataclass
class Block:
    pid: int
    addr: int
    header: dict[str, Any]
    comms: list[dict[str, Any]] = field(default_factory=list)
    trail: list[int] | None = None  # the last operations' signatures, oldest first (version 2)
    trail_n: int = 0  # operations signed so far
    trail_at: list[float] | None = None  # when each of the trail's operations was issued (wall clock)
    parked_ns: int = 0  # CLOCK_REALTIME of the rank's last park at a cut, and of its leaving it
    resumed_ns: int = 0
    trim: dict[str, Any] | None = None  # the last release of unused device memory (shim/trim.c)
    refused: str | None = None  # why the shim knows it cannot re-create this process's NCCL (version 3)
    lost: dict[str, Any] | None = None  # parked on a peer's failure, or gave up on it (version 4)
    protect: int | None = None  # the committed snapshot the agent said covers the job; None: a block before version 4

    def view(self, trail: bool = False) -> dict[str, Any]:
        """As the coordinator reads it; the trail (1 KiB of numbers) only where asked for."""
        h = self.header
        extra: dict[str, Any] = {"pause": self.pause(), "trim": self.trim, "refused": self.refused,
                                 "lost": self.lost, "protect": self.protect}
        if trail and self.trail is not None:
            extra |= {"trail": self.trail, "trail_at": self.trail_at, "trail_n": self.trail_n}
        return extra | {"pid": self.pid, "version": h["version"], "token": f"{h['token']:016x}",
                "state": L.STATES.get(h["state"], str(h["state"])),
                "request": h["request"], "ack": h["ack"], "parked_comm": h["parked_comm"],
                "parked_op": L.OPS.get(h["parked_op"], "?"), "parked_peer": h["parked_peer"],
                "in_call": bool(h["in_call"]), "foreign": h["foreign"],
                "command_seq": h["command_seq"], "done_seq": h["done_seq"], "error": h["error"],
                "note": h["note"].split(b"\0", 1)[0].decode(errors="replace"),
                "comms": [{"idx": i, "key": f"{c['key']:016x}", "issued": c["issued"],
                           "target": None if c["target"] == L.TARGET_UNSET else c["target"],
                           "nranks": c["nranks"], "rank": c["rank"], "kind": L.KINDS.get(c["kind"], "?"),
                           "parent": c["parent"], "alive": bool(c["alive"]),
                           "sent": _trim(c["sent"]), "recvd": _trim(c["recvd"]),
                           "myid": c["myid"].hex() if c["myid_set"] else None}
                          for i, c in enumerate(self.comms)]}


    def pause(self) -> dict[str, float | None] | None:
        """The rank's own last pause at a cut, in wall-clock seconds: parked, resumed (None while it
        is still parked), as the shim wrote them; None before any cut or from a version-1 shim."""
        if not self.parked_ns:
            return None
        return {"parked": self.parked_ns / 1e9,
                "resumed": self.resumed_ns / 1e9 if self.resumed_ns >= self.parked_ns else None}


def _trim(xs: list[int]) -> list[int]:
    """Per-peer counters without the unused tail."""
    n = len(xs)
    while n and not xs[n - 1]:
        n -= 1
    return xs[:n]


def _find(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/memfd:pitstop-ctl" in line:
                    return int(line.split("-", 1)[0], 16)
    except OSError:
        pass
    return None


def read_block(pid: int, addr: int) -> Block | None:
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, L.SIZE_V1, addr)
        h = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(raw, 0)))
        tail = os.pread(fd, L.TAIL.size, addr + L.OFF_TAIL) if h["version"] >= 2 else b""
        refused = _refused(fd, addr, h)
        protect, lost = _lost(fd, addr, h)
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)
    if not h["magic"].startswith(L.MAGIC):
        return None
    n = min(h["ncomms"], L.MAX_COMMS)
    comms = []
    for i in range(n):
        vals = L.COMM.unpack_from(raw, L.comm_offset(i))
        c = dict(zip(L.COMM_FIELDS, vals[:len(L.COMM_FIELDS)]))
        rest = vals[len(L.COMM_FIELDS):]
        m = L.MAX_PEERS
        c["sent"], c["recvd"] = list(rest[:m]), list(rest[m:2 * m])
        c["send_target"], c["recv_target"] = list(rest[2 * m:3 * m]), list(rest[3 * m:])
        comms.append(c)
    b = Block(pid, addr, h, comms, refused=refused, lost=lost, protect=protect)
    if len(tail) == L.TAIL.size:
        vals = L.TAIL.unpack(tail)
        n, ring = vals[0], vals[1:1 + L.TRAIL_LEN]
        b.parked_ns, b.resumed_ns = vals[1 + L.TRAIL_LEN], vals[2 + L.TRAIL_LEN]
        at = vals[3 + L.TRAIL_LEN:3 + 2 * L.TRAIL_LEN]
        how, err, before, after, note = vals[3 + 2 * L.TRAIL_LEN:]
        b.trim = {"how": [name for bit, name in L.TRIM_HOW.items() if how & bit],
                  "error": L.TRIM_ERRORS.get(err, str(err)) if err else None,
                  "reserved_before": before if before >= 0 else None, "reserved_after": after if after >= 0 else None,
                  "note": note.split(b"\0", 1)[0].decode(errors="replace")}
        k = min(n, L.TRAIL_LEN)
        b.trail = [ring[i % L.TRAIL_LEN] for i in range(n - k, n)]
        b.trail_at = [at[i % L.TRAIL_LEN] / 1e9 for i in range(n - k, n)]
        b.trail_n = n
    return b


def blocks(root_pid: int) -> list[Block]:
    out: dict[int, Block] = {}
    for pid in proctree.tree(root_pid):
        addr = _find(pid)
        if addr is None:
            continue
        b = read_block(pid, addr)
        if b is not None and b.header["token"] not in out:
            out[b.header["token"]] = b
    return list(out.values())


UNMOVABLE_MAX = 1000  # what an agent's report carries of it (wire: WorkerReport.unmovable)


def _refused(fd: int, addr: int, h: dict[str, Any]) -> str | None:
    """The first thing a version-3 shim saw that it could not re-create after a move, or None."""
    if h["version"] < 3:
        return None
    n, _, note = L.REFUSED.unpack(os.pread(fd, L.REFUSED.size, addr + L.OFF_REFUSED))
    return note.split(b"\0", 1)[0].decode(errors="replace") or "(no note)" if n else None


def _lost(fd: int, addr: int, h: dict[str, Any]) -> tuple[int | None, dict[str, Any] | None]:
    """A version-4 block's `protect` and the peer's failure it is parked on (or gave up on); (None, None)
    for an older block, which has neither."""
    if h["version"] < 4:
        return None, None
    protect, state, comm, error, since, until, call = L.LOST.unpack(os.pread(fd, L.LOST.size, addr + L.OFF_LOST))
    name = L.LOST_STATES.get(state, str(state))
    if name is None:
        return protect, None
    return protect, {"state": name, "call": call.split(b"\0", 1)[0].decode(errors="replace"), "comm": comm,
                     "error": L.RESULTS.get(error, str(error)), "since": since / 1e9, "until": until / 1e9}


@dataclass
class Header:
    """One process's block as the agent's periodic look reads it: the header and the notes, not the
    communicators (a listing, not a pause)."""

    pid: int
    addr: int
    header: dict[str, Any]
    refused: str | None
    protect: int | None
    lost: dict[str, Any] | None


def _header(pid: int, addr: int) -> Header | None:
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        h = dict(zip(L.HEADER_FIELDS, L.HEADER.unpack_from(os.pread(fd, L.HEADER.size, addr), 0)))
        if not h["magic"].startswith(L.MAGIC):
            return None
        return Header(pid, addr, h, _refused(fd, addr, h), *_lost(fd, addr, h))
    except (OSError, struct.error):
        return None
    finally:
        os.close(fd)


def headers(root_pid: int) -> list[Header]:
    """Every block in the tree, once (a forked child shares its parent's), headers and notes only."""
    seen: dict[int, Header] = {}
    for pid in proctree.tree(root_pid):
        addr = _find(pid)
        got = _header(pid, addr) if addr is not None else None
        if got is not None:
            seen.setdefault(got.header["token"], got)
    return list(seen.values())


def unmovable(root_pid: int, hs: list[Header] | None = None) -> str | None:
    """Why the shim knows this tree cannot be moved, or None: NCCL loaded that the shim cannot stand
    in front of, a call that left state only in a real communicator (the shim's note says which,
    and what to do), or calls on communicators the shim did not create (made by a call that
    bypassed it).  The cut could neither destroy nor re-create them.  Reads only the blocks'
    headers and notes (a listing, not a pause); hs: those already read."""
    hs = headers(root_pid) if hs is None else hs
    why = sorted({x.refused for x in hs if x.refused})
    n = sum(x.header["foreign"] for x in hs)
    if n:
        why.append(f"the NCCL shim saw {n} call(s) on communicators it did not create (made by a call that "
                   "bypassed it): they could not be re-created after a move; the worker's stderr names the "
                   "first such call ('pitstop shim: ... did not create')")
    said = "; ".join(why)
    return (said if len(said) <= UNMOVABLE_MAX else said[:UNMOVABLE_MAX - 3] + "...") or None


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def peer_lost(hs: list[Header]) -> str | None:
    """What a worker's agent reports of a peer's failure its shim holds back (ctl.h, version 4): a
    rank parked for the job's recovery, or one that gave up waiting and handed the error on; None."""
    for state in ("parked", "gave_up"):
        for x in hs:
            lost = x.lost
            if lost and lost["state"] == state:
                where = f"{lost['call']} on communicator {lost['comm']}" if lost["comm"] >= 0 else lost["call"]
                if state == "parked":
                    return (f"parked on a peer's failure: {where} returned {lost['error']} at {_clock(lost['since'])}; "
                            f"held for the job's recovery until {_clock(lost['until'])}")
                return (f"a peer's failure: {where} returned {lost['error']} at {_clock(lost['since'])}; no recovery "
                        "came while the rank was held, and the error went to the program")
    return None


def protect(hs: list[Header], number: int) -> int:
    """Tell each block (version 4) that a committed snapshot, `number`, covers the job (0: none any more):
    a communicator error after a peer's failure then parks the rank for the job's recovery instead of
    ending it.  Written only where it differs; the blocks written."""
    n = 0
    for x in hs:
        if x.protect is None or x.protect == number:
            continue
        try:
            fd = os.open(f"/proc/{x.pid}/mem", os.O_WRONLY)
        except OSError:
            continue
        try:
            os.pwrite(fd, struct.pack("<I", number), x.addr + L.OFF_PROTECT)
            x.protect = number
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def _write(b: Block, offset: int, data: bytes) -> None:
    fd = os.open(f"/proc/{b.pid}/mem", os.O_WRONLY)
    try:
        os.pwrite(fd, data, b.addr + offset)
    finally:
        os.close(fd)


def quiesce(b: Block, gen: int) -> None:
    """Clear every target and allowance, then raise the request: each rank parks at its next call."""
    unset = struct.pack("<Q", L.TARGET_UNSET)
    for i in range(len(b.comms)):
        base = L.comm_offset(i)
        _write(b, base + L.COMM_OFF_TARGET, unset)
        _write(b, base + L.COMM_OFF_SEND_TARGET, unset * L.MAX_PEERS)
        _write(b, base + L.COMM_OFF_RECV_TARGET, unset * L.MAX_PEERS)
    _write(b, L.OFF_REQUEST, struct.pack("<I", gen))


def set_targets(b: Block, targets: dict[str, Any]) -> None:
    """targets["<key>@<rank>"] = {"coll": n, "send": {peer: n}, "recv": {peer: n}} (any part may be missing)."""
    for i, c in enumerate(b.comms):
        t = targets.get(f"{c['key']:016x}@{c['rank']}")
        if not t:
            continue
        base = L.comm_offset(i)
        if t.get("coll") is not None and t["coll"] != c["target"]:
            _write(b, base + L.COMM_OFF_TARGET, struct.pack("<Q", t["coll"]))
        for name, off, cur in (("send", L.COMM_OFF_SEND_TARGET, c["send_target"]),
                               ("recv", L.COMM_OFF_RECV_TARGET, c["recv_target"])):
            for peer, n in (t.get(name) or {}).items():
                p = int(peer)
                if 0 <= p < L.MAX_PEERS and cur[p] != n:
                    _write(b, base + off + 8 * p, struct.pack("<Q", n))


def command(b: Block, name: str, ids: dict[str, str] | None = None) -> None:
    """Post a command to the block.  ids: for rebuild and prebuild, each communicator's new unique id
    (by its key, hex); for makeids, the communicators this process makes fresh ids for: each key
    with the rank of the member that makes it (decimal), so that only that member's block is asked
    where one worker's processes hold several members."""
    for i, c in enumerate(b.comms):
        key = f"{c['key']:016x}"
        if name == "makeids":
            want = key in (ids or {}) and (ids or {})[key] == str(c["rank"])
            _write(b, L.comm_offset(i) + L.COMM_OFF_WANT_ID, struct.pack("<i", int(want)))
            continue
        newid = (ids or {}).get(key)
        if newid:
            _write(b, L.comm_offset(i) + L.COMM_OFF_NEWID, bytes.fromhex(newid))
            _write(b, L.comm_offset(i) + L.COMM_OFF_NEWID_SET, struct.pack("<i", 1))
    _write(b, L.OFF_COMMAND, struct.pack("<I", L.COMMANDS[name]))
    _write(b, L.OFF_COMMAND_SEQ, struct.pack("<I", b.header["command_seq"] + 1))


def apply(pid: int, step: Mapping[str, Any]) -> int:
    """One step of a consistent cut on every control block of the tree at `pid`: `step` is what
    coordinator/cut.py posts (op "quiesce" with its gen, "targets", or "command" with its name and
    ids), through the agent (agent/peer_routes.py) or, in the tests and benchmarks, directly.
    How many blocks it reached."""
    bs = blocks(pid)
    for b in bs:
        if step["op"] == "quiesce":
            quiesce(b, step["gen"])
        elif step["op"] == "targets":
            set_targets(b, step["targets"])
        elif step["op"] == "command":
            command(b, step["command"], step.get("ids"))
    return len(bs)
