"""Transport security: a small CA for mutual TLS, and per-edge enrollment.

``fl-server certs init DIR`` makes the CA (ECDSA P-256), the server's certificate and an
empty enrollment list; ``fl-server certs issue DIR EDGE`` makes an edge's certificate
(common name = the stable edge id), its private key and a random enrollment token, in
``DIR/edges/EDGE/`` (what to copy to the device), and records the token's hash in
``DIR/enrolled.json``; ``fl-server certs revoke DIR EDGE`` marks it revoked. The server
accepts an edge only with a certificate of its CA whose common name is the edge id it
claims, and that edge's enrollment token; private keys and tokens are written 0600.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .state import StateError, atomic_write, atomic_write_json, read_json

CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
EDGE_CERT, EDGE_KEY, TOKEN = "edge.pem", "edge.key", "token"
ENROLLED = "enrolled.json"
VALID_DAYS = 825
MAX_CACHED_CERTIFICATES = 4096  # parsed peer certificates the server keeps (one per edge)
EDGE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # an edge id, whole (fullmatch)


def edge_id_refusal(edge_id: str) -> str:
    """'' for a valid edge id, else the reason (the id shown escaped and cut short). The
    one rule for ids everywhere: checked before an id reaches a log line, a metric label
    or the registry, so an id can neither forge a log line nor grow memory."""
    if EDGE_ID.fullmatch(edge_id):
        return ""
    shown = repr(edge_id[:64]) + ("..." if len(edge_id) > 64 else "")
    return f"edge id {shown} is not valid (letters, digits, . _ -; at most 64)"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedattn"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: x509.Certificate | None, issuer_key,
                 ca: bool = False, sans: list[x509.GeneralName] | None = None,
                 usage: list | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject))
               .issuer_name(issuer.subject if issuer else _name(subject))
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                              critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def init_ca(directory: Path, hosts: list[str] | None = None) -> None:
    """The CA, the server's certificate for ``hosts`` and an empty enrollment list."""
    directory = Path(directory)
    if (directory / CA_KEY).exists():
        raise StateError(f"{directory} already holds a CA; issue edge certificates with it")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    hosts = hosts or ["localhost", "127.0.0.1", socket.gethostname()]
    ca_key = _key()
    ca = _certificate("fedattn CA", ca_key, None, ca_key, ca=True)
    server_key = _key()
    server = _certificate(hosts[0], server_key, ca, ca_key,
                          sans=[_san(h) for h in dict.fromkeys(hosts)],
                          usage=[ExtendedKeyUsageOID.SERVER_AUTH])
    atomic_write(directory / CA_KEY, _pem_key(ca_key), mode=0o600)
    atomic_write(directory / CA_CERT, _pem(ca), mode=0o644)
    atomic_write(directory / SERVER_KEY, _pem_key(server_key), mode=0o600)
    atomic_write(directory / SERVER_CERT, _pem(server), mode=0o644)
    atomic_write_json(directory / ENROLLED, {}, mode=0o600)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        ca = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    except (OSError, ValueError) as err:
        raise StateError(f"{directory}: no usable CA ({err}); run `fl-server certs init`") from None
    return ca, key


