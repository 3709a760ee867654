"""A typed client for an agent's HTTP API (peers, the coordinator, tests, the launcher)."""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import httpx

from pitstop import tls
from pitstop.errors import DeadlineExceeded, PitstopError, Unavailable
from pitstop.wire.agent_requests import (
    CaptureRequest,
    CheckFilesRequest,
    CommitRequest,
    ExitedRequest,
    FenceRequest,
    FilesCheckRequest,
    KeepReplicaRequest,
    NetworkRequest,
    PreCopyRequest,
    RegisterRequest,
    SendReplicasRequest,
    ShimOp,
    SignalRequest,
    SnapshotRequest,
    SnapshotWorkersRequest,
    TermRequest,
    WorkersRequest,
    body,
)
from pitstop.wire.auth import bearer
from pitstop.wire.capture_report import CaptureReport
from pitstop.wire.worker_report import WorkerReport

TERM_HEADER = "x-pitstop-term"
"""The coordinator's term on every call it makes to an agent (coordinator/leadership.py): an agent
refuses a term lower than one it has seen (409 stale_term), so a coordinator that no longer leads
cannot act through it."""

ROLLBACK_TIMEOUT_S = 180.0  # a rollback may restore the source from its own dump: a restore's time
VERIFY_TIMEOUT_S = 180.0  # digests of every image file, read back from the destination's disk
FOLLOW_OUTPUT_TIMEOUT_S = 10.0  # a moved worker's output, fetched from the agent it moved to


def health(url: str, timeout_s: float) -> dict[str, Any] | None:
    """What an agent says of itself before any token (GET /healthz: its name, its local socket's
    path); None where it does not answer, or answers something else."""
    try:
        h = httpx.get(url.rstrip("/") + "/healthz", timeout=timeout_s, verify=tls.client_context()).json()
    except (httpx.HTTPError, ValueError):
        return None
    return h if isinstance(h, dict) else None


async def fetch_output(url: str, token: str | None, wid: str, stream: str, offset: int,
                       timeout_s: float = FOLLOW_OUTPUT_TIMEOUT_S) -> httpx.Response:
    """A worker's output from the agent at `url` (where it moved), as that agent answered it, for
    an agent to pass on (agent/shared_routes.py); httpx.HTTPError where it cannot be reached."""
    async with httpx.AsyncClient(timeout=timeout_s, verify=tls.client_context(), headers=bearer(token)) as c:
        return await c.get(f"{url.rstrip('/')}/v1/workers/{wid}/output", params={"stream": stream, "offset": offset})


def _workers(got: list[dict[str, Any]]) -> list[WorkerReport]:
    return [WorkerReport.model_validate(w) for w in got]


def raise_for(r: httpx.Response) -> Any:
    """Turn a JSON problem back into the PitstopError it was."""
    if r.status_code < 300:
        return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") else None
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        err = None
    if not err:
        err = {"code": "http_error", "message": f"HTTP {r.status_code}: {r.text[:300]}"}
    raise PitstopError.from_dict(err, http_status=r.status_code)


class Fence(Protocol):
    """The coordinator's side of the term (coordinator/leadership.py)."""

    def current(self) -> int:
        """The term to send; raises (a PitstopError) where the caller may not act any more."""

    def stale(self, seen: int) -> None:
        """An agent refused the term: it has seen `seen`."""


