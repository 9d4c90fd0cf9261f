"""Typed, nested, frozen configuration loaded from YAML with ``--set a.b=c`` overrides.

Every process logs its effective config (``PddConfig.model_dump_json``) at start; the router
serves it at ``/debug/config``. Unknown keys are rejected with their full key path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pdd.config.base import Section
from pdd.config.cache import CacheConfig
from pdd.config.lab import LabConfig
from pdd.config.launch import LaunchConfig
from pdd.config.model import EngineConfig, ModelConfig
from pdd.config.router import RouterConfig
from pdd.config.security import SecurityConfig
from pdd.config.transfer import TransferConfig
from pdd.config.worker import WorkerConfig
from pdd.errors import ConfigError
from pdd.protocol import Role

log = logging.getLogger("pdd.config")

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "LabConfig",
    "LaunchConfig",
    "ModelConfig",
    "PddConfig",
    "RouterConfig",
    "SecurityConfig",
    "TransferConfig",
    "WorkerConfig",
    "load_config",
    "apply_overrides",
    "read_yaml_mapping",
]


class PddConfig(Section):
    """A whole topology: the router, its workers, and the shared settings."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The served model.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Default engine settings for every worker."
    )
    router: RouterConfig = Field(default_factory=RouterConfig, description="The router.")
    workers: list[WorkerConfig] = Field(
        default_factory=list, description="Every worker process of the topology."
    )
    transfer: TransferConfig = Field(
        default_factory=TransferConfig, description="KV transfer layer."
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Decode-side cache.")
    lab: LabConfig = Field(default_factory=LabConfig, description="Two-datacenter lab link.")
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig, description="How `pdd serve` supervises its children."
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="Worker token and TLS between the router and its workers.",
    )

    @model_validator(mode="after")
    def _unique_worker_ids(self) -> PddConfig:
        ids = [w.id for w in self.workers]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate worker ids: {sorted(dup)}")
        return self

    def worker(self, worker_id: str) -> WorkerConfig:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise ConfigError(f"no worker with id {worker_id!r} (have {[w.id for w in self.workers]})")

    def engine_for(self, worker_id: str) -> EngineConfig:
        return self.worker(worker_id).engine or self.engine

    def streams_kv(self, worker_id: str) -> bool:
        """The worker's KV leaves chunk by chunk as it prefills (a P with router.pdd.stream_kv)."""
        return self.worker(worker_id).role is Role.PREFILL and self.router.pdd.stream_kv


def _parse_scalar(text: str) -> Any:
    """`--set` values are YAML scalars: 8 -> int, true -> bool, null -> None, [a,b] -> list."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a raw config dict. List items by index: ``workers.0.port=9``."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[_index(part, key)]
                continue
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict | list):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        last = parts[-1]
        if isinstance(node, list):
            node[_index(last, key)] = _parse_scalar(value)
        else:
            node[last] = _parse_scalar(value)
    return data


def _index(part: str, key: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise ConfigError(f"--set {key}: {part!r} must be a list index") from None


def _format_validation(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {path}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The top-level mapping of a YAML file; ConfigError naming the path otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return loaded


def unreached_engine_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """A sentence for each ``--set engine.X=...`` that workers with an engine section of their
    own do not see (theirs replaces the top-level one whole; a YAML anchor copies it)."""
    workers = data.get("workers") if isinstance(data.get("workers"), list) else []
    own = [(i, w.get("id", str(i))) for i, w in enumerate(workers)
           if isinstance(w, dict) and isinstance(w.get("engine"), dict)]  # fmt: skip
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key.startswith("engine.") and own:
            rest = key.removeprefix("engine.")
            names = ", ".join(str(wid) for _, wid in own)
            out.append(f"--set {key} does not reach worker(s) {names}: each has its own engine "
                       f"section; set workers.{own[0][0]}.engine.{rest} (and so on) for them")  # fmt: skip
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PddConfig:
    """Load a YAML file (or defaults when path is None) and apply overrides."""
    data = read_yaml_mapping(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    for warning in unreached_engine_overrides(data, overrides or []):
        log.warning("%s", warning)
    try:
        return PddConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc)) from None
