"""Hosts with their own addresses on one machine: a network namespace per host on a bridge.

For tests, the demo and benches only.  Names are random per cluster so that runs
never collide; close() removes every namespace and link it made, and a lease
(dev/devleases.py) lets the next run remove them where this one was killed.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass, field

from pitstop.dev import devleases


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def _free_subnet() -> int:
    """A 10.213.N.0/24 that no interface here has: a bridge another run left behind (a killed
    run cannot clean up) would otherwise take the routes, and the hosts could not reach each
    other.  Random among the free ones, so that two runs starting together rarely pick alike."""
    p = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    taken = {int(x.split(".")[2]) for x in p.stdout.split() if x.startswith("10.213.") and x.count(".") == 3}
    free = [n for n in range(*devleases.in_share(20, 220)) if n not in taken]  # this run's part
    if not free:
        raise RuntimeError("every 10.213.N.0/24 of this run's share of 20-219 is in use here: remove the pst*br bridges "
                           "that earlier runs left (`ip -br link | grep pst`)")
    return secrets.choice(free)


@dataclass
class NetHosts:
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: int = field(default_factory=_free_subnet)
    hosts: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (netns, address)
    up: bool = False

    @property
    def bridge(self) -> str:
        return f"pst{self.tag}br"

    @property
    def gateway(self) -> str:
        return f"10.213.{self.subnet}.1"

    def setup(self) -> None:
        if self.up:
            return
        devleases.take(f"net-{self.tag}", netns_prefix=f"pst-{self.tag}-", links=[self.bridge])
        _ip("link", "add", self.bridge, "type", "bridge")
        self.up = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> tuple[str, str]:
        """Host `name`'s namespace and address; one it has already (an agent restarted there) is kept."""
        if name in self.hosts:
            return self.hosts[name]
        self.setup()
        i = len(self.hosts) + 1
        ns, addr, veth = f"pst-{self.tag}-{name}", f"10.213.{self.subnet}.{10 + i}", f"pst{self.tag}v{i}"
        _ip("netns", "add", ns)
        self.hosts[name] = (ns, addr)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return ns, addr

    def shape(self, name: str, mbit: float | None) -> None:
        """Make the link into host `name` a slower one (a token bucket on the bridge's side of its
        veth: everything sent to it, from the other hosts or from this namespace, passes it), as a
        data-centre link slower than this machine's memory would be; None: back to unlimited.
        Benches and tests of what depends on the link's speed use it (transfer/compress.py)."""
        veth = f"pst{self.tag}v{list(self.hosts).index(name) + 1}"
        subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True)
        if mbit is not None:
            burst = max(64 << 10, int(mbit * 1e6 / 8 / 250))  # 4 ms of the rate: the kernel's timer tick allows it
            p = subprocess.run(["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{mbit}mbit",
                                "burst", str(burst), "latency", "50ms"], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"tc tbf on {veth}: {p.stderr.strip()}")

    def cut(self, name: str, up: bool = False) -> None:
        """Take host `name` off the segment (its link down on the bridge's side), as a host that
        lost power or its network would be; up=True puts it back (a partition that heals)."""
        veth = f"pst{self.tag}v{list(self.hosts).index(name) + 1}"
        _ip("link", "set", veth, "up" if up else "down")

    def exec_prefix(self, name: str) -> list[str]:
        # Not `ip netns exec`: it also makes a new mount namespace per command, so a worker and
        # the agent's CRIU would live in different ones and CRIU would try to dump mounts.
        return ["nsenter", f"--net=/run/netns/{self.hosts[name][0]}", "--"]

    def close(self) -> None:
        for ns, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.hosts.clear()
        if self.up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            devleases.drop(f"net-{self.tag}")
            self.up = False
