"""Register with the coordinator and keep telling it what this host holds.

One POST a heartbeat period, with a deadline.  A full report (identity, role,
inventory, GPU health, every worker) goes when something in it changed, when
the coordinator asks for one (409 resync: it restarted, or lost the report) and
every `full_every_s` anyway; in between a beat says only "alive, generation G
holds", plus the GPU readings when one changed enough to matter.  That keeps a
fleet's steady state to tiny requests the coordinator answers from memory.  A
coordinator that is down only delays the next beat: agents never depend on it
to keep their workers running.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from typing import Any

import httpx
import structlog

from pitstop.agent.agent import Agent
from pitstop.agent.timeouts import STANDBY_RETRY_S, UDP_RETRY_AFTER_S
from pitstop.endpoints import split_urls
from pitstop.proc import caps
from pitstop.wire.beats import ACK_OK, ACK_RESYNC, decode_ack, encode_beat
from pitstop.wire.coordinator_client import Reports, not_leader

log = structlog.get_logger("pitstop.agent.heartbeat")


def payload(agent: Agent) -> dict:
    from pitstop.gpu.health import readings
    from pitstop.gpu.inventory import inventory

    workers = [agent.refresh(w).model_dump(include={"id", "job", "rank", "state", "root_pid", "start_time", "moved_to", "net",
                                                      "exit_code", "caps", "unmovable", "slurm_job",
                                                      "snapshot_every_s", "world", "ended_at", "end_asked", "owner_uid",
                                                      "peer_lost"})
               for w in list(agent.state.workers.values())]
    return {"name": agent.s.name, "url": agent.s.url, "spare": agent.s.spare, "workers": workers,
            "coordinator_term": agent.terms.seen or None,
            "socket": str(agent.s.sock.absolute()),
            "slurm_node": agent.s.slurm_node or socket.gethostname().split(".")[0],
            "failure_domain": agent.s.failure_domain,
            "cap_bnd": f"{caps.bounding_set():x}", **inventory(), "gpu_health": readings()}



FULL, BEAT = "/v1/agents:heartbeat", "/v1/agents:beat"
HEALTH_KEYS = ("index", "uuid", "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "retired_pages",
               "retired_pages_pending", "remap_pending", "remap_failure", "throttle_reasons")
TEMPERATURE_BAND_C = 3  # a GPU's temperature is sent again when it moved by this much


def health_signature(readings: list[dict[str, Any]]) -> list:
    """What of the GPU readings is worth a message: errors, remaps, throttling, temperature in bands."""
    sig = []
    for g in readings:
        t = g.get("temperature_c")
        sig.append([g.get(k) for k in HEALTH_KEYS] + [None if t is None else int(t) // TEMPERATURE_BAND_C])
    return sig


class Reporter:
    """Decides, beat by beat, between a full report and a beat, and what each carries."""

    def __init__(self, full_every_s: float = 60.0) -> None:
        self.nonce = secrets.token_hex(4)  # a restarted agent never reuses a generation
        self.n = 0
        self.full_every_s = full_every_s
        self.need_full = True
        self._key: str | None = None
        self._health: list | None = None
        self._last_full = 0.0

    def next(self, report: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(path, body) of the next message for `report`, a full payload()."""
        # the term a coordinator told it is no change of this host: a takeover must not bring the whole
        # fleet's full reports at once (it goes with the next full report, for a new database's leader)
        key = json.dumps({k: v for k, v in report.items() if k not in ("gpu_health", "coordinator_term")},
                         sort_keys=True, default=str)
        health = health_signature(report.get("gpu_health", []))
        now = time.monotonic()
        if key != self._key:
            self.n += 1
        if key != self._key or self.need_full or now - self._last_full >= self.full_every_s:
            self._key, self._health, self._last_full, self.need_full = key, health, now, False
            return FULL, {**report, "generation": f"{self.nonce}-{self.n}"}
        body: dict[str, Any] = {"name": report["name"], "generation": f"{self.nonce}-{self.n}"}
        if health != self._health:
            self._health = health
            body["gpu_health"] = report.get("gpu_health", [])
        return BEAT, body

    def failed(self) -> None:
        """The last full report may not have arrived, or the coordinator lacks it: send it again."""
        self.need_full = True