def issue_edge(directory: Path, edge_id: str) -> Path:
    """An edge's certificate, key and enrollment token in DIR/edges/EDGE (copy that folder
    to the device and pass it as ``fl-edge --tls-dir``)."""
    directory = Path(directory)
    refusal = edge_id_refusal(edge_id)
    if refusal:
        raise StateError(refusal)
    ca, ca_key = _load_ca(directory)
    enrolled = read_json(directory / ENROLLED)
    if edge_id in enrolled and not enrolled[edge_id].get("revoked"):
        raise StateError(f"edge {edge_id} is already enrolled; revoke it first to re-issue")
    key = _key()
    cert = _certificate(edge_id, key, ca, ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    token = secrets.token_hex(32)
    out = directory / "edges" / edge_id
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    atomic_write(out / EDGE_KEY, _pem_key(key), mode=0o600)
    atomic_write(out / EDGE_CERT, _pem(cert), mode=0o644)
    atomic_write(out / CA_CERT, _pem(ca), mode=0o644)
    atomic_write(out / TOKEN, token.encode(), mode=0o600)
    enrolled[edge_id] = {"token_sha256": hashlib.sha256(token.encode()).hexdigest(),
                         "serial": format(cert.serial_number, "x"), "revoked": False}
    atomic_write_json(directory / ENROLLED, enrolled, mode=0o600)
    return out


def revoke_edge(directory: Path, edge_id: str) -> None:
    enrolled = read_json(Path(directory) / ENROLLED)
    if edge_id not in enrolled:
        raise StateError(f"edge {edge_id} is not enrolled")
    enrolled[edge_id]["revoked"] = True
    atomic_write_json(Path(directory) / ENROLLED, enrolled, mode=0o600)


@dataclass
class Enrollment:
    """The server's view of DIR/enrolled.json, re-read when the file changes (a revocation
    takes effect at the edge's next call, without a restart).

    An edge is its certificate, not its name: every call's peer certificate must be the
    one the list names for the id (its serial), so a revoked device cannot go on with its
    old certificate once the id has been re-issued to another."""

    path: Path
    _mtime: int = -1
    _entries: dict | None = None
    _serials: dict[bytes, str] = field(default_factory=dict)  # peer PEM -> serial (hex)

    def entries(self) -> dict:
        mtime = self.path.stat().st_mtime_ns
        if mtime != self._mtime:
            self._entries, self._mtime = read_json(self.path), mtime
        return self._entries or {}

    def changed(self) -> bool:
        """Whether the file changed since it was last read (then it is read again)."""
        before = self._mtime
        self.entries()
        return self._mtime != before

    def serial(self, edge_id: str) -> str:
        """The enrolled certificate serial of ``edge_id`` ('' when not enrolled)."""
        return str(self.entries().get(edge_id, {}).get("serial", ""))

    def peer_serial(self, pem: bytes) -> str:
        """The serial of a peer certificate (hex, as enrolled.json records it); parsed
        once per certificate."""
        serial = self._serials.get(pem)
        if serial is None:
            if len(self._serials) >= MAX_CACHED_CERTIFICATES:
                self._serials.clear()
            serial = format(x509.load_pem_x509_certificate(pem).serial_number, "x")
            self._serials[pem] = serial
        return serial

    def check(self, edge_id: str, token: str | None = None, serial: str | None = None) -> str:
        """'' when the edge may proceed, else the reason to refuse it. ``serial``: the
        peer certificate's, which must be the one enrolled for the id."""
        entry = self.entries().get(edge_id)
        if entry is None:
            return f"edge {edge_id} is not enrolled"
        if entry.get("revoked"):
            return f"edge {edge_id} is revoked"
        if serial is not None and serial != entry.get("serial"):
            return (f"edge {edge_id}: the client certificate (serial {serial}) is not the one "
                    "enrolled for this id (revoked and re-issued to another device?)")
        if token is not None and not hmac.compare_digest(
                hashlib.sha256(token.encode()).hexdigest(), entry["token_sha256"]):
            return f"edge {edge_id}: wrong enrollment token"
        return ""


def server_credentials(directory: Path):
    import grpc

    directory = Path(directory)
    try:
        return grpc.ssl_server_credentials(
            [((directory / SERVER_KEY).read_bytes(), (directory / SERVER_CERT).read_bytes())],
            root_certificates=(directory / CA_CERT).read_bytes(), require_client_auth=True)
    except OSError as err:
        raise StateError(f"--tls-dir {directory}: {err}; run `fl-server certs init`") from None


def edge_credentials(directory: Path) -> tuple[object, str, str]:
    """(channel credentials, enrollment token, the certificate's edge id)."""
    import grpc

    directory = Path(directory)
    try:
        cert_pem = (directory / EDGE_CERT).read_bytes()
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(directory / CA_CERT).read_bytes(),
            private_key=(directory / EDGE_KEY).read_bytes(), certificate_chain=cert_pem)
        token = (directory / TOKEN).read_text().strip()
    except OSError as err:
        raise StateError(f"--tls-dir {directory}: {err} (copy the folder `fl-server certs "
                         "issue` wrote)") from None
    cert = x509.load_pem_x509_certificate(cert_pem)
    edge_id = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    return credentials, token, str(edge_id)
