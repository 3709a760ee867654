"""Heartbeats: full reports when something changed, tiny beats otherwise, liveness kept in
memory and written in batches.  Logic tests here; the real thing end to end at the bottom."""

import copy
import time

import httpx
import pytest

from pitstop.agent.heartbeat import Reporter
from pitstop.coordinator.sqlitestore import Store
from pitstop.dev.devcluster import LocalCluster


def _report(temp=48, state="running"):
    return {"name": "gpu-1", "url": "http://10.0.0.1:7070", "spare": False,
            "workers": [{"id": "j.0", "job": "j", "rank": 0, "state": state}],
            "gpu_health": [{"index": 0, "uuid": "GPU-1", "temperature_c": temp, "ecc_uncorrected_volatile": 0}]}


def test_reporter_sends_full_reports_only_on_change():
    rep = Reporter(full_every_s=3600)
    path, body = rep.next(_report())
    assert path == "/v1/agents:heartbeat" and body["workers"] and body["generation"].endswith("-1")
    gen = body["generation"]
    path, body = rep.next(_report(temp=49))  # within the band: nothing worth saying
    assert path == "/v1/agents:beat" and body == {"name": "gpu-1", "generation": gen}
    path, body = rep.next(_report(temp=58))  # moved a band: the readings go along
    assert path == "/v1/agents:beat" and body["gpu_health"][0]["temperature_c"] == 58
    hot = _report(temp=58)
    hot["gpu_health"][0]["ecc_uncorrected_volatile"] = 1  # an error always counts
    assert "gpu_health" in rep.next(hot)[1]
    path, body = rep.next(_report(temp=58, state="exited"))  # a worker changed: a new generation
    assert path == "/v1/agents:heartbeat" and body["generation"].endswith("-2")
    rep.failed()  # a full report was lost or refused: the next one says everything again, same generation
    path, body = rep.next(_report(temp=58, state="exited"))
    assert path == "/v1/agents:heartbeat" and body["generation"].endswith("-2")


def test_reporter_sends_a_full_report_periodically_anyway():
    rep = Reporter(full_every_s=0.05)
    assert rep.next(_report())[0] == "/v1/agents:heartbeat"
    assert rep.next(_report())[0] == "/v1/agents:beat"
    time.sleep(0.06)
    assert rep.next(_report())[0] == "/v1/agents:heartbeat"


def test_two_agent_processes_never_share_a_generation():
    assert Reporter().next(_report())[1]["generation"] != Reporter().next(_report())[1]["generation"]


def test_store_answers_beats_from_memory_and_writes_them_in_batches(tmp_path):
    db = tmp_path / "c.db"
    s = Store(db)
    hb = {**_report(), "generation": "abc-1", "health": {"degraded": False, "reasons": []}}
    s.heartbeat(copy.deepcopy(hb))
    assert not s.beat("gpu-1", "abc-0") and not s.beat("gpu-2", "abc-1")  # unknown: resync
    time.sleep(0.2)
    assert s.beat("gpu-1", "abc-1")
    assert s.host("gpu-1").age_s < 0.1  # fresh in memory before any write
    assert Store(db).host("gpu-1").age_s >= 0.2  # ...and not yet in the database
    s.set_health("gpu-1", [{"index": 0, "ecc_uncorrected_volatile": 3}], {"degraded": True, "reasons": ["ecc"]})
    assert s.host("gpu-1").health["degraded"]
    assert s.flush() == 1 and s.flush() == 0
    again = Store(db)  # a restarted coordinator
    h = again.host("gpu-1")
    assert h.age_s < 0.15 and h.health == {"degraded": True, "reasons": ["ecc"]}
    assert again.beat("gpu-1", "abc-1"), "a restarted coordinator knows the last full report: no resync storm"
    assert not again.beat("gpu-1", "abc-0")
    s.heartbeat({**copy.deepcopy(hb), "generation": None})  # an agent that does not beat: no generation
    assert not s.beat("gpu-1", "abc-1")


