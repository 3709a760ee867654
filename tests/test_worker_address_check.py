"""`POST /v1/networks` refuses an address the worker could not use on the uplink
(network/workerns.check_on_link), checked against a real link's addresses."""

from __future__ import annotations

import subprocess

import pytest

from pitstop.errors import InvalidRequest
from pitstop.network import workerns

pytestmark = pytest.mark.timeout(30)
LINK = "pstaddr0"


@pytest.fixture
def link():
    subprocess.run(["ip", "link", "add", LINK, "type", "veth", "peer", "name", LINK + "p"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", "10.251.7.1/24", "dev", LINK], check=True)
        yield LINK
    finally:
        subprocess.run(["ip", "link", "del", LINK], check=True)


def test_an_address_outside_the_uplinks_subnet_or_the_hosts_own_is_refused(link):
    with pytest.raises(InvalidRequest, match="not in a subnet of the uplink"):
        workerns.check_on_link(workerns.spec("j.0", "10.251.8.5/24"), link)
    with pytest.raises(InvalidRequest, match="not in a subnet"):  # right address, wrong prefix length
        workerns.check_on_link(workerns.spec("j.0", "10.251.7.5/16"), link)
    with pytest.raises(InvalidRequest, match="this host's own address"):
        workerns.check_on_link(workerns.spec("j.0", "10.251.7.1/24"), link)
    workerns.check_on_link(workerns.spec("j.0", "10.251.7.5/24"), link)  # a free address on the segment
