"""A consistent cut across every rank and communicator of a job, then rewiring.

Each rank's shim counts the operations it issued per communicator.  The cut is
the point where, for every communicator, all members have issued the same number
of operations and every rank is parked at a call entry (not inside a call):
nothing is half-issued anywhere, and group calls stay whole (the shim checks a
group once, at its first operation).

Algorithm (run by the coordinator over the agents, or directly in tests):
 1. raise the request: every rank parks at its next NCCL call;
 2. repeat until stable: target[c] = max over members of issued[c]; ranks below a
    target continue (they are behind: they must catch up, not the others go back);
    if everyone is parked yet some rank lags on a communicator it can only reach
    past the call it is parked at, raise that call's communicator by one;
 3. stable: destroy the real communicators (nothing of NCCL crosses the capture).
After the capture (or a rollback): rank 0 of every top-level communicator makes a
fresh unique id; the ids are handed to every member; every rank rebuilds its
communicators in creation order (splits replayed) and resumes.  A rank that never
reaches the cut within the deadline fails the quiesce; the others are released
and the job continues as it was.

The early rewire (a move's, `early_ids`, `prebuild`, `finish_rewire`): as soon as the
leaving ranks are being captured, the ranks that stay make the fresh ids (each
communicator's lowest-ranked member that stays: its bootstrap root lives where nothing
moves) and begin their rebuild on a thread of their shims; NCCL's init waits in its
bootstrap until the restored ranks join with the same ids.  A rollback has the
rolled-back sources join the same way (`rejoin`) where nobody that left used the ids;
otherwise the early rebuild is abandoned and redone in place (`redo`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from pitstop.coordinator.fanout import in_parallel
from pitstop.errors import DeadlineExceeded, PitstopError

log = structlog.get_logger("pitstop.cut")

# transport: list the blocks of a worker; post an operation to a worker's blocks
GetBlocks = Callable[[str], list[dict[str, Any]]]
class GetAllBlocks(Protocol):
    """Every worker's blocks in as few calls as the transport allows; with each block's trail of
    operations where asked (coordinator/progress.py reads it once, before the move)."""

    def __call__(self, workers: list[str], trail: bool = False) -> dict[str, list[dict[str, Any]]]: ...
Post = Callable[[str, dict[str, Any]], Any]


# shim/ctl.h's first version that rebuilds on a thread of the shim (prebuild) and makes the ids the
# coordinator asks for (makeids); shimctl/layout.py EARLY_REWIRE_VERSION, checked by tests/test_cut.py
EARLY_REWIRE_SHIM = 5


class CutFailed(PitstopError):
    http_status = 500
    code = "cut_failed"


@dataclass
class CutResult:
    targets: dict[str, int]
    rounds: int
    seconds: float
    issued: dict[str, int] = field(default_factory=dict)  # per worker, its collectives issued so far (progress.py)


def issued_by_worker(blocks: list[tuple[str, dict[str, Any]]]) -> dict[str, int]:
    """Each worker's NCCL operations issued so far (collectives, sends and receives), over all its
    processes and communicators: the shim's counters, which its communicators keep across a move
    (re-created behind the same slots)."""
    out: dict[str, int] = defaultdict(int)
    for w, b in blocks:
        out[w] += block_ops(b)
    return dict(out)


def block_ops(b: dict[str, Any]) -> int:
    """One process's NCCL operations issued so far, over its communicators."""
    return sum(int(c["issued"]) + sum(c["sent"]) + sum(c["recvd"]) for c in b.get("comms", []))


def _refused(blocks: list[tuple[str, dict[str, Any]]]) -> CutFailed | None:
    """What some rank's shim saw that it could not re-create after a move (its own note says what
    and what to do: shimctl.access.unmovable), as the cut's failure; None if nothing."""
    refused = {w: b["refused"] for w, b in blocks if b.get("refused")}
    if not refused:
        return None
    return CutFailed("the job's NCCL cannot all be re-created after a move, on "
                     + "; ".join(f"{w}: {why}" for w, why in sorted(refused.items())[:4]),
                     action="the job keeps running where it is (any rank parked was released). Do what the "
                            "reason says, then start the job again", details={"workers": refused})