def _beats(c: LocalCluster) -> dict[str, float]:
    text = httpx.get(c.coordinator_url + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pitstop_coordinator_heartbeats_total{"):
            out[line.split('kind="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_agent_beats_and_resyncs_after_a_coordinator_restart():
    """Real agent, real coordinator: beats in the steady state; a restarted coordinator takes the
    beats of the generation it has on disk at once, and one whose database was lost asks for a
    full report (409 over HTTP, "resync" over UDP) and gets it."""
    with LocalCluster() as c:
        port = int(c.start_coordinator().rsplit(":", 1)[1])
        c.start_agent("host-a", env={"PITSTOP_AGENT_HEARTBEAT_S": "0.2"})
        deadline = time.monotonic() + 20
        while _beats(c).get("beat_udp", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        n = _beats(c)
        # over UDP; a beat whose answer is late on a busy machine falls back to HTTP now and then
        assert n.get("full", 0) >= 1 and n.get("beat_udp", 0) >= 5 and n.get("beat", 0) < n["beat_udp"], n
        from pitstop.wire.coordinator_client import CoordinatorClient

        for lose_db, fulls in ((False, 0), (True, 1)):
            c.coordinator_proc.terminate()
            c.coordinator_proc.wait(10)
            if lose_db:
                for p in c.coordinator_db.parent.glob(c.coordinator_db.name + "*"):
                    p.unlink()
            c.start_coordinator(port=port)
            cc = CoordinatorClient(c.coordinator_url, c.operator_token)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                n = _beats(c)
                if n.get("beat_udp", 0) >= 3 and n.get("full", 0) >= fulls:
                    break
                time.sleep(0.2)
            assert n.get("beat_udp", 0) >= 3 and n.get("full", 0) == fulls, (lose_db, n)
            (h,) = [h for h in cc.hosts() if h["name"] == "host-a"]
            assert h["age_s"] < 2.0


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_agent_beats_over_http_where_the_coordinator_takes_no_datagrams():
    with LocalCluster() as c:
        c.start_coordinator(env={"PITSTOP_COORDINATOR_BEAT_UDP": "0"})
        c.start_agent("host-a", env={"PITSTOP_AGENT_HEARTBEAT_S": "0.2"})
        deadline = time.monotonic() + 20
        while _beats(c).get("beat", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        n = _beats(c)
        assert n.get("beat", 0) >= 5 and not n.get("beat_udp"), n


def test_datagram_beats_are_authenticated_and_never_replayed():

    from pitstop.wire.beats import ACK_OK, ACK_RESYNC, BeatDatagrams, decode_ack, encode_beat

    known = {"gpu-1": "g-1"}
    counted = []
    sent = []

    class T:
        def get_extra_info(self, name):
            return None

        def sendto(self, data, addr):
            sent.append(decode_ack(b"tok", data))

    p = BeatDatagrams(beat=lambda n, g: known.get(n) == g, token="tok", count=lambda: counted.append(1))
    p.connection_made(T())
    now = time.time()
    p.datagram_received(encode_beat(b"tok", 10, "gpu-1", "g-1", now), ("h", 1))
    assert sent == [(10, ACK_OK)] and counted == [1]
    p.datagram_received(encode_beat(b"tok", 10, "gpu-1", "g-1", now), ("h", 1))  # replayed
    p.datagram_received(encode_beat(b"other", 11, "gpu-1", "g-1", now), ("h", 1))  # wrong key
    p.datagram_received(encode_beat(b"tok", 12, "gpu-1", "g-1", now - 3600), ("h", 1))  # stale
    bad = bytearray(encode_beat(b"tok", 13, "gpu-1", "g-1", now))
    bad[20] ^= 1  # tampered
    p.datagram_received(bytes(bad), ("h", 1))
    p.datagram_received(b"garbage", ("h", 1))
    assert len(sent) == 1 and p.dropped == 5  # dropped without an answer
    p.datagram_received(encode_beat(b"tok", 14, "gpu-1", "g-0", now), ("h", 1))  # unknown generation
    assert sent[-1] == (14, ACK_RESYNC) and counted == [1]
    stopping = BeatDatagrams(beat=lambda n, g: None, token="tok", count=lambda: counted.append(1))
    stopping.connection_made(T())
    stopping.datagram_received(encode_beat(b"tok", 15, "gpu-1", "g-1", now), ("h", 1))
    # a coordinator that is stopping answers nothing: a "resync" from it would bring the agent's full
    # report, for nothing, to the coordinator after it (which has the last one on disk)
    assert len(sent) == 2 and stopping.dropped == 1 and counted == [1]


def test_udp_beat_without_an_answer_times_out():
    import asyncio
    import socket

    from pitstop.agent.heartbeat import UdpBeats

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        async def go():
            u = UdpBeats("127.0.0.1", silent.getsockname()[1], "tok")
            try:
                return await u.beat("gpu-1", "g-1", 0.2)
            finally:
                u.close()

        assert asyncio.run(go()) is None
    finally:
        silent.close()


def test_fast_path_answers_plain_beats_alone_and_hands_on_everything_else_intact():
    """A plain beat of a known generation never reaches FastAPI; anything else reaches it with
    its body unchanged (so errors and validation stay the route's)."""
    import asyncio
    import json as _json

    from pitstop.wire.beats import PATH, BeatFastPath

    seen_by_app = []

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen_by_app.append(body)
        await send({"type": "http.response.start", "status": 409, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    counted = []
    fast = BeatFastPath(app, beat=lambda n, g: g == "g-1", token="tok", count=lambda: counted.append(1))

    def call(body: bytes, token: bytes = b"tok", chunks: int = 1):
        parts = [body] if chunks == 1 else [body[:5], body[5:]]  # a body in two pieces
        msgs = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
        sent = []

        async def receive():
            return msgs.pop(0)

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "path": PATH, "method": "POST", "headers": [(b"authorization", b"Bearer " + token)]}
        asyncio.run(fast(scope, receive, send))
        return sent[0]["status"]

    plain = _json.dumps({"name": "gpu-1", "generation": "g-1"}).encode()
    assert call(plain) == 200 and call(plain, chunks=2) == 200 and seen_by_app == [] and len(counted) == 2
    others = [_json.dumps({"name": "gpu-1", "generation": "g-0"}).encode(),           # unknown generation
              _json.dumps({"name": "gpu-1", "generation": "g-1", "gpu_health": []}).encode(),  # readings
              b"not json"]
    for body in others:
        assert call(body) == 409
    assert call(plain, token=b"wrong") == 409  # a bad token is the route's to refuse
    assert seen_by_app == [*others, plain] and len(counted) == 2
