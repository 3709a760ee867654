"""A network namespace per worker, with an address and MAC that move with the worker.

Why: every torch.distributed job holds TCP connections that cross the dump (the
TCPStore, gloo's pairs, whatever else the program opened).  CRIU can only restore a
connection whose local address exists where it restores.  So a worker started with
`pitstop run --address A/P` lives in its own network namespace whose only link is a
macvlan on the host's uplink, carrying address A and a MAC derived from it.  The
peers' view never changes: same address, same MAC; a move is, for the network, a
station that went quiet and came back on another switch port (announced with a
gratuitous ARP).  This is how container live migration keeps connections, and it
needs the source and destination hosts on one L2 segment (see docs/architecture.md
for the routed alternative and what it means for RDMA and Kubernetes).

While a worker moves, its whole namespace is locked by an nftables table that drops
every packet except loopback: what CRIU's own lock does for a namespace it owns.  A
namespace is created locked at the destination, so a peer's retransmission can never
meet an address with no socket behind it (which would answer with a reset).

Known property of macvlan: a worker cannot reach its own host's addresses through
the uplink (it reaches every other station, including workers on the same host).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import subprocess
import sys
import zlib
from dataclasses import asdict, dataclass

from pitstop.errors import FailedPrecondition, InvalidRequest, PitstopError

IP_TIMEOUT_S = 30  # one `ip` or `nft` command: they answer in milliseconds unless the kernel is stuck
IP_QUERY_TIMEOUT_S = 10  # one `ip ... show` read

LOCK_TABLE = "pitstop_move_lock"
LINK_IN_NS = "eth0"


class NetworkError(PitstopError):
    http_status = 500
    code = "worker_network_failed"


@dataclass
class WorkerNet:
    address: str  # "10.1.2.50/24": the worker's address and its L2 subnet
    mac: str
    netns: str    # name under /run/netns

    @property
    def ip(self) -> str:
        return self.address.split("/")[0]

    @property
    def path(self) -> str:
        return f"/run/netns/{self.netns}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def spec(worker_id: str, address: str) -> WorkerNet:
    """Validate an operator's address ("A.B.C.D/P") and derive the namespace name and MAC."""
    try:
        iface = ipaddress.IPv4Interface(address)
    except ValueError:
        raise InvalidRequest(f"worker address {address!r} is not an IPv4 address with a prefix length",
                             action="pass --address like 10.1.2.50/24 (the uplink's subnet)") from None
    if iface.network.prefixlen == 32 or iface.ip in (iface.network.network_address,
                                                     iface.network.broadcast_address):
        raise InvalidRequest(f"{address} is not a usable host address in its subnet",
                             action="pick a free host address inside the uplink's subnet")
    o = iface.ip.packed
    mac = "02:50:" + ":".join(f"{b:02x}" for b in o)  # locally administered, one per address
    return WorkerNet(str(iface), mac, netns_name(worker_id))


NETNS_PREFIX = "pitstop-w-"
NETNS_PREFIX_ENV = "PITSTOP_WORKER_NETNS_PREFIX"
"""Where several clusters share one machine's namespaces (local clusters side by side: the test
suite's parallel workers), each names its workers' namespaces under a prefix of its own, which
must begin with NETNS_PREFIX; a host runs one agent, and uses NETNS_PREFIX."""


def netns_prefix() -> str:
    p = os.environ.get(NETNS_PREFIX_ENV, "")
    return p if p.startswith(NETNS_PREFIX) and re.fullmatch(r"[A-Za-z0-9_-]{1,40}", p) else NETNS_PREFIX


def netns_name(worker_id: str) -> str:
    """The namespace of exactly this worker id: a readable part, and a digest of the whole id, so
    that no other id ("a-0" for "a.0", a long job name cut short) ever names the same namespace."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "-", worker_id)[:32]
    return f"{netns_prefix()}{readable}-{hashlib.blake2b(worker_id.encode(), digest_size=5).hexdigest()}"


def from_dict(d: dict | None) -> WorkerNet | None:
    return WorkerNet(**d) if d else None


def _run(args: list[str], what: str, input_: str | None = None, timeout: float = 30) -> str:
    p = subprocess.run(args, capture_output=True, text=True, input=input_, timeout=timeout)
    if p.returncode != 0:
        raise NetworkError(f"{what}: `{' '.join(args[:6])}...` failed: {p.stderr.strip() or p.stdout.strip()}",
                           action="check the host's network configuration (pitstop doctor)")
    return p.stdout


def _in(n: WorkerNet) -> list[str]:
    return ["nsenter", f"--net={n.path}", "--"]


def default_link() -> str | None:
    """The link of this namespace's default route: the uplink workers hang off by default."""
    try:
        out = subprocess.run(["ip", "-j", "route", "show", "default"], capture_output=True, text=True,
                             timeout=IP_QUERY_TIMEOUT_S).stdout
        routes = json.loads(out or "[]")
        return routes[0].get("dev") if routes else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def check_on_link(n: WorkerNet, link: str | None) -> None:
    """Refuse an address outside every subnet of the uplink, or one the host itself holds: the
    worker would be unreachable, or would take over the host's own address on the segment."""
    link = link or default_link()
    if not link:
        return  # create() says what is wrong
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", link], capture_output=True, text=True,
                             timeout=IP_QUERY_TIMEOUT_S).stdout
        held = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}")
                for i in json.loads(out or "[]") for a in i.get("addr_info", [])]
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return
    mine = ipaddress.ip_interface(n.address)
    if any(h.ip == mine.ip for h in held):
        raise InvalidRequest(f"{mine.ip} is this host's own address on {link}",
                             action="give the worker a free address of its own")
    if held and not any(h.network == mine.network for h in held):
        raise InvalidRequest(f"{n.address} is not in a subnet of the uplink {link} "
                             f"({', '.join(str(h.network) for h in held)})",
                             action="pick a free host address inside the uplink's subnet, with its prefix length")


