"""``security.auto_credentials``: `pdd serve` makes one run's worker-plane credentials.

A topology whose processes listen beyond loopback (the lab: every process binds its
datacenter's address) needs the worker token and TLS on gRPC and KV (pdd.config.exposure).
With ``auto_credentials`` the launcher makes them in its run folder, once, before it writes the
effective config every child reads:

    run_dir/worker-token               when security.worker_token_file is null (0600)
    run_dir/certs/ca.crt, ca.key       a CA for this run only (pdd.certs)
    run_dir/certs/run/tls.{crt,key}    one certificate with every address of the topology

and points ``security.worker_token_file``, ``security.grpc_tls`` and ``transfer.tls`` at them.
Only paths are written into the config; the run folder goes away with the run.

``host_private``: in the lab every address is a veth inside this host's own namespaces, which
no other machine reaches, so `pdd serve` runs a lab topology with ``security.insecure``: what
its processes lack is warned about and listed in ``/health``, never refused (configs/lab.yaml
still turns the worker plane's credentials on with ``auto_credentials``).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from pdd.launch.placement import Placed

CERT_DAYS = 30


def with_run_credentials(data: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The effective config (a model_dump) with this run's credentials filled in; ``data``
    unchanged when ``security.auto_credentials`` is off. Writes files in ``run_dir``."""
    security = data.get("security") or {}
    if not security.get("auto_credentials"):
        return data
    from pdd.certs import make_leaf

    if security.get("worker_token_file") is None:
        security["worker_token_file"] = str(_token(run_dir / "worker-token"))
    out = run_dir / "certs"
    out.mkdir(mode=0o700, exist_ok=True)
    folder = make_leaf(out, "run", _addresses(data), CERT_DAYS)
    files = {"cert_file": folder / "tls.crt", "key_file": folder / "tls.key"}
    files["ca_file"] = folder / "ca.crt"
    security["grpc_tls"] = {**security.get("grpc_tls", {}), "enabled": True}
    security["grpc_tls"].update({k: str(v) for k, v in files.items()})
    transfer = data.setdefault("transfer", {})
    transfer["tls"] = True
    transfer.update({f"tls_{k}": str(v) for k, v in files.items()})
    data["security"] = security
    return data


def _token(path: Path) -> Path:
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def _addresses(data: dict[str, Any]) -> list[str]:
    """Every address a process of the topology is dialled at."""
    hosts = [str((data.get("router") or {}).get("host") or "")]
    for w in data.get("workers") or []:
        hosts += [w.get("advertise_host") or w.get("host") or "", w.get("kv_advertise_host") or ""]
    return [h for h in hosts if h]


def host_private(placed: Placed) -> Placed:
    """``placed`` with ``security.insecure`` on (a lab placement: see the module docstring)."""
    if placed.cfg.security.insecure:
        return placed
    security = placed.cfg.security.model_copy(update={"insecure": True})
    cfg = placed.cfg.model_copy(update={"security": security})
    return Placed(cfg, placed.router_dc, placed.url)
