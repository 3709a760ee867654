"""Whether a destination has the files the leaving workers use by path (proc/files.py), asked
of the agents before anything pauses: by the operation's first step, and by a validate-only
evacuation request."""

from __future__ import annotations

from dataclasses import dataclass, field

from pitstop.coordinator.fanout import in_parallel
from pitstop.errors import FailedPrecondition
from pitstop.wire.agent_client import AgentClient


@dataclass
class FileCheck:
    lacking: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # worker -> [{path, why}]
    unchecked: list[str] = field(default_factory=list)  # workers an agent predating the calls could not check

    def error(self, dest: str) -> FailedPrecondition | None:
        """The refusal an operator reads, naming the first paths; None when nothing lacks."""
        if not self.lacking:
            return None
        paths = [f"{x['path']} ({x['why']})" for lack in self.lacking.values() for x in lack]
        who = ", ".join(sorted(self.lacking))
        return FailedPrecondition(
            f"{dest} lacks {len(paths)} path(s) that {who} use(s) where "
            f"{'they run' if len(self.lacking) > 1 else 'it runs'}: {'; '.join(paths[:5])}"
            + (f"; and {len(paths) - 5} more" if len(paths) > 5 else "") + ". Nothing was paused",
            code="destination_lacks_files",
            action=f"make the job's files available at the same paths on {dest} (the same image, or a "
                   "shared file system), or evacuate to another host with 'to'",
            details={"lacking": self.lacking})


def check_files(src: AgentClient, dst: AgentClient, workers: list[str]) -> FileCheck:
    """Ask the source agent for each worker's paths and the destination's agent what it lacks of
    them, all workers at once.  Raises what the agents raise (unreachable, unknown worker)."""
    res = FileCheck()

    def one(wid: str) -> None:
        need = src.worker_needs(wid)
        lack = dst.lacking_files(need["files"], container=need.get("container")) if need is not None else None
        if lack is None:
            res.unchecked.append(wid)
        elif lack:
            res.lacking[wid] = lack

    in_parallel(one, workers)
    res.unchecked.sort()
    return res
