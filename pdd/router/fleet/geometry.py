"""Admission by KV geometry: which workers may join the fleet at all.

The fleet serves one model. Its identity (``pdd.kv_geometry.IDENTITY``: model fingerprint,
layers, total KV heads, head dim) is the router's own model folder's when the router can read
it (it tokenizes with that folder), else the first worker admitted with a geometry. A worker
whose identity differs is not admitted: a registration is refused (400 naming ``geometry``),
a configured or discovered worker stays unhealthy with the reason as its last error, and
either way one warning is logged. Workers that report no geometry (older workers, tests'
fakes) are admitted; routing then treats their pairs as compatible.

Pairs of admitted workers can still differ in a landing field (dtype, block size, layout,
heads): ``pdd.router.decide.policy`` never pairs those unless the receivers convert.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pdd.errors import PddError
from pdd.kv_geometry import KvGeometry, describe_conflict, folder_geometry, identity_conflict

log = logging.getLogger(__name__)

_REFUSED_KEPT = 64


class GeometryGate:
    """The fleet's reference identity and the admission check against it."""

    def __init__(self, reference: KvGeometry | None, source: str) -> None:
        self.reference = reference
        self.source = source  # who defined the reference: "router model <path>" | a worker id
        self._warned: set[tuple[str, str]] = set()
        # Workers refused at registration (not members, so not in the pool's rows): the
        # latest reason per id, for /debug/workers and ``pdd status``. Bounded.
        self.refused: dict[str, str] = {}

    @classmethod
    def from_model_folder(cls, folder: Path) -> GeometryGate:
        """The router's model folder as the reference; none (the first worker's) if unreadable."""
        try:
            reference = folder_geometry(folder, block_size=1, kv_dtype="auto")
        except PddError as exc:
            log.info("no reference KV geometry from %s (%s): the first worker's is", folder,
                     exc.message)  # fmt: skip
            return cls(None, "")
        return cls(reference, f"router model {folder}")

    def refusal(self, worker_id: str, geometry: KvGeometry | None) -> str | None:
        """Why ``worker_id`` with ``geometry`` is not admitted (one sentence naming it and the
        field), else None. The first geometry seen becomes the reference when there is none."""
        if geometry is None:
            return None
        if self.reference is None:
            self.reference, self.source = geometry, worker_id
            log.info("fleet KV identity set by worker %s: %s", worker_id, geometry.summary())
            return None
        field = identity_conflict(self.reference, geometry)
        if field is None:
            self.refused.pop(worker_id, None)
            return None
        reason = "not admitted: " + describe_conflict(
            field, worker_id, geometry, self.source, self.reference
        )
        self.refused.pop(worker_id, None)
        self.refused[worker_id] = reason
        while len(self.refused) > _REFUSED_KEPT:
            self.refused.pop(next(iter(self.refused)))
        if (worker_id, reason) not in self._warned:
            self._warned.add((worker_id, reason))
            log.warning("worker %s %s", worker_id, reason)
        return reason
