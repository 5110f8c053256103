"""Test certificates made with `cryptography`: a CA, and leaf certificates it signs (for 127.0.0.1 and
localhost, usable as server and as client certificates)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: str, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertFiles:
    files = CertFiles(os.path.join(directory, f"{stem}.pem"), os.path.join(directory, f"{stem}.key"))
    with open(files.cert, "wb") as out:
        out.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(files.key, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return files


def make_ca(
    directory: str, stem: str = "ca"
) -> tuple[CertFiles, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"deltaserve test {stem}"))
        .issuer_name(_name(f"deltaserve test {stem}"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _write(directory, stem, cert, key), cert, key


def make_leaf(
    directory: str, stem: str, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey
) -> CertFiles:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _write(directory, stem, cert, key)


@dataclass(frozen=True)
class Pki:
    ca: CertFiles
    server: CertFiles
    client: CertFiles
    other_ca: CertFiles  # a CA that signed nothing here: trusting it alone fails the handshake


def make_pki(directory: str) -> Pki:
    ca, ca_cert, ca_key = make_ca(directory)
    other, _, _ = make_ca(directory, "other-ca")
    return Pki(
        ca,
        make_leaf(directory, "server", ca_cert, ca_key),
        make_leaf(directory, "client", ca_cert, ca_key),
        other,
    )
