"""Client for the coordinator's REST API: the operators' calls (the CLI, the demo, tests) and the one an
agent makes outside its heartbeats (`claim`, with the cluster token)."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx

from pitstop import tls
from pitstop.endpoints import check_urls, split_urls
from pitstop.errors import FailedPrecondition, InvalidRequest, Unavailable
from pitstop.wire.agent_client import raise_for
from pitstop.wire.auth import bearer

FOLLOW_S = 15.0
"""How long a call looks for the leader among the coordinators it was given: a leader's loss is
taken over within about 4 s (coordinator/leadership.py), with margin for a loaded host."""
RETRY_S = 0.3  # between two rounds over the coordinators while none of them leads
REPORT_TIMEOUT_S = 5.0  # one heartbeat, a full report or a beat: the loop beats again a period later anyway


def leader_view(url: str, timeout_s: float) -> dict[str, Any]:
    """What this one coordinator says of the lease (GET /v1/leader, open), asked once, followed
    nowhere (`pitstop doctor` asks each coordinator in turn); httpx.HTTPError or ValueError where it
    does not answer so."""
    v = httpx.get(url.rstrip("/") + "/v1/leader", timeout=timeout_s, verify=tls.client_context()).json()
    if not isinstance(v, dict):
        raise ValueError(f"{url}/v1/leader answered {type(v).__name__}, not an object")
    return v


class Reports:
    """An agent's heartbeats over HTTP (agent/heartbeat.py): full reports and beats to whichever
    coordinator the loop chose, with the cluster token, one pool of connections, each call within
    REPORT_TIMEOUT_S.  Answers come back as they are: the loop reads a 409, a standby's 503 and a
    full report's answer (the term, the datagram port, the fences) itself."""

    def __init__(self, token: str | None) -> None:
        self.http = httpx.AsyncClient(timeout=REPORT_TIMEOUT_S, verify=tls.client_context(), headers=bearer(token))

    async def post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        return await self.http.post(url, json=body)

    async def __aenter__(self) -> "Reports":
        return self

    async def __aexit__(self, *a: object) -> None:
        await self.http.aclose()


