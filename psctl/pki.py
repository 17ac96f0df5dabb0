"""A certificate authority per cluster, and a certificate per role, for mutual TLS between roles.

Created at ``psctl up`` under the cluster's folder (``tls/``, mode 0700; keys 0600) with the ``cryptography``
package (already a dependency of paramiko). Every gRPC server of the cluster requires a client certificate
signed by the cluster's CA, so nothing outside the cluster — another cluster included — can push a gradient,
read a variable or send a heartbeat. Certificates are short-lived and deleted by ``psctl down --purge``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path, PurePath

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from psctl.runtime.cluster import TlsFiles
from psctl.runtime.rpc import TLS_SERVER_NAME

#: A cluster's certificates, made at each ``up`` by a CA of its own whose key is discarded, serve that cluster
#: only, for as long as it may train: a week was shorter than long runs, whose roles could then neither restart
#: nor reconnect (every handshake refused the expired certificates).
VALIDITY = dt.timedelta(days=365)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _names(addresses: str | Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(TLS_SERVER_NAME)]
    for address in dict.fromkeys([addresses] if isinstance(addresses, str) else addresses):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        except ValueError:
            names.append(x509.DNSName(address))
    return names


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    address: str | Sequence[str],
    *,
    not_before: dt.datetime | None = None,
    validity: dt.timedelta = VALIDITY,
) -> tuple[bytes, bytes]:
    """A key and a certificate (PEM) for one role, valid as server and as client, naming every address the role
    may listen on (a worker's whole pool)."""
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + validity)
        .add_extension(x509.SubjectAlternativeName(_names(address)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def new_ca(cluster_id: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"psctl CA {cluster_id}")])
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def create_cluster_pki(
    directory: Path, cluster_id: str, members: Sequence[tuple[str, str | Sequence[str]]]
) -> dict[str, TlsFiles]:
    """CA plus one certificate per member ``(name, address or addresses)``; returns each member's files."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    ca_key, ca_cert = new_ca(cluster_id)
    ca_path = directory / "ca.pem"
    _write(ca_path, ca_cert.public_bytes(serialization.Encoding.PEM))
    # The CA's key is not kept: once every member has its certificate nothing needs it, and a stolen copy
    # could mint members.
    files: dict[str, TlsFiles] = {}
    for name, address in members:
        key_pem, cert_pem = issue(ca_key, ca_cert, name, address)
        _write(directory / f"{name}.key", key_pem)
        _write(directory / f"{name}.pem", cert_pem)
        files[name] = member_files(directory, name)
    return files


def member_files(directory: PurePath, name: str) -> TlsFiles:
    return TlsFiles(
        ca=str(directory / "ca.pem"), cert=str(directory / f"{name}.pem"), key=str(directory / f"{name}.key")
    )
