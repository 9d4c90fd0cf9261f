"""The router's shared objects, one per process, on ``app.state.pdd``.

Built by ``app.build_state``; read by the routes (``http.routes``) and the registration
endpoint (``fleet.registry``). It sits below both, so neither imports the app that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.config import PddConfig
from pdd.router.debug import RequestLog
from pdd.router.fleet.pool import WorkerPool
from pdd.router.metrics import RouterMetrics
from pdd.router.service import RouterService
from pdd.router.text.tokenizer import TextCodec
from pdd.router.types import ServingLimits


@dataclass(frozen=True)
class RouterState:
    cfg: PddConfig
    codec: TextCodec
    limits: ServingLimits
    pool: WorkerPool
    service: RouterService
    metrics: RouterMetrics
    started_at: int
    requests: RequestLog  # recent requests for /debug/requests

    @property
    def model_name(self) -> str:
        return self.cfg.model.name
