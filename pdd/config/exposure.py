"""Fail closed: a process that listens beyond loopback needs its credentials, or it refuses to
start (``ConfigError`` naming each missing one). ``security.insecure: true`` lets it start
anyway; it then logs a warning on every start and reports ``insecure`` (with what is missing)
in its ``/health``.

    router   binds router.host: clients need API keys (router.api_keys_file or $PDD_API_KEY);
             it dials workers at non-loopback addresses (or admits registered / discovered
             ones): the worker token and gRPC TLS
    worker   binds its host (gRPC, KV receiver): the worker token (gRPC calls, UCX KV
             senders, registration) and gRPC TLS; prefill and main_decode also need
             transfer.tls (the P -> MD KV streams cross the WAN)

Loopback binds (127.0.0.0/8, ::1, localhost) need nothing: one host's `pdd serve` stays
zero-config. Pure: reads the config (and the environment it is given), never a file; the
files themselves are read, and checked, where they are used.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping

from pdd.config import PddConfig, WorkerConfig
from pdd.errors import ConfigError
from pdd.protocol import Role

log = logging.getLogger(__name__)

API_KEY_ENV = "PDD_API_KEY"
_TOKEN = "the worker token (security.worker_token_file)"
_GRPC_TLS = "gRPC TLS (security.grpc_tls)"
_KV_TLS = "KV TLS (transfer.tls)"
_KEYS = f"API keys (router.api_keys_file or ${API_KEY_ENV})"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (a wildcard is not)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a DNS name: assume it is reachable from elsewhere


def _plane(cfg: PddConfig) -> list[str]:
    missing = []
    if cfg.security.worker_token_file is None:
        missing.append(_TOKEN)
    if not cfg.security.grpc_tls.enabled:
        missing.append(_GRPC_TLS)
    return missing


def router_missing(cfg: PddConfig, environ: Mapping[str, str]) -> list[str]:
    """The credentials the router lacks for where it listens and whom it dials."""
    missing = []
    if not is_loopback(cfg.router.host):
        if cfg.router.api_keys_file is None and not environ.get(API_KEY_ENV, "").strip():
            missing.append(_KEYS)
    fleet = cfg.router.fleet
    remote = [w.id for w in cfg.workers if not is_loopback(w.advertise_host or w.host)]
    if remote or fleet.dns or (fleet.accept_registrations and not is_loopback(cfg.router.host)):
        missing += _plane(cfg)
    return missing


def worker_missing(cfg: PddConfig, worker: WorkerConfig) -> list[str]:
    """The credentials a worker lacks for where it listens (nothing on loopback)."""
    if is_loopback(worker.host):
        return []
    missing = _plane(cfg)
    if worker.role in (Role.PREFILL, Role.MAIN_DECODE) and not cfg.transfer.tls:
        missing.append(_KV_TLS)
    return missing


def enforce(what: str, missing: list[str], insecure: bool) -> list[str]:
    """Refuse (ConfigError) or, with ``insecure``, warn; returns what /health reports.
    ``what`` names the process and why it is exposed ("worker md0 (binds 0.0.0.0)")."""
    if not missing:
        return []
    listing = "; ".join(missing)
    if not insecure:
        raise ConfigError(
            f"refusing to start: {what} has no {listing}. Make them with "
            "`pdd certs --out DIR --config FILE` and point the config at them (docs/"
            "operations.md, Security), or set security.insecure: true to run open (never "
            "on a network others reach)"
        )
    log.warning("security.insecure: %s runs WITHOUT %s", what, listing)
    return missing


def check_router(cfg: PddConfig, environ: Mapping[str, str]) -> list[str]:
    """At router start: ConfigError, or the missing credentials allowed by insecure."""
    missing = router_missing(cfg, environ)
    what = f"the router (binds {cfg.router.host}, dials its workers)"
    return enforce(what, missing, cfg.security.insecure)


def check_worker(cfg: PddConfig, worker: WorkerConfig) -> list[str]:
    """At worker start: ConfigError, or the missing credentials allowed by insecure."""
    missing = worker_missing(cfg, worker)
    what = f"worker {worker.id} (binds {worker.host}, not loopback)"
    return enforce(what, missing, cfg.security.insecure)
