"""Security section: the credential between the router and its workers, TLS on their gRPC links.

    security:
      worker_token_file: /etc/pdd/worker-token   # or `auto` under `pdd serve`
      grpc_tls: {enabled: true, cert_file: ..., key_file: ..., ca_file: ..., mutual: true}

The worker token is one shared secret: every worker's gRPC server refuses a call that does not
carry it (UNAUTHENTICATED), the router sends it on every call, and the UCX KV receivers refuse
a sender that cannot prove it holds it. Only the file's path is ever logged or served (the
effective config); the secret itself is read by ``worker_token()`` at start. ``auto`` asks
`pdd serve` to generate one per run (a 0600 file in its run folder) and hand its path to every
child; a process started on its own needs a real file.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from pydantic import Field, model_validator

from pdd.config.base import Section
from pdd.errors import ConfigError

AUTO = "auto"
MIN_TOKEN_CHARS = 16


class SecretCheck:
    """Checks presented bytes against one secret in constant time, length included (it
    compares SHA-256 digests). Used wherever the worker token is presented: gRPC calls
    (``pdd.worker.auth``) and fleet registration (``pdd.router.fleet.registry``)."""

    def __init__(self, secret: bytes):
        self._digest = hashlib.sha256(secret).digest()

    def matches(self, presented: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(presented).digest(), self._digest)


class GrpcTlsConfig(Section):
    """TLS (optionally mutual) on the router <-> worker gRPC channels; same files style as
    ``transfer.tls``: one CA signs every process's certificate."""

    enabled: bool = Field(False, description="Encrypt router <-> worker gRPC with TLS.")
    cert_file: str | None = Field(
        None, description="PEM certificate of this process (worker: server, router: client)."
    )
    key_file: str | None = Field(None, description="PEM private key of this process.")
    ca_file: str | None = Field(
        None, description="PEM CA that signed every peer's certificate; others are refused."
    )
    mutual: bool = Field(
        True, description="Workers require a client certificate from the CA (mutual TLS)."
    )
    server_name: str | None = Field(
        None,
        description="Name the router expects in worker certificates (their CN or a DNS SAN); "
        "null: the address it dials, which the certificate must then list.",
    )

    @model_validator(mode="after")
    def _files(self) -> GrpcTlsConfig:
        if self.enabled and not (self.cert_file and self.key_file and self.ca_file):
            raise ValueError("grpc_tls.enabled needs cert_file, key_file and ca_file")
        return self

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA) as PEM bytes; ConfigError naming the file."""
        assert self.cert_file and self.key_file and self.ca_file  # checked by the validator
        key = "security.grpc_tls"
        return _read(self.cert_file, key), _read(self.key_file, key), _read(self.ca_file, key)


class SecurityConfig(Section):
    """Credentials between pdd's own processes (client API keys are ``router.api_keys_file``)."""

    worker_token_file: str | None = Field(
        None,
        description="File holding the shared worker token (one line, at least 16 printable "
        "characters). Workers refuse gRPC calls and UCX KV senders without it. `auto`: `pdd "
        "serve` generates one per run. null: no worker authentication.",
    )
    grpc_tls: GrpcTlsConfig = Field(
        default_factory=GrpcTlsConfig, description="TLS on router <-> worker gRPC."
    )
    auto_credentials: bool = Field(
        False,
        description="`pdd serve` only: make a worker token (when worker_token_file is null), "
        "a CA and one certificate for this run in its run folder, and turn grpc_tls and "
        "transfer.tls on with them in the effective config (`pdd certs` makes a fleet's).",
    )
    insecure: bool = Field(
        False,
        description="Start even when a process listening beyond loopback lacks its "
        "credentials (API keys, worker token, TLS); it warns on every start and /health says "
        "`insecure`. Off: such a process refuses to start (pdd.config.exposure).",
    )

    def worker_token(self) -> bytes | None:
        """The token's bytes (None when off). Raises ConfigError when the file is missing,
        empty, too short, not printable ASCII, or still ``auto`` (only `pdd serve` fills it)."""
        path = self.worker_token_file
        if path is None:
            return None
        if path == AUTO:
            raise ConfigError(
                "security.worker_token_file: `auto` is resolved by `pdd serve`; a process "
                "started on its own needs the path of a token file"
            )
        token = _read(path, "security.worker_token_file").strip()
        if len(token) < MIN_TOKEN_CHARS or not all(33 <= b < 127 for b in token):
            raise ConfigError(
                f"security.worker_token_file {path}: the token must be one line of at least "
                f"{MIN_TOKEN_CHARS} printable, non-space ASCII characters"
            )
        return token


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