def _init_members(blocks: list[tuple[str, dict[str, Any]]]) -> dict[str, list[tuple[str, int]]]:
    """Each top-level communicator (by key): its members, as (worker, rank)."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for w, b in blocks:
        for c in b["comms"]:
            if c["kind"] == "init":
                out[c["key"]].append((w, int(c["rank"])))
    return out


def _id_makers(blocks: list[tuple[str, dict[str, Any]]], among: set[str],
               only: set[str] | None = None) -> dict[str, dict[str, str]]:
    """Who makes each top-level communicator's fresh id (those of `only`, else all): its
    lowest-ranked member among the workers `among`, as worker -> {communicator: that rank}.  A
    communicator with no member there is left out."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for key, ms in _init_members(blocks).items():
        there = [(r, w) for w, r in ms if w in among]
        if there and (only is None or key in only):
            r, w = min(there)
            out[w][key] = str(r)
    return dict(out)


class Cut:
    def __init__(self, workers: list[str], get_blocks: GetBlocks, post: Post, deadline_s: float = 60.0,
                 poll_s: float = 0.003, get_all: GetAllBlocks | None = None) -> None:
        self.workers = workers
        self.get = get_blocks
        self.get_all = get_all  # every worker's blocks in as few calls as the transport allows
        self.post = post
        self.deadline_s = deadline_s
        self.poll_s = poll_s
        self.gen = int(time.time() * 1000) & 0x7FFFFFFF or 1
        self.why_not: str | None = None  # why early_ids found no early rewire to begin

    def _all(self, workers: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Every worker's blocks (or those of `workers`), read at once: one round trip per round,
        not one per rank (a gloo job's 8 ranks, read one by one to learn that none uses NCCL,
        took 0.07-0.13 s of its pause on 2 cores)."""
        ws = self.workers if workers is None else workers
        if self.get_all is not None:
            got = self.get_all(ws)
            return [(w, b) for w in ws for b in got[w]]
        return [(w, b) for w, bs in zip(ws, in_parallel(self.get, ws)) for b in bs]

    def _post_all(self, body: dict[str, Any], workers: list[str] | None = None) -> None:
        in_parallel(lambda w: self.post(w, body), self.workers if workers is None else workers)

    def uses_shim(self) -> bool:
        return any(b["comms"] for _, b in self._all())

    # -- 1 + 2 + 3 ----------------------------------------------------------------------------
    def quiesce(self) -> CutResult:
        t0 = time.monotonic()
        self._check_membership(self._all())
        self._post_all({"op": "quiesce", "gen": self.gen})
        end = t0 + self.deadline_s
        rounds = 0
        last: dict[str, Any] = {}
        prev: Any = None
        while True:
            rounds += 1
            blocks = self._all()
            refused = _refused(blocks)
            if refused:  # a rank's shim, as it parked, found a reference to NCCL bound past it
                self.release()
                raise refused
            snap = [(b["token"], b["state"], [(c["issued"], c["sent"], c["recvd"]) for c in b["comms"]])
                    for _, b in blocks]
            targets, stable, lagging = self._targets(blocks, stalled=snap == prev)
            prev = snap
            if stable:
                # Confirm: write targets that let nobody move (an allowance from an earlier round
                # may still be in flight), then read again; the shim publishes "leaving" before it
                # trusts an allowance, so a rank on its way out shows here.
                self._post_all({"op": "targets", "targets": targets})
                last = targets
                again = self._all()
                snap2 = [(b["token"], b["state"], [(c["issued"], c["sent"], c["recvd"]) for c in b["comms"]])
                         for _, b in again]
                _, stable2, _ = self._targets(again)
                stable = stable2 and snap2 == snap
            if stable:
                res = CutResult(targets, rounds, time.monotonic() - t0, issued=issued_by_worker(again))
                log.info("consistent cut reached", rounds=rounds, seconds=round(res.seconds, 4),
                         communicators=len(targets))
                return res
            if targets != last:
                self._post_all({"op": "targets", "targets": targets})
                last = targets
            if time.monotonic() > end:
                self.release()
                raise CutFailed(
                    f"no consistent cut within {self.deadline_s:.0f} s: "
                    + ", ".join(lagging[:6]) + (" ..." if len(lagging) > 6 else ""),
                    action="those ranks did not reach an NCCL call (stuck in compute, or finished?); "
                           "the job was released and keeps running", details={"lagging": lagging})
            time.sleep(self.poll_s)

    def _check_membership(self, blocks: list[tuple[str, dict[str, Any]]]) -> None:
        """Every member of every communicator must be one of the workers we drive: a rank we
        cannot see would be left running while its peers destroy their communicators."""
        seen: dict[str, set[int]] = defaultdict(set)
        size: dict[str, int] = {}
        for _, b in blocks:
            for c in b["comms"]:
                if c["alive"]:
                    seen[c["key"]].add(c["rank"])
                    size[c["key"]] = c["nranks"]
        refused = _refused(blocks)
        if refused:
            raise refused
        foreign = sorted({w for w, b in blocks if b.get("foreign")})
        if foreign:
            raise CutFailed("the job uses NCCL communicators that pitstop's shim did not create (made by an NCCL "
                            f"call the shim does not wrap), on {', '.join(foreign[:8])}: they could not be "
                            "re-created after the move",
                            action="the job keeps running where it is; see the worker's stderr for the line "
                                   "'pitstop shim: ... did not create', which names the call, and report it",
                            details={"workers": foreign})
        missing = {k: sorted(set(range(size[k])) - ranks) for k, ranks in seen.items() if len(ranks) < size[k]}
        if missing:
            raise CutFailed("some ranks of the job are unknown to pitstop: "
                            + "; ".join(f"communicator {k} lacks rank(s) {v[:8]}" for k, v in missing.items()),
                            action="start every rank through `pitstop run` on a host with an agent, wait a "
                                   "heartbeat, and evacuate again; nothing was paused",
                            details={"missing": missing})

    def _targets(self, blocks: list[tuple[str, dict[str, Any]]], stalled: bool = False
                 ) -> tuple[dict[str, Any], bool, list[str]]:
        """Allowances for every member of every communicator ("<key>@<rank>"), stability, who lags.

        Collectives: a member may issue while below the most any member issued.
        Point to point: r may send to b while below b's receives from r, and receive
        from a while below a's sends to r.  Stable: everyone parked, collective counts
        equal, every channel balanced.
        """
        members: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        for _, b in blocks:
            for c in b["comms"]:
                if c["alive"]:
                    members[c["key"]][c["rank"]] = c
        targets: dict[str, Any] = {}
        lag: dict[int, list[str]] = defaultdict(list)  # id(block) -> what it owes
        owner = {id(c): b for _, b in blocks for c in b["comms"]}

        def count(xs: list[int], i: int) -> int:
            return xs[i] if 0 <= i < len(xs) else 0

        for key, ms in members.items():
            top = max(c["issued"] for c in ms.values())
            for r, c in ms.items():
                send = {str(q): count(m["recvd"], r) for q, m in ms.items() if q != r}
                recv = {str(q): count(m["sent"], r) for q, m in ms.items() if q != r}
                targets[f"{key}@{r}"] = {"coll": top, "send": send, "recv": recv}
                b = owner[id(c)]
                if c["issued"] < top:
                    lag[id(b)].append(f"{key}: {c['issued']} of {top} collectives")
                for q, n in send.items():
                    if count(c["sent"], int(q)) < n:
                        lag[id(b)].append(f"{key}: owes sends to rank {q}")
                for q, n in recv.items():
                    if count(c["recvd"], int(q)) < n:
                        lag[id(b)].append(f"{key}: owes receives from rank {q}")
        parked = {id(b): b["state"] == "parked" and b["ack"] == self.gen for _, b in blocks}
        lagging = [f"{w} (pid {b['pid']}): {b['state']}" for w, b in blocks if not parked[id(b)]]
        lagging += [f"{w} (pid {b['pid']}): " + "; ".join(lag[id(b)]) for w, b in blocks if lag[id(b)]]
        if all(parked.values()) and not any(lag.values()):
            return targets, True, []
        waiting = all(parked[id(b)] or (b["in_call"] and stalled) for _, b in blocks)
        if waiting:
            # Everyone waits (parked, or blocked inside a call with nothing moving), yet someone
            # lags: it can only catch up past the call it is parked at.
            for _, b in blocks:
                p = b["parked_comm"]
                if not parked[id(b)] or not lag[id(b)] or not 0 <= p < len(b["comms"]):
                    continue
                c = b["comms"][p]
                t = targets[f"{c['key']}@{c['rank']}"]
                if b["parked_op"] == "coll":
                    t["coll"] = max(t["coll"], c["issued"] + 1)
                elif b["parked_op"] in ("send", "recv"):
                    side, counts = ("send", c["sent"]) if b["parked_op"] == "send" else ("recv", c["recvd"])
                    q = str(b["parked_peer"])
                    t[side][q] = max(t[side].get(q, 0), count(counts, int(q)) + 1)
        return targets, False, lagging

    def _command(self, name: str, want: set[str], ids: dict[str, str] | None = None,
                 deadline_s: float | None = None, workers: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Have every worker (or those of `workers`) carry out a command; their blocks once all
        have, each in one of the `want` states."""
        self._post_all({"op": "command", "command": name, "ids": ids or {}}, workers)
        return self._await(name, want, deadline_s, workers)

    def _await(self, name: str, want: set[str], deadline_s: float | None = None,
               workers: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The blocks of every worker (or of `workers`) once each has carried out its last command
        and is in one of the `want` states; CutFailed where one failed, DeadlineExceeded past the
        deadline."""
        end = time.monotonic() + (deadline_s or self.deadline_s)
        while True:
            blocks = self._all(workers)
            failed = [f"{w} (pid {b['pid']}): {b['note']}" for w, b in blocks if b["state"] == "failed"]
            if failed:
                raise CutFailed(f"{name} failed on " + "; ".join(failed), action="see the workers' agents' logs")
            if all(b["state"] in want and b["done_seq"] == b["command_seq"] for _, b in blocks):
                return blocks
            if time.monotonic() > end:
                slow = [f"{w} (pid {b['pid']}): {b['state']}" for w, b in blocks if b["state"] not in want]
                raise DeadlineExceeded(f"{name} did not finish within {deadline_s or self.deadline_s:.0f} s: "
                                       + ", ".join(slow), action="see the workers' agents' logs")
            time.sleep(self.poll_s)

    def destroy(self) -> float:
        t0 = time.monotonic()
        self._command("destroy", {"destroyed"})
        return time.monotonic() - t0

    def rewire(self) -> tuple[float, dict[str, str]]:
        """Fresh unique ids from each top-level communicator's rank 0, rebuild everywhere, resume."""
        t0 = time.monotonic()
        blocks = self._command("genids", {"ids_ready"})
        ids: dict[str, str] = {}
        for _, b in blocks:
            for c in b["comms"]:
                if c["kind"] == "init" and c["rank"] == 0 and c["myid"]:
                    ids[c["key"]] = c["myid"]
        want = {c["key"] for _, b in blocks for c in b["comms"] if c["kind"] == "init"}
        if want - set(ids):
            roots = [f"{w} pid {b['pid']} state {b['state']} seq {b['done_seq']}/{b['command_seq']} note {b['note']!r}"
                     for w, b in blocks for c in b["comms"] if c["kind"] == "init" and c["rank"] == 0]
            raise CutFailed(f"no fresh unique id for communicator(s) {sorted(want - set(ids))}; rank 0: {roots}",
                            action="rank 0 of each communicator must be part of the job's workers")
        self._command("rebuild", {"rebuilt"}, ids)
        self._command("resume", {"running", "parked"})
        log.info("communicators re-created with new unique ids", communicators=len(ids),
                 ids={k: v[:16] + "…" for k, v in ids.items()})
        return time.monotonic() - t0, ids

    # -- the early rewire ------------------------------------------------------------------------
    def early_ids(self, leaving: set[str]) -> dict[str, str] | None:
        """Fresh unique ids for every top-level communicator with a member that stays, each made by
        its lowest-ranked member that stays (its bootstrap root then lives in a process the move
        does not touch); those with no such member get theirs from a restored rank later
        (finish_rewire).  None where the early rewire cannot run, with why in the log: a shim
        older than it, or no rank that stays."""
        blocks = self._all()
        old = sorted({w for w, b in blocks if int(b.get("version") or 0) < EARLY_REWIRE_SHIM})
        if old:
            self.why_not = f"a shim older than the early rewire in {', '.join(old[:4])}"
            return None
        makers = _id_makers(blocks, {w for w in self.workers if w not in leaving})
        if not makers:
            self.why_not = "no rank that stays is a member of any communicator"
            return None
        return self._make_ids(makers)

    def prebuild(self, ids: dict[str, str], leaving: set[str]) -> None:
        """The ranks that stay begin re-creating every communicator with `ids`, each on a thread of
        its shim: their NCCL inits wait in the bootstrap until the restored ranks join.  Returns
        once every one has begun (or, a communicator of survivors alone, finished)."""
        staying = [w for w in self.workers if w not in leaving]
        self._command("prebuild", {"rebuilding", "rebuilt"}, ids, workers=staying)

    def finish_rewire(self, ids: dict[str, str], on_join: Callable[[], None] | None = None
                      ) -> tuple[float, dict[str, str]]:
        """The early rewire's end, the leaving ranks restored: ids for the communicators no rank that
        stays belongs to (made by their lowest-ranked member), every rank not rebuilding yet told to
        rebuild with the same ids (the restored ones: they join the survivors' bootstraps), every
        rank rebuilt, all resumed.  A rank that stays whose early rebuild failed: the whole rewire
        is redone in place instead.  on_join: called before the first rank is told, from when the
        ids are spent (a rollback can no longer join them)."""
        t0 = time.monotonic()
        blocks = self._all()
        failed = [f"{w} (pid {b['pid']}): {b['note']}" for w, b in blocks if b["state"] == "failed"]
        if failed:
            log.warning("an early rebuild failed; the rewire is redone in place", failed=failed)
            return self.redo()
        missing = {k for k in _init_members(blocks) if k not in ids}
        if missing:
            ids = {**ids, **self._make_ids(_id_makers(blocks, set(self.workers), only=missing))}
        fresh = sorted({w for w, b in blocks if b["state"] in ("destroyed", "ids_ready")})
        if on_join:
            on_join()
        self._command("prebuild", {"rebuilding", "rebuilt"}, ids, workers=fresh)
        self._await("prebuild", {"rebuilt"})
        self._command("resume", {"running", "parked"})
        log.info("communicators re-created with new unique ids", communicators=len(ids), early=True,
                 joined=len(fresh), ids={k: v[:16] + "…" for k, v in ids.items()})
        return time.monotonic() - t0, ids

    def rejoin(self, ids: dict[str, str], spent: bool) -> tuple[float, dict[str, str]]:
        """A rollback's rewire in place after an early one had begun: the rolled-back sources join
        the survivors' rebuild with the same ids, where none of the ids was handed to a restored
        rank (`spent` False) and no rank's rebuild failed; otherwise, or if joining fails, the
        early rebuild is abandoned and everything re-created with fresh ids (redo)."""
        if not spent:
            try:
                return self.finish_rewire(ids)
            except PitstopError as e:
                log.warning("the rolled-back ranks could not join the early rebuild; redone in place",
                            error=e.message)
        else:
            log.info("the early rewire's ids were handed to restored ranks: the rewire is redone in place")
        return self.redo()

    def redo(self) -> tuple[float, dict[str, str]]:
        """Every rank's communicators re-created in place with fresh ids: whatever was rebuilt is
        destroyed and a rebuild still under way abandoned first (its NCCL init cannot be called
        off: what it makes is destroyed when it returns)."""
        t0 = time.monotonic()
        self._command("destroy", {"destroyed"})
        secs, ids = self.rewire()
        return time.monotonic() - t0, ids

    def _make_ids(self, makers: dict[str, dict[str, str]]) -> dict[str, str]:
        """Fresh ids made where `makers` says (worker -> {communicator: rank of the member that makes
        it}); every communicator's."""
        workers = sorted(makers)
        in_parallel(lambda w: self.post(w, {"op": "command", "command": "makeids", "ids": makers[w]}), workers)
        blocks = self._await("makeids", {"ids_ready"}, workers=workers)
        ids = {c["key"]: c["myid"] for w, b in blocks for c in b["comms"]
               if c["kind"] == "init" and c["myid"] and makers[w].get(c["key"]) == str(c["rank"])}
        lacking = sorted({k for m in makers.values() for k in m} - set(ids))
        if lacking:
            raise CutFailed(f"no fresh unique id for communicator(s) {lacking} from "
                            + ", ".join(f"{w}: {sorted(m)}" for w, m in makers.items() if set(m) & set(lacking)),
                            action="see the workers' agents' logs")
        return ids

    def trim(self, workers: list[str], deadline_s: float = 60.0) -> dict[str, list[dict[str, Any]]]:
        """Release the device memory the given (leaving) workers hold reserved without using it
        (shim/trim.c), once their communicators are destroyed and before their CUDA checkpoint:
        only live bytes travel.  Each worker's blocks' results; CutFailed naming the worker where a
        release did not finish (the move rolls back, the job runs on where it was)."""
        blocks = self._command("trim", {"destroyed"}, deadline_s=deadline_s, workers=workers)
        got: dict[str, list[dict[str, Any]]] = {w: [] for w in workers}
        for w, b in blocks:
            got[w].append(b)
        failed = [f"{w} (pid {b['pid']}): {b['trim']['error']}: {b['trim']['note']}" for w, b in blocks
                  if (b.get("trim") or {}).get("error")]
        if failed:
            raise CutFailed("the release of unused device memory failed on " + "; ".join(failed),
                            action="the job runs on where it was; set PITSTOP_COORDINATOR_RELEASE_DEVICE_CACHE=false "
                                   "to move every reserved byte instead")
        return got

    def release(self) -> None:
        """Abandon a quiesce whose communicators still exist: every rank carries on."""
        for w in self.workers:
            try:
                self.post(w, {"op": "command", "command": "release", "ids": {}})
            except PitstopError as e:
                log.warning("release failed", worker=w, error=e.message)


def device_memory(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """One worker's release at the cut, over its processes' blocks: what released memory, and the
    bytes its allocators held reserved before and after (None where no allocator said)."""
    trims = [b["trim"] for b in blocks if b.get("trim")]
    before = [t["reserved_before"] for t in trims if t["reserved_before"] is not None]
    after = [t["reserved_after"] for t in trims if t["reserved_after"] is not None]
    how = sorted({h for t in trims for h in t["how"]})
    out: dict[str, Any] = {"released_by": how or ["nothing reachable"]}
    if before and after:
        out.update(reserved_before=sum(before), reserved_after=sum(after), released=sum(before) - sum(after))
    return out


class ShimAgent(Protocol):
    """What the cut asks of an agent (wire/agent_client.AgentClient): its workers' shim blocks, and
    an operation posted to one worker's."""

    def shim_blocks(self, wid: str) -> list[dict[str, Any]]: ...
    def shim_blocks_many(self, ids: list[str], trail: bool = False) -> dict[str, list[dict[str, Any]]]: ...
    def shim_op(self, wid: str, body: dict[str, Any]) -> Any: ...


def through_agents(hosts_of: dict[str, str], agent: Callable[[str], ShimAgent], deadline_s: float) -> Cut:
    """The cut over workers (worker -> its host), through their hosts' agents: every worker's
    blocks read in one call per host, all hosts at once.  The one transport every operation
    uses: an evacuation's (before and after the move), a snapshot's, a recovery's rewire."""
    def get_all(workers: list[str], trail: bool = False) -> dict[str, list[dict[str, Any]]]:
        by: dict[str, list[str]] = defaultdict(list)
        for w in workers:
            by[hosts_of[w]].append(w)
        out: dict[str, list[dict[str, Any]]] = {}
        for got in in_parallel(lambda h: agent(h).shim_blocks_many(by[h], trail=trail), sorted(by)):
            out.update(got)
        return out

    return Cut(sorted(hosts_of), lambda w: agent(hosts_of[w]).shim_blocks(w),
               lambda w, body: agent(hosts_of[w]).shim_op(w, body), deadline_s=deadline_s, get_all=get_all)
