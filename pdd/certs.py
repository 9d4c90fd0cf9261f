"""`pdd certs`: a fleet's credentials in one folder (the ``cryptography`` library).

    pdd certs --out DIR --config FILE        one certificate per worker id and one for the router
    pdd certs --out DIR --name md0=198.51.100.21,md0.dc-b.example.net [--name ...]

What it writes (secrets mode 0600, the rest 0644; existing files are kept, so running it again
adds certificates signed by the same CA and never rotates a secret by accident):

    DIR/ca.crt  DIR/ca.key            the fleet CA (keep ca.key offline once the fleet is made)
    DIR/worker-token                  security.worker_token_file (gRPC, UCX KV, registration)
    DIR/api-keys                      router.api_keys_file: one admin key of tenant `default`
    DIR/NAME/tls.crt tls.key ca.crt   one process's certificate (server and client use),
                                      for security.grpc_tls and transfer.tls on its host

Every leaf certificate lists its names as DNS or IP SANs, plus ``localhost``, ``127.0.0.1``
and ``FLEET_NAME`` (set ``security.grpc_tls.server_name: pdd-fleet`` where the router dials
names no certificate lists, e.g. a Kubernetes Service). Keys are ECDSA P-256.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdd.errors import ConfigError

FLEET_NAME = "pdd-fleet"
DEFAULT_DAYS = 825
_WILDCARDS = {"0.0.0.0", "::", "", "auto"}


def _write(path: Path, data: bytes, secret: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdd"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def load_or_make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in ``out`` (made when absent)."""
    cert_path, key_path = out / "ca.crt", out / "ca.key"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key_path}: not an EC private key made by pdd certs")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("pdd fleet CA"))
        .issuer_name(_name("pdd fleet CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _pem_key(key), secret=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return cert, key


def _usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _sans(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys([*names, "localhost", "127.0.0.1", FLEET_NAME]):
        if n in _WILDCARDS:
            continue
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def make_leaf(out: Path, name: str, sans: list[str], days: int) -> Path:
    """``out/name/{tls.crt,tls.key,ca.crt}`` signed by the CA in ``out``; returns the folder."""
    ca_cert, ca_key = load_or_make_ca(out, days)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(ca=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_sans(sans)), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    folder = out / name
    folder.mkdir(mode=0o755, exist_ok=True)
    _write(folder / "tls.key", _pem_key(key), secret=True)
    _write(folder / "tls.crt", cert.public_bytes(serialization.Encoding.PEM), secret=False)
    _write(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return folder


def make_secrets(out: Path) -> None:
    """``worker-token`` and ``api-keys`` (one admin key of tenant ``default``), when absent."""
    token = out / "worker-token"
    if not token.exists():
        _write(token, (secrets.token_urlsafe(32) + "\n").encode(), secret=True)
    keys = out / "api-keys"
    if not keys.exists():
        line = f"sk-pdd-{secrets.token_urlsafe(32)} tenant=default admin\n"
        _write(keys, ("# KEY [tenant=NAME] [admin] [rpm=N] [tpm=N]\n" + line).encode(), True)


def names_of_config(path: str) -> dict[str, list[str]]:
    """Certificate name -> SANs for every process of a pdd config."""
    from pdd.config import load_config

    cfg = load_config(path)
    names = {"router": [cfg.router.host]}
    for w in cfg.workers:
        names[w.id] = [w.id, w.host, w.advertise_host or "", w.kv_advertise_host or ""]
    return names


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd certs", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder to write (created)")
    p.add_argument("--config", help="pdd config: one certificate per worker id + router")
    p.add_argument(
        "--name", action="append", default=[], help="NAME=SAN,SAN...: one more certificate"
    )
    p.add_argument("--san", action="append", default=[], help="extra SAN on every certificate")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        names = names_of_config(args.config) if args.config else {}
        for item in args.name:
            name, _, sans = item.partition("=")
            if not name or "/" in name:
                raise ConfigError(f"--name {item!r}: expected NAME=SAN,SAN...")
            names[name] = [name, *[s for s in sans.split(",") if s]]
        if not names:
            raise ConfigError("nothing to make: give --config FILE or --name NAME=SANS")
        args.out.mkdir(mode=0o700, parents=True, exist_ok=True)
        make_secrets(args.out)
        for name, sans in names.items():
            folder = make_leaf(args.out, name, [*sans, *args.san], args.days)
            print(f"{folder}/tls.crt")
    except ConfigError as exc:
        print(f"pdd certs: {exc.message}", file=sys.stderr)
        return 2
    print(f"CA {args.out}/ca.crt, token {args.out}/worker-token, keys {args.out}/api-keys")
    return 0