class UdpBeats:
    """Beats as datagrams (wire/beats.py): one outstanding at a time, each acked."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self.addr = (host, port)
        self.key = (token or "").encode()
        self.seq = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._waiting: tuple[int, asyncio.Future] | None = None
        self._one = asyncio.Lock()  # the report loop and the keepalive take turns: one beat outstanding

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Acks(self), remote_addr=self.addr)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def beat(self, name: str, generation: str, timeout_s: float) -> int | None:
        """ACK_OK, ACK_RESYNC, or None when no answer came in time."""
        async with self._one:
            return await self._beat(name, generation, timeout_s)

    async def _beat(self, name: str, generation: str, timeout_s: float) -> int | None:
        if self._transport is None:
            await self.open()
        self.seq = max(self.seq + 1, time.time_ns() // 1000)  # grows across agent restarts too
        fut = asyncio.get_running_loop().create_future()
        self._waiting = (self.seq, fut)
        assert self._transport is not None
        self._transport.sendto(encode_beat(self.key, self.seq, name, generation, time.time()))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiting = None

    def _answer(self, data: bytes | None) -> None:
        if self._waiting is None:
            return
        seq, fut = self._waiting
        ack = decode_ack(self.key, data) if data is not None else None
        if fut.done():
            return
        if data is None:
            fut.set_result(None)  # ICMP unreachable: nobody listens there
        elif ack is not None and ack[0] == seq:
            fut.set_result(ack[1])


class _Acks(asyncio.DatagramProtocol):
    def __init__(self, owner: UdpBeats) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.owner._answer(data)

    def error_received(self, exc: Exception) -> None:
        self.owner._answer(None)


UDP_MISSES_BEFORE_HTTP = 3


class Link:
    """What the report loop and the keepalive share: which coordinator reports go to (of several,
    the one that leads), the datagram channel to it, and whether reports are getting through."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.base = urls[0]
        self.udp: UdpBeats | None = None
        self.failing = False
        self.generation = ""

    def switch(self, to: str | None = None) -> None:
        """Report to `to` (the leader a standby named), else to the next coordinator given; the
        datagram channel went to the last one, so it goes (the next full report's answer offers
        one again)."""
        if to:
            nxt = to
        elif self.base in self.urls:
            nxt = self.urls[(self.urls.index(self.base) + 1) % len(self.urls)]
        else:
            nxt = self.urls[0]
        if nxt == self.base:
            return
        if nxt not in self.urls:
            self.urls.append(nxt)
        log.info("reporting to another coordinator", was=self.base, now=nxt)
        self.base = nxt
        if self.udp is not None:
            self.udp.close()
            self.udp = None


async def keep_alive(agent: Agent, link: Link) -> None:
    """While full reports fail (a coordinator flooded with connections, overloaded, or restarting),
    a datagram beat every period still says that this host lives, and its answer (a request for
    the report is one) is contact: the coordinator never takes a host that beats for dead, and the
    host never isolates its jobs' ranks while its beats are answered.  Before the coordinator ever
    named its datagram port, the HTTP port is tried (the coordinator takes datagrams there)."""
    assumed: UdpBeats | None = None
    try:
        while True:
            await asyncio.sleep(agent.s.heartbeat_s)
            if not link.failing:
                continue
            udp = link.udp
            if udp is None:
                url = httpx.URL(link.base)
                if assumed is not None and assumed.addr != (url.host, url.port):
                    assumed.close()  # the report loop moved to another coordinator
                    assumed = None
                if assumed is None and url.port:
                    assumed = UdpBeats(url.host, url.port, agent.s.cluster_token)
                udp = assumed
            if udp is None:
                continue
            try:
                status = await udp.beat(agent.s.name, link.generation or "unreported", min(1.0, agent.s.heartbeat_s))
            except OSError:
                continue
            if status is not None:
                agent.coordinator_seen = time.monotonic()
    finally:
        if assumed is not None:
            assumed.close()


async def heartbeat_loop(agent: Agent) -> None:
    assert agent.s.coordinator, "started only where a coordinator is configured (server.py)"
    link = Link(split_urls(agent.s.coordinator))
    alive = asyncio.create_task(keep_alive(agent, link))
    try:
        await _report_loop(agent, link)
    finally:
        alive.cancel()


async def _datagram_beat(agent: Agent, udp: UdpBeats, body: dict) -> int | None:
    """A beat as a datagram; the coordinator's answer (ACK_OK, ACK_RESYNC), None where none came.
    Any answer is contact, even one that asks for the report again."""
    status = await udp.beat(body["name"], body["generation"], min(1.0, agent.s.heartbeat_s))
    if status is not None:
        agent.coordinator_seen = time.monotonic()
    return status


async def _post_report(c: Reports, agent: Agent, rep: Reporter, base: str, path: str,
                       body: dict) -> tuple[str, str, httpx.Response]:
    """The report over HTTP; where the coordinator lacks the last full one (409), the full one at
    once instead.  (The URL, the path sent, the answer.)"""
    r = await c.post(base + path, body)
    if r.status_code == 409:
        rep.failed()
        path, body = rep.next(payload(agent))
        r = await c.post(base + path, body)
    return base + path, path, r


def _udp_missed(udp: UdpBeats, misses: int, off_until: float) -> tuple[int, float]:
    """One more datagram unanswered where HTTP got through; past UDP_MISSES_BEFORE_HTTP of them,
    beats go by HTTP for UDP_RETRY_AFTER_S.  (The misses counted, until when UDP is off.)"""
    misses += 1
    if misses < UDP_MISSES_BEFORE_HTTP:
        return misses, off_until
    log.warning("UDP beats not answered while HTTP works; beating over HTTP for a while",
                coordinator=udp.addr, retry_after_s=UDP_RETRY_AFTER_S)
    return 0, time.monotonic() + UDP_RETRY_AFTER_S


