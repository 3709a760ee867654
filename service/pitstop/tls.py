"""Mutual TLS between pitstop's services, from a private CA.

Every service and client presents a certificate signed by the cluster's CA and checks the
other side's, so that a stolen cluster token alone no longer lets anyone act as an agent
or the coordinator on the network, and images (every byte of a worker's memory) never
cross the wire in clear.  Configured by three paths in the environment, the same names for
every process (each process its own certificate):

  PITSTOP_TLS_CA    the CA certificate (PEM) that every peer's certificate must chain to
  PITSTOP_TLS_CERT  this process's certificate (PEM), with its host names/addresses as SANs
  PITSTOP_TLS_KEY   its private key (PEM, 0600)

Without PITSTOP_TLS_CA, services speak plain HTTP (the bearer tokens still apply).
`pitstop pki init DIR` and `pitstop pki issue DIR NAME --role ROLE --san ...` make a CA and
certificates.  The agents' local Unix socket never uses TLS (SO_PEERCRED decides there).

Every certificate names one role (its subject's OU: pitstop-agent, pitstop-coordinator or
pitstop-operator), and each server admits only the roles its endpoints are for (agents'
peer API: agents and the coordinator; coordinator's agent endpoints: agents; its operator
API: operators).  So the certificate given to an operator's laptop cannot stream images or
act as an agent, and a compromised GPU host's certificate cannot start evacuations, even
where the bearer token leaked along with it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import threading
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from pitstop.errors import FailedPrecondition, Forbidden

ROLES = ("agent", "coordinator", "operator")
_OU_PREFIX = "pitstop-"
PEER_ROLE = "pitstop.peer_role"  # the ASGI scope key with_peer_role() fills in
PEER_NAME = "pitstop.peer_name"  # and the certificate subject's common name, who the peer is


def _paths() -> tuple[str | None, str | None, str | None]:
    return (os.environ.get("PITSTOP_TLS_CA") or None, os.environ.get("PITSTOP_TLS_CERT") or None,
            os.environ.get("PITSTOP_TLS_KEY") or None)


def enabled() -> bool:
    return _paths()[0] is not None


def scheme() -> str:
    return "https" if enabled() else "http"


def _check(paths: list[str | None], what: str) -> None:
    missing = [p for p in paths if not p or not Path(p).is_file()]
    if missing:
        raise FailedPrecondition(f"TLS is on (PITSTOP_TLS_CA is set) but {what} is missing: {missing}",
                                 code="tls_misconfigured",
                                 action="set PITSTOP_TLS_CA, PITSTOP_TLS_CERT and PITSTOP_TLS_KEY to readable PEM "
                                        "files (`pitstop pki issue`)")


_CONTEXTS: dict[tuple, ssl.SSLContext] = {}
_CONTEXTS_LOCK = threading.Lock()


def client_context() -> ssl.SSLContext:
    """What httpx's `verify=` takes: our CA and certificate when TLS is on, the default otherwise.

    Built once per set of files (their paths and mtimes: a renewed certificate is picked up)
    and shared.  Why: building one reads a CA bundle and costs about 24 ms of CPU, and httpx
    builds a fresh one for every client given `verify=True`.  An agent made a client per
    output poll of a moved worker, 10 a second, which took a quarter of a core per moved
    worker from the moves that followed (found with py-spy during a benchmark)."""
    ca, cert, key = _paths()
    files = [ca, cert, key] if ca else []
    if ca:
        _check(files, "this client's certificate")
    key_ = tuple((p, os.stat(p).st_mtime_ns) for p in files if p)
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(key_)
        if ctx is None:
            if ca:
                ctx = ssl.create_default_context(cafile=ca)
                ctx.load_cert_chain(cert, key)  # type: ignore[arg-type]
            else:
                import httpx

                ctx = httpx.create_ssl_context()
            _CONTEXTS.clear()  # only the current files' context is kept
            _CONTEXTS[key_] = ctx
        return ctx


def server_kwargs() -> dict[str, Any]:
    """uvicorn.Config arguments: serve TLS and require a client certificate from our CA."""
    ca, cert, key = _paths()
    if not ca:
        return {}
    _check([ca, cert, key], "this server's certificate")
    return {"ssl_certfile": cert, "ssl_keyfile": key, "ssl_ca_certs": ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}


# -- a private CA (pitstop pki) -------------------------------------------------------------------
def init_ca(directory: Path, name: str = "pitstop cluster CA", days: int = 3650) -> Path:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "ca.pem").exists():
        raise FailedPrecondition(f"{directory}/ca.pem already exists", code="ca_exists",
                                 action="use it, or remove the directory to start a new CA")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    _write_key(directory / "ca.key", key, serialization)
    (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return directory / "ca.pem"


def issue(directory: Path, name: str, sans: list[str], days: int = 365, role: str = "agent") -> tuple[Path, Path]:
    """A certificate for `name` in `role` (see ROLES) signed by the CA in directory."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if role not in ROLES:
        raise FailedPrecondition(f"unknown role {role!r}", code="unknown_role",
                                 action=f"use one of: {', '.join(ROLES)}")
    try:
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    except FileNotFoundError:
        raise FailedPrecondition(f"no CA in {directory}", code="no_ca",
                                 action=f"run `pitstop pki init {directory}` first") from None
    names: list[x509.GeneralName] = []
    for s in sans or [name]:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(s)))
        except ValueError:
            names.append(x509.DNSName(s))
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, _OU_PREFIX + role),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    crt, k = directory / f"{name}.pem", directory / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(k, key, serialization)
    return crt, k


def role_of(peercert: dict | None) -> str | None:
    """The pitstop role a verified peer certificate (ssl.getpeercert()) names, or None."""
    for rdn in (peercert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "organizationalUnitName" and v.startswith(_OU_PREFIX) and v[len(_OU_PREFIX):] in ROLES:
                return v[len(_OU_PREFIX):]
    return None


def name_of(peercert: dict | None) -> str | None:
    """The common name of a verified peer certificate's subject (`pitstop pki issue NAME`)."""
    for rdn in (peercert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return None


def with_peer_role(base: type) -> type:
    """uvicorn's HTTP protocol class, putting the TLS peer's role into each request's scope."""

    class PeerRole(base):  # type: ignore[misc, valid-type]
        _peer_role: str | None = None
        _peer_name: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            if ssl_object is not None:
                cert = ssl_object.getpeercert()
                self._peer_role, self._peer_name = role_of(cert), name_of(cert)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope[PEER_ROLE] = self._peer_role
            self.scope[PEER_NAME] = self._peer_name

    return PeerRole


def role_allowed(scope: MutableMapping[str, Any], allowed: tuple[str, ...]) -> bool:
    return not enabled() or scope.get(PEER_ROLE) in allowed


def require_role(scope: MutableMapping[str, Any], allowed: tuple[str, ...]) -> None:
    """With TLS on, refuse a peer whose certificate's role is not in `allowed` (403)."""
    if role_allowed(scope, allowed):
        return
    got = scope.get(PEER_ROLE)
    raise Forbidden(f"a certificate of role {got!r} may not call this" if got else
                    "the client certificate names no pitstop role", code="wrong_certificate_role",
                    action=f"use a certificate issued with `pitstop pki issue --role {allowed[0]}`"
                           + (f" (or {', '.join(allowed[1:])})" if len(allowed) > 1 else ""))


def http_protocol() -> type:
    """The HTTP protocol class for a TCP server: uvicorn's, plus the peer's role under TLS."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # uvicorn[standard] brings httptools

    return with_peer_role(HttpToolsProtocol)


def _write_key(path: Path, key: Any, serialization: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