class CoordinatorClient:
    """The coordinator's API.  `url` may name several coordinators, comma-separated: a call goes to
    the one that leads, found by trying each (a refused connection sent nothing, so trying the next
    is safe even for a POST) and by following a standby's answer (`503 not_leader` names the
    leader, coordinator/standby.py).  A standby answers reads itself."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0,
                 follow_s: float = FOLLOW_S) -> None:
        url = url or os.environ.get("PITSTOP_COORDINATOR")
        if not url:
            raise FailedPrecondition("no coordinator given", code="no_coordinator",
                                     action="set PITSTOP_COORDINATOR=http://HOST:PORT or pass --coordinator")
        try:
            check_urls(url)
        except ValueError as e:
            raise InvalidRequest(f"coordinator URL {e}", code="bad_coordinator_url",
                                 action="give the URL with its scheme, e.g. http://10.0.0.5:7000 (several: "
                                        "comma-separated)") from None
        self.urls = split_urls(url)
        self.url = self.urls[0]  # the one calls go to: the leader, once found
        self.follow_s = follow_s
        token = token if token is not None else os.environ.get("PITSTOP_TOKEN")
        self.http = httpx.Client(timeout=timeout, verify=tls.client_context(), headers=bearer(token))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *a: object) -> None:
        self.close()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The request, at the coordinator that leads (see the class).  Connection errors are
        tried on the next coordinator only: a request that reached one may have acted there.  A
        read acts nowhere: one that timed out (a coordinator stalled, a frozen VM) goes to the next
        coordinator too, and one a coordinator answered "database unavailable" (PostgreSQL
        restarting) is asked again until follow_s."""
        end = time.monotonic() + self.follow_s
        tried: set[str] = set()
        safe = method in ("GET", "HEAD")
        while True:
            try:
                r = self.http.request(method, self.url + path, **kw)
                if safe and _database_unavailable(r) and time.monotonic() < end:
                    time.sleep(RETRY_S)
                    continue
            except (httpx.ConnectError, httpx.ConnectTimeout, *((httpx.TimeoutException,) if safe else ())) as e:
                tried.add(self.url)
                if len(self.urls) == 1:
                    raise self._unreachable(e) from None
                if len(tried) >= len(self.urls):  # a round over all of them: wait, then again
                    if time.monotonic() >= end:
                        raise self._unreachable(e) from None
                    time.sleep(RETRY_S)
                    tried.clear()
                self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
                continue
            except httpx.HTTPError as e:
                raise self._unreachable(e) from None
            leader = not_leader(r)
            if leader is None or time.monotonic() >= end:
                return r
            if leader and leader != self.url:  # a standby named the leader: go there
                if leader not in self.urls:
                    self.urls.append(leader)
                self.url = leader
                continue
            time.sleep(RETRY_S)  # between two leaders: ask again (another coordinator, where there are several)
            self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]

    def _unreachable(self, e: Exception) -> Unavailable:
        where = self.url if len(self.urls) == 1 else f"any of {', '.join(self.urls)}"
        return Unavailable(f"cannot reach the coordinator at {where}: {e!r}",
                           action="check the coordinator URL (--coordinator or PITSTOP_COORDINATOR) "
                                  "and that the coordinator runs")

    def _req(self, method: str, path: str, **kw: Any) -> Any:
        return raise_for(self._send(method, path, **kw))

    def leader(self) -> dict:
        """Who leads, as the coordinator asked knows it (GET /v1/leader, open)."""
        return self._req("GET", "/v1/leader")

    def hosts(self) -> list[dict]:
        return self._req("GET", "/v1/hosts")

    def jobs(self) -> list[dict]:
        return self._req("GET", "/v1/jobs")

    def ops(self, node: str | None = None, done: bool | None = None, before: float | None = None,
            limit: int | None = None) -> list[dict]:
        params = {k: v for k, v in (("node", node), ("done", None if done is None else str(done).lower()),
                                    ("before", before), ("limit", limit)) if v is not None}
        return self._req("GET", "/v1/operations", params=params)

    def moves(self, node: str | None = None, result: str | None = None, limit: int | None = None) -> list[dict]:
        params = {k: v for k, v in (("node", node), ("result", result), ("limit", limit)) if v is not None}
        return self._req("GET", "/v1/moves", params=params)

    def cordon(self, host: str, reason: str | None = None) -> dict:
        return self._req("POST", f"/v1/hosts/{host}:cordon", json={"reason": reason} if reason else {})

    def uncordon(self, host: str) -> dict:
        return self._req("POST", f"/v1/hosts/{host}:uncordon")

    def set_role(self, host: str, role: str) -> dict:
        return self._req("POST", f"/v1/hosts/{host}:setRole", json={"role": role})

    def remove_host(self, host: str) -> dict:
        return self._req("DELETE", f"/v1/hosts/{host}")

    def op(self, op_id: str) -> dict:
        return self._req("GET", f"/v1/operations/{op_id.removeprefix('operations/')}")

    def evacuate(self, node: str, to: str | None = None, idempotency_key: str | None = None,
                 reason: str | None = None, post_copy: bool | None = None, pre_copy: bool | None = None,
                 validate_only: bool = False) -> dict:
        body: dict[str, Any] = {"validate_only": True} if validate_only else {}
        if pre_copy is not None:
            body["pre_copy"] = pre_copy
        if post_copy is not None:
            body["post_copy"] = post_copy
        if to:
            body["to"] = to
        if reason:
            body["reason"] = reason
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._req("POST", f"/v1/nodes/{node}:evacuate", json=body, headers=headers)

    def snapshots(self, job: str) -> dict:
        return self._req("GET", f"/v1/jobs/{job}/snapshots")

    def set_snapshots(self, job: str, every_s: float | None) -> dict:
        return self._req("PUT", f"/v1/jobs/{job}/snapshots", json={"every_s": every_s})

    def drop_snapshots(self, job: str) -> dict:
        return self._req("DELETE", f"/v1/jobs/{job}/snapshots")

    def take_snapshot(self, job: str, timeout: float = 600.0) -> dict:
        return self._req("POST", f"/v1/jobs/{job}/snapshots:take", timeout=timeout)

    def recover(self, job: str, node: str | None = None) -> dict:
        return self._req("POST", f"/v1/jobs/{job}:recover", params={"node": node} if node else None)

    def signal_job(self, job: str, sig: int) -> dict:
        """A signal for every rank of the job, delivered where each runs now."""
        return self._req("POST", f"/v1/jobs/{job}:signal", json={"signal": sig})

    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        """A worker's output from `offset` and its X-Pitstop-* headers, wherever it runs."""
        return self._output(f"/v1/workers/{wid}/output", stream, offset)

    def _output(self, path: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        r = self._send("GET", path, params={"stream": stream, "offset": offset})
        if r.status_code >= 300:
            raise_for(r)
        return r.content, {k.lower(): v for k, v in r.headers.items()}

    def claim(self, host: str, job: str, rank: int, owner_uid: int | None = None, privileged: bool = False) -> dict:
        """An agent's question before it registers a rank (the cluster token): 409 duplicate_rank
        where another live host runs it, 403 not_your_job where the job's ranks are another
        user's (owner_uid: the registering user; privileged: root, who may add to any job)."""
        return self._req("POST", "/v1/agents:claim", json={"host": host, "job": job, "rank": rank,
                                                            "owner_uid": owner_uid, "privileged": privileged})

    def cancel(self, op_id: str) -> dict:
        return self._req("POST", f"/v1/operations/{op_id.removeprefix('operations/')}:cancel")


class HandleClient(CoordinatorClient):
    """A rank's launcher at the coordinator, with the handle its agent gave it (wire/auth.py): the
    rank's output and state, and a signal for it; that rank alone."""

    def __init__(self, url: str, wid: str, token: str, timeout: float = 30.0) -> None:
        super().__init__(url, token=token, timeout=timeout)
        self.wid = wid

    def output(self, wid: str, stream: str, offset: int) -> tuple[bytes, dict[str, str]]:
        return self._output(f"/v1/workers/{wid}/handle/output", stream, offset)

    def signal(self, sig: int) -> dict:
        return self._req("POST", f"/v1/workers/{self.wid}/handle:signal", params={"signal": sig})



def _unavailable_error(r: httpx.Response) -> dict | None:
    """A coordinator's 503 problem ({"code", "message", "details"}), or None for any other answer."""
    if r.status_code != 503:
        return None
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def _database_unavailable(r: httpx.Response) -> bool:
    """A coordinator's answer that it cannot use its database now (coordinator/store.py)."""
    return (_unavailable_error(r) or {}).get("code") == "database_unavailable"


def not_leader(r: httpx.Response) -> str | None:
    """A standby's answer (coordinator/standby.py): the leader's URL, "" while none leads; None for
    any other answer.  The agents' heartbeat reads it too."""
    err = _unavailable_error(r)
    if err is None or err.get("code") != "not_leader":
        return None
    leader = (err.get("details") or {}).get("leader")
    return str(leader).rstrip("/") if leader else ""