def _report_failed(link: Link, rep: Reporter, path: str, url: str, e: Exception) -> None:
    """A report that did not get through: a full one is due again; said once until one does; the
    next coordinator tried where this one cannot be reached."""
    if path == FULL:
        rep.failed()
    if not link.failing:
        log.warning("heartbeat failed; will keep trying (beats by datagram meanwhile)", url=url,
                    error=repr(e)[:200])
    link.failing = True
    if len(link.urls) > 1 and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        link.switch()  # that coordinator is gone: the next one leads, or names who does


async def _report_loop(agent: Agent, link: Link) -> None:
    rep = Reporter(agent.s.full_report_s)
    misses, udp_off_until = 0, 0.0
    async with Reports(agent.s.cluster_token) as c:
        while True:
            base = link.base
            url, path, udp_missed = base, BEAT, False
            udp = link.udp
            try:
                path, body = rep.next(payload(agent))
                link.generation = body["generation"]
                if path == BEAT and "gpu_health" not in body and udp is not None \
                        and time.monotonic() >= udp_off_until:
                    status = await _datagram_beat(agent, udp, body)
                    if status == ACK_OK:
                        misses, link.failing = 0, False
                        await asyncio.sleep(agent.s.heartbeat_s)
                        continue
                    if status == ACK_RESYNC:
                        rep.failed()
                        path, body = rep.next(payload(agent))
                    else:
                        udp_missed = True  # this beat goes by HTTP
                url = base + path
                url, path, r = await _post_report(c, agent, rep, base, path, body)
                if r.status_code >= 300:
                    if path == FULL:  # not stored: say it all again (a lost beat needs nothing: 409 tells)
                        rep.failed()
                    leader = not_leader(r)
                    if leader is not None:  # a standby: report to the leader it names (none yet: the next)
                        link.switch(leader or None)  # a beat needs nothing more: the leader shares the database
                        await asyncio.sleep(STANDBY_RETRY_S)
                        continue
                    raise httpx.HTTPStatusError(r.text[:200], request=r.request, response=r)
                if path == FULL and not _current_term(agent, r):
                    rep.failed()  # a coordinator that no longer leads: no contact, report to another
                    link.switch()
                    raise httpx.HTTPStatusError("a coordinator of an older term answered", request=r.request,
                                                response=r)
                agent.coordinator_seen = time.monotonic()
                if path == FULL:
                    udp = link.udp = await _udp_for(udp, r, base, agent.s.cluster_token)
                    if agent.fencing.isolated:  # back in touch: fenced ranks end, the others run on
                        await asyncio.to_thread(agent.fencing.rejoin, _fences(r))
                if udp_missed and udp is not None:  # HTTP got through where UDP did not: a firewall?
                    misses, udp_off_until = _udp_missed(udp, misses, udp_off_until)
                if link.failing:
                    log.info("coordinator reachable again", url=url)
                link.failing = False
            except (httpx.HTTPError, OSError) as e:
                _report_failed(link, rep, path, url, e)
            if agent.s.self_fence_s and time.monotonic() - agent.coordinator_seen > agent.s.self_fence_s:
                if await asyncio.to_thread(agent.fencing.isolate, agent.s.self_fence_s):
                    rep.failed()  # the next report is a full one: its answer says which jobs were fenced
            await asyncio.sleep(agent.s.heartbeat_s)


def _current_term(agent: Agent, r: httpx.Response) -> bool:
    """The term in a full report's answer, taken (an agent refuses older terms from then on); False
    where it is older than one this agent has seen: that coordinator no longer leads."""
    try:
        got = r.json()
        term, leader = got.get("term"), got.get("leader")
    except (ValueError, AttributeError):
        return True
    if not isinstance(term, int):
        return True  # a coordinator that predates terms
    if agent.terms.admit(term, leader if isinstance(leader, str) else ""):
        agent.metrics.term.set(agent.terms.seen)
        return True
    log.warning("a coordinator of an older term answered; reporting to another", term=term,
                seen=agent.terms.seen)
    return False


def _fences(r: httpx.Response) -> dict[str, int]:
    try:
        return {str(f["job"]): int(f["epoch"]) for f in r.json().get("fences") or []}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


async def _udp_for(udp: UdpBeats | None, r: httpx.Response, base: str, token: str | None) -> UdpBeats | None:
    """The UDP beat channel the coordinator offered in its answer to a full report (or none)."""
    try:
        port = r.json().get("beat_udp_port")
    except ValueError:
        port = None
    host = httpx.URL(base).host
    if not port:
        if udp is not None:
            udp.close()
        return None
    if udp is not None and udp.addr == (host, port):
        return udp
    if udp is not None:
        udp.close()
    return UdpBeats(host, int(port), token)