class AgentClient:
    def __init__(self, url: str, token: str | None = None, *, uds: str | None = None,
                 timeout: float = 30.0, fence: Fence | None = None) -> None:
        self.url = url.rstrip("/")
        self.token = token  # the cluster token its calls carry (None: none, or mutual TLS alone)
        self.uds = uds  # the agent's local socket, where the caller's own process is known (SO_PEERCRED)
        self.terms = fence  # the coordinator's: every call carries its term (None: a peer, the launcher)
        headers = bearer(token)
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport,
                                 verify=tls.client_context())

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *a: object) -> None:
        self.close()

    def _req(self, method: str, path: str, **kw: Any) -> Any:
        if kw.get("timeout", 0) is None:  # not given: the client's own timeout, never httpx's "no timeout at all"
            del kw["timeout"]
        if self.terms is not None:
            kw["headers"] = {**(kw.get("headers") or {}), TERM_HEADER: str(self.terms.current())}
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise DeadlineExceeded(f"{method} {self.url}{path} timed out: {e!r}",
                                   action="check that the agent is alive and not overloaded") from None
        except httpx.HTTPError as e:
            raise Unavailable(f"cannot reach agent at {self.url}: {e!r}",
                              action="check that the agent runs and the address is right") from None
        return self._raise_for(r)

    def _raise_for(self, r: httpx.Response) -> Any:
        try:
            return raise_for(r)
        except PitstopError as e:
            if e.code == "stale_term" and self.terms is not None:
                seen = e.details.get("seen")
                if isinstance(seen, int):
                    self.terms.stale(seen)
            raise

    # reading
    def info(self, timeout: float | None = None) -> dict:
        return self._req("GET", "/v1/info", **({"timeout": timeout} if timeout else {}))

    def workers(self) -> list[WorkerReport]:
        return [WorkerReport.model_validate(w) for w in self._req("GET", "/v1/workers")]

    def worker(self, wid: str) -> WorkerReport:
        return WorkerReport.model_validate(self._req("GET", f"/v1/workers/{wid}"))

    # local (Unix socket) calls
    def register(self, job: str, rank: int, pid: int, address: str | None = None, world: int | None = None,
                 slurm_job: str | None = None, snapshot_every_s: float | None = None,
                 container: bool = False) -> dict:
        """container: the caller runs in a container, which is the worker (launcher/incontainer.py)."""
        return self._req("POST", "/v1/workers", json=body(RegisterRequest, job=job, rank=rank, pid=pid,
                                                          address=address, world=world, slurm_job=slurm_job,
                                                          snapshot_every_s=snapshot_every_s, container=container))

    def signal(self, wid: str, sig: int) -> dict:
        """Deliver a signal to the worker wherever it runs now (agent/handles.py); both doors."""
        return self._req("POST", f"/v1/workers/{wid}:signal", json=body(SignalRequest, signal=sig))

    def hold(self, wid: str) -> dict:
        """This process takes the place of the worker's launcher here (agent/handles.py); local only."""
        return self._req("POST", f"/v1/workers/{wid}:hold")

    def prepare_network(self, job: str, rank: int, address: str) -> dict:
        return self._req("POST", "/v1/networks", json=body(NetworkRequest, job=job, rank=rank, address=address))

    def drop_network(self, wid: str) -> dict:
        return self._req("DELETE", f"/v1/networks/{wid}")

    def exited(self, wid: str, code: int, at: float | None = None, asked: bool = False) -> dict:
        return self._req("POST", f"/v1/workers/{wid}:exited", json=body(ExitedRequest, code=code, at=at, asked=asked))

    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        headers = {TERM_HEADER: str(self.terms.current())} if self.terms is not None else None
        try:
            r = self.http.get(f"/v1/workers/{wid}/output", params={"stream": stream, "offset": offset},
                              headers=headers)
        except httpx.HTTPError as e:
            raise Unavailable(f"cannot reach agent at {self.url}: {e!r}", action="check the agent") from None
        if r.status_code >= 300:
            self._raise_for(r)
        return r.content, {k.lower(): v for k, v in r.headers.items()}

    def worker_files(self, wid: str, timeout: float = 30.0) -> list[dict] | None:
        """The paths a restore of the worker needs (proc/files.py); None from an agent that
        predates the call."""
        return self._or_each(lambda: self._req("GET", f"/v1/workers/{wid}/files", timeout=timeout)["files"],
                             lambda: None)

    def worker_needs(self, wid: str, timeout: float = 30.0) -> dict | None:
        """What a restore of the worker needs: {"files": [...], "container": the container it is, or
        None}; refused where it cannot move at all (a container whose runtime cannot checkpoint).
        None from an agent that predates the call."""
        return self._or_each(lambda: self._req("GET", f"/v1/workers/{wid}/files", timeout=timeout), lambda: None)

    def lacking_files(self, files: list[dict], timeout: float = 30.0, container: dict | None = None) -> list[dict] | None:
        """What this agent's host lacks of those paths (and of the worker's container, if any), each
        with why; None from an agent that predates the call."""
        return self._or_each(lambda: self._req("POST", "/v1/files:check",
                                               json=body(FilesCheckRequest, files=files, container=container),
                                               timeout=timeout)["lacking"], lambda: None)

    def pause(self, wid: str) -> WorkerReport:
        return WorkerReport.model_validate(self._req("POST", f"/v1/workers/{wid}:pause"))

    def resume(self, wid: str) -> WorkerReport:
        return WorkerReport.model_validate(self._req("POST", f"/v1/workers/{wid}:resume"))

    def pause_many(self, ids: list[str], deadline_s: float | None = None) -> list[WorkerReport]:
        """All of `ids` in one call; an agent older than the batch call gets one call each.
        deadline_s: the agent resumes them by itself past it, should nobody else (the caller gone)."""
        return self._or_each(lambda: _workers(self._req("POST", "/v1/workers:batchPause",
                                                        json=body(WorkersRequest, ids=ids, pause_deadline_s=deadline_s))),
                             lambda: [self.pause(wid) for wid in ids])

    def resume_many(self, ids: list[str]) -> list[WorkerReport]:
        return self._or_each(lambda: _workers(self._req("POST", "/v1/workers:batchResume",
                                                        json=body(WorkersRequest, ids=ids))),
                             lambda: [self.resume(wid) for wid in ids])

    @staticmethod
    def _or_each(batch: Callable[[], Any], each: Callable[[], Any]) -> Any:
        """The call, or, where the agent predates it (its router has no such route, which is not
        the same as an unknown worker), what `each` gives instead: the same work one call at a
        time, or None where there is nothing to fall back on."""
        try:
            return batch()
        except PitstopError as e:
            if e.code not in ("http_404", "http_405"):
                raise
        return each()

    def discard_worker(self, wid: str) -> dict:
        return self._req("POST", f"/v1/workers/{wid}:discard")

    def shim_blocks(self, wid: str) -> list[dict]:
        return self._req("GET", f"/v1/workers/{wid}/shim")["blocks"]

    def shim_blocks_many(self, ids: list[str], trail: bool = False) -> dict[str, list[dict]]:
        """Every worker's blocks in one call; an agent older than the batch call gets one call each.
        trail: with each block's trail of operation signatures (coordinator/progress.py)."""
        params: dict[str, Any] = {"ids": ids} | ({"trail": "true"} if trail else {})
        return self._or_each(lambda: self._req("GET", "/v1/workers:batchGetShim", params=params)["blocks"],
                             lambda: {wid: self.shim_blocks(wid) for wid in ids})

    def shim_op(self, wid: str, op: dict) -> dict:
        return self._req("POST", f"/v1/workers/{wid}/shim", json=body(ShimOp, **op))

    def captures(self) -> list[CaptureReport]:
        return [CaptureReport.model_validate(c) for c in self._req("GET", "/v1/captures")]

    # the leaving side
    def capture(self, worker_id: str, dest_url: str | None = None, image_id: str | None = None,
                keep_peers: list[str] | None = None, post_copy: bool | None = None) -> dict:
        return self._req("POST", "/v1/captures", json=body(CaptureRequest, worker_id=worker_id, dest_url=dest_url,
                                                            image_id=image_id, keep_peers=keep_peers,
                                                            post_copy=post_copy))

    def precopy(self, worker_id: str, dest_url: str, image_id: str, post_copy: bool | None = None,
                timeout: float = 120.0) -> dict:
        req = body(PreCopyRequest, worker_id=worker_id, dest_url=dest_url, image_id=image_id, post_copy=post_copy)
        return self._req("POST", "/v1/precopies", json=req, timeout=timeout)

    def precopies(self, timeout: float = 5.0) -> list[dict]:
        """The pre-copies under way on this agent, with their progress."""
        return self._req("GET", "/v1/precopies", timeout=timeout)["precopies"]

    def stop_precopy(self, image_id: str, timeout: float = 5.0) -> dict:
        return self._req("DELETE", f"/v1/precopies/{image_id}", timeout=timeout)

    def get_capture(self, cid: str, wait: float = 0.0) -> CaptureReport:
        return CaptureReport.model_validate(self._req("GET", f"/v1/captures/{cid}", params={"wait": wait} if wait else None,
                                                      timeout=max(30.0, wait + 10)))

    def wait_capture(self, cid: str, deadline_s: float,
                     on_progress: Callable[[CaptureReport], None] | None = None) -> CaptureReport:
        end = time.monotonic() + deadline_s
        while True:
            c = self.get_capture(cid, wait=0.5)
            if on_progress:
                on_progress(c)
            if c.state != "dumping":
                return c
            if time.monotonic() > end:
                raise DeadlineExceeded(f"capture {cid} did not finish within {deadline_s:.0f} s",
                                       action="the agent rolls the source back when its own deadlines pass")

    def release(self, cid: str) -> dict:
        return self._req("POST", f"/v1/captures/{cid}:release")

    def commit(self, cid: str, moved_to: dict[str, str], timeout: float | None = None) -> dict:
        return self._req("POST", f"/v1/captures/{cid}:commit", json=body(CommitRequest, moved_to=moved_to),
                         **({"timeout": timeout} if timeout else {}))

    def rollback(self, cid: str) -> dict:
        return self._req("POST", f"/v1/captures/{cid}:rollback", timeout=ROLLBACK_TIMEOUT_S)

    # the arriving side
    def image(self, image_id: str) -> dict:
        return self._req("GET", f"/v1/images/{image_id}")

    def verify(self, image_id: str) -> dict:
        return self._req("POST", f"/v1/images/{image_id}:verify", timeout=VERIFY_TIMEOUT_S)

    def restore(self, image_id: str, timeout: float = 180.0) -> dict:
        return self._req("POST", f"/v1/images/{image_id}:restore", timeout=timeout)

    def data_port(self, timeout: float = 10.0) -> int | None:
        """The agent's image data port; None where it has none (the images then go as an HTTP PUT)."""
        try:
            port = self.info(timeout=timeout).get("data_port")
        except (Unavailable, DeadlineExceeded):
            raise
        except PitstopError:
            return None
        return int(port) if isinstance(port, int) and 0 < port < 65536 else None

    def put_images(self, image_id: str, content: Any, timeout: httpx.Timeout | float) -> dict:
        """Stream a capture's images (transfer/stream.py's frames) in one HTTP request."""
        return self._req("PUT", f"/v1/images/{image_id}", content=content, timeout=timeout)

    def discard(self, image_id: str, timeout: float = 60.0) -> dict:
        """Longer than the agent's wait for an abandoned restore to stop (30 s): the caller
        must not go on (resume the source) while that copy may still come up."""
        return self._req("DELETE", f"/v1/images/{image_id}", timeout=timeout)

    # snapshots and recovery (agent/snapshot_routes.py) ---------------------------------------
    def snapshot_check(self, job: str, ids: list[str], cut: bool = False) -> dict:
        return self._req("POST", "/v1/snapshots:check", json=body(SnapshotRequest, job=job, number=1, ids=ids, cut=cut))

    def snapshot_lock(self, job: str, ids: list[str], locked: bool, cut: bool = False) -> dict:
        return self._req("POST", f"/v1/snapshots/{job}:lockNetwork",
                         json=body(SnapshotWorkersRequest, ids=ids, locked=locked, cut=cut))

    def snapshot_take(self, job: str, number: int, ids: list[str], buddy_url: str | None, timeout: float,
                      cut: bool = False, whole: bool = False) -> dict:
        return self._req("POST", "/v1/snapshots", json=body(SnapshotRequest, job=job, number=number, ids=ids,
                                                            buddy_url=buddy_url, cut=cut, whole=whole),
                         timeout=timeout)

    def snapshots(self, job: str | None = None, timeout: float | None = None) -> list[dict]:
        return self._req("GET", "/v1/snapshots", params={"job": job} if job else None, timeout=timeout)

    def snapshot_drop(self, job: str, keep: int | None = None, timeout: float | None = None) -> dict:
        return self._req("DELETE", f"/v1/snapshots/{job}", params={"keep": keep} if keep is not None else None,
                         timeout=timeout)

    def keep_replica(self, image_id: str, job: str, number: int, worker_id: str) -> dict:
        return self._req("POST", f"/v1/images/{image_id}:keepReplica",
                         json=body(KeepReplicaRequest, job=job, number=number, worker_id=worker_id))

    def snapshot_restore(self, job: str, number: int, ids: list[str], timeout: float, side: str = "own") -> dict:
        return self._req("POST", f"/v1/snapshots/{job}/{number}:restore",
                         json=body(CheckFilesRequest, ids=ids, side=side), timeout=timeout)

    def send_replicas(self, job: str, number: int, ids: list[str], dest_url: str, timeout: float) -> dict:
        return self._req("POST", f"/v1/snapshots/{job}/{number}:sendReplicas",
                         json=body(SendReplicasRequest, ids=ids, dest_url=dest_url), timeout=timeout)

    def snapshot_check_files(self, job: str, number: int, ids: list[str], side: str, timeout: float) -> dict:
        return self._req("POST", f"/v1/snapshots/{job}/{number}:checkFiles",
                         json=body(CheckFilesRequest, ids=ids, side=side), timeout=timeout)

    def stop_workers(self, job: str, ids: list[str], timeout: float | None = None) -> dict:
        return self._req("POST", f"/v1/jobs/{job}:stopWorkers", json=body(WorkersRequest, ids=ids), timeout=timeout)

    def announce_term(self, term: int, leader: str, timeout: float | None = None) -> dict:
        """A coordinator that took the lease tells the agent its term before acting: from then on
        the agent refuses every call of an older one (a cut-off leader's)."""
        return self._req("POST", "/v1/coordinator:term", json=body(TermRequest, term=term, leader=leader),
                         timeout=timeout)

    def fence(self, job: str, epoch: int, reason: str = "", timeout: float | None = None) -> dict:
        return self._req("POST", f"/v1/jobs/{job}:fence", json=body(FenceRequest, job=job, epoch=epoch, reason=reason),
                         timeout=timeout)