def exists(n: WorkerNet) -> bool:
    return os.path.exists(n.path)


def create(n: WorkerNet, link: str | None, *, locked: bool, nft: str | None) -> None:
    """Make the namespace with its macvlan on `link` (this host's uplink); locked if asked."""
    link = link or default_link()
    if not link:
        raise FailedPrecondition("this agent has no uplink for worker addresses (no default route)",
                                 code="no_worker_link", action="start the agent with --worker-link IFACE")
    if exists(n):
        raise FailedPrecondition(f"worker namespace {n.netns} already exists on this host",
                                 code="worker_network_exists",
                                 action="the address is in use here; move the other worker or pick another")
    tmp = "pw" + format(zlib.crc32(n.netns.encode()), "08x")
    _run(["ip", "netns", "add", n.netns], "create the worker's network namespace")
    try:
        if locked:
            lock(n, nft)
        _run(["ip", "link", "add", tmp, "link", link, "address", n.mac, "type", "macvlan", "mode", "bridge"],
             f"create a macvlan on {link}")
        _run(["ip", "link", "set", tmp, "netns", n.netns], "move the macvlan into the worker's namespace")
        for args in (["link", "set", tmp, "name", LINK_IN_NS], ["addr", "add", n.address, "dev", LINK_IN_NS],
                     ["link", "set", LINK_IN_NS, "up"], ["link", "set", "lo", "up"]):
            _run(["ip", "-n", n.netns, *args], "configure the worker's namespace")
    except PitstopError:
        subprocess.run(["ip", "link", "del", tmp], capture_output=True)
        destroy(n)
        raise


def destroy(n: WorkerNet) -> None:
    """Remove the namespace (and with it the macvlan and the address); no-op if gone.

    The link goes first: a namespace lives on while a process is in it (a released source
    still exiting), and its address must leave the segment now, not when that exit ends."""
    if exists(n):
        subprocess.run(["ip", "-n", n.netns, "link", "del", LINK_IN_NS], capture_output=True, timeout=IP_TIMEOUT_S)
        subprocess.run(["ip", "netns", "delete", n.netns], capture_output=True, timeout=IP_TIMEOUT_S)


def lock(n: WorkerNet, nft: str | None) -> None:
    """Drop every packet in and out of the namespace except loopback (idempotent)."""
    if not nft:
        raise FailedPrecondition("nft is needed to lock a worker's network during a move", code="no_nft",
                                 action="run `pitstop provision-criu` (it provides nft) or install nftables")
    rules = (f"table inet {LOCK_TABLE} {{\n"
             "  chain in { type filter hook input priority -300; policy drop; iif lo accept; }\n"
             "  chain out { type filter hook output priority -300; policy drop; oif lo accept; }\n}\n")
    subprocess.run([*_in(n), nft, "delete", "table", "inet", LOCK_TABLE], capture_output=True, timeout=IP_TIMEOUT_S)
    _run([*_in(n), nft, "-f", "-"], "lock the worker's network", input_=rules)


def unlock(n: WorkerNet, nft: str | None) -> None:
    if nft and exists(n):
        subprocess.run([*_in(n), nft, "delete", "table", "inet", LOCK_TABLE], capture_output=True, timeout=IP_TIMEOUT_S)


def reset_unrelated(n: WorkerNet, keep: list[str]) -> int:
    """Abort every TCP connection whose peer is not one of `keep` (nor this worker, nor loopback).

    The program sees an ordinary ECONNABORTED/ECONNRESET on its next use of the socket, as
    with CRIU's --tcp-close, and never a hang; the remote end gets a reset on its next send.
    """
    peers = sorted({*keep, n.ip} - {""})
    allowed = " or ".join(["dst 127.0.0.0/8"] + [f"dst {p}" for p in peers])
    killed = _run([*_in(n), "ss", "-K", "-H", "-t", "-n", "state", "connected", f"not ( {allowed} )"],
                  "reset the worker's unrelated connections")  # prints each socket it aborted
    return len([ln for ln in killed.splitlines() if ln.strip()])


_GARP = r"""
import socket, struct, sys
ip, mac = sys.argv[1], bytes.fromhex(sys.argv[2].replace(":", ""))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[3], 0))
a = socket.inet_aton(ip)
for op in (1, 2):  # a gratuitous request and reply: switches and neighbours both learn
    s.send(b"\xff" * 6 + mac + b"\x08\x06" + struct.pack("!HHBBH", 1, 0x0800, 6, 4, op) + mac + a + b"\xff" * 6 + a)
"""


def announce(n: WorkerNet) -> None:
    """Gratuitous ARP from the worker's new port, so the L2 segment learns where it went."""
    _run([*_in(n), sys.executable, "-c", _GARP, n.ip, n.mac, LINK_IN_NS], "announce the worker's address")


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def path_inode(n: WorkerNet) -> int:
    return os.stat(n.path).st_ino
