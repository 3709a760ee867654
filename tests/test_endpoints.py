"""Unit tests of what a listen address, a service URL and a host name may be (endpoints.py):
everything an operator writes in the documented forms is taken, and parsed the way the
services bind it."""

import pytest
from pydantic import TypeAdapter, ValidationError

from pitstop.endpoints import DataListenAddress, HostName, ListenAddress, ServiceURL, split_host_port


@pytest.mark.parametrize("value, parts", [
    ("0.0.0.0:7070", ("0.0.0.0", 7070)), ("127.0.0.1:1", ("127.0.0.1", 1)), (":7070", ("127.0.0.1", 7070)),
    ("[::]:7070", ("::", 7070)), ("[fe80::1]:65535", ("fe80::1", 65535)),
    ("gpu-17.cluster.local:7070", ("gpu-17.cluster.local", 7070)),
])
def test_documented_listen_forms_are_taken(value, parts):
    assert TypeAdapter(ListenAddress).validate_python(value) == value
    assert split_host_port(value) == parts


@pytest.mark.parametrize("value", ["7070", "host", "host:", "host:port", "[::1:7070", "::1:7070", "[zz::1]:7070",
                                   "host_x:7070", "-bad.example:7070", "127.0.0.1:0", "127.0.0.1:65536"])
def test_malformed_listen_addresses_are_refused(value):
    with pytest.raises(ValidationError):
        TypeAdapter(ListenAddress).validate_python(value)


def test_the_data_port_may_be_any_free_port():
    assert TypeAdapter(DataListenAddress).validate_python("0.0.0.0:0") == "0.0.0.0:0"


@pytest.mark.parametrize("kind, value, ok", [
    (ServiceURL, "http://coord:7000", True), (ServiceURL, "https://10.0.0.5:7000/", True),
    (ServiceURL, "http://[::1]:7000", True), (ServiceURL, "coord:7000", False), (ServiceURL, "ftp://coord", False),
    (ServiceURL, "http://", False), (ServiceURL, "http://coord:0", False),
    (HostName, "host-a", True), (HostName, "spare-1", True), (HostName, "gpu-17.cluster.local", True),
    (HostName, "a", True), (HostName, "n_1", True), (HostName, "", False), (HostName, "..", False),
    (HostName, "a/b", False), (HostName, ".hidden", False), (HostName, "x" * 64, False), (HostName, "a b", False),
])
def test_service_urls_and_host_names(kind, value, ok):
    if ok:
        assert TypeAdapter(kind).validate_python(value) == value
    else:
        with pytest.raises(ValidationError):
            TypeAdapter(kind).validate_python(value)
