"""The router app factory: builds every router object from a config and wires them.

    build_app(cfg) -> FastAPI

``RouterState`` (``pdd.router.state``) holds the shared objects (config, tokenizer, limits,
pool, service, metrics) on ``app.state.pdd``. The app's lifespan starts the worker pool (channels + health polling)
and stops it on shutdown. Loading the tokenizer happens here, before serving, so a missing
model folder fails at start (ModelError), not on the first request. With API keys configured
(``pdd.router.http.auth``) the key check runs before everything else and the lifespan also runs the
key reloader. ``/openapi.json`` describes the API. ``app.state.pdd_drain`` is the drain gate
(``pdd.router.http.drain``) the server closes on SIGTERM.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdd.config import PddConfig
from pdd.protocol import Role
from pdd.router.debug import RequestLog
from pdd.router.fleet.pool import WorkerPool
from pdd.router.fleet.registry import FleetMembership
from pdd.router.fleet.registry import routes as registry_routes
from pdd.router.http.auth import ApiKeyMiddleware, ApiKeys, KeyReloader
from pdd.router.http.drain import DrainGate, DrainMiddleware
from pdd.router.http.errors import install_error_handlers
from pdd.router.http.limits import BodyLimitMiddleware
from pdd.router.http.rate_limit import KeyLimiter
from pdd.router.http.routes import router as api_routes
from pdd.router.http.validation import generation_defaults
from pdd.router.metrics import RouterMetrics
from pdd.router.service import RouterService
from pdd.router.state import RouterState
from pdd.router.text.tokenizer import TextCodec
from pdd.router.types import ServingLimits


def max_model_len(cfg: PddConfig) -> int:
    """The context every serving worker supports: the smallest effective max_model_len."""
    serving = [w for w in cfg.workers if w.role in (Role.COLOCATED, Role.MAIN_DECODE)]
    lens = [cfg.engine_for(w.id).max_model_len for w in serving or cfg.workers]
    return min(lens) if lens else cfg.engine.max_model_len


def build_state(cfg: PddConfig, codec: TextCodec | None = None) -> RouterState:
    model_path = cfg.model.resolved_path()
    codec = codec or TextCodec.from_folder(model_path)
    limits = ServingLimits(
        model_names=(cfg.model.name, str(model_path)),
        max_model_len=max_model_len(cfg),
        vocab_size=codec.vocab_size,
        defaults=generation_defaults(model_path),
    )
    pool = WorkerPool(cfg)
    metrics = RouterMetrics(cfg)
    requests = RequestLog(cfg.router.debug_requests)
    service = RouterService(cfg, codec, pool, metrics, requests)
    return RouterState(cfg, codec, limits, pool, service, metrics, int(time.time()), requests)


def build_app(cfg: PddConfig, *, codec: TextCodec | None = None) -> FastAPI:
    """The router's ASGI app. Raises ModelError (no tokenizer) or ConfigError (bad mode)."""
    state = build_state(cfg, codec)
    keys = ApiKeys.from_config(cfg.router)  # None: authentication off
    reloader = KeyReloader(keys) if keys is not None else None
    fleet = FleetMembership(state.pool, cfg.router.fleet, worker_token=cfg.security.worker_token())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        await fleet.start()  # registration expiry, DNS discovery
        # Announce readiness only once worker health is known, so a client that starts
        # right after the ready line does not get a 503 from an unpolled pool.
        await state.pool.wait_first_poll(timeout=cfg.router.worker_rpc_timeout_s + 1.0)
        if reloader is not None:
            await reloader.start()
        try:
            yield
        finally:
            if reloader is not None:
                await reloader.stop()
            await fleet.stop()
            await state.pool.stop()

    # /openapi.json is served (as vLLM does) and open; the docs pages need a CDN: off.
    app = FastAPI(
        title="pdd router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.pdd = state
    app.state.pdd_drain = DrainGate(lambda: state.service.in_flight, cfg.router.drain_timeout_s)
    install_error_handlers(app)
    app.include_router(api_routes)
    app.state.pdd_fleet = fleet
    app.state.pdd_key_limiter = KeyLimiter()  # rpm / tpm of API keys (pdd.router.http.rate_limit)
    if cfg.router.fleet.accept_registrations:
        app.include_router(registry_routes)  # /internal/v1/workers
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=cfg.router.max_body_bytes)
    app.add_middleware(DrainMiddleware, gate=app.state.pdd_drain)  # 503 while draining
    if keys is not None:  # added last, so it runs first: no body is read for a 401
        app.add_middleware(
            ApiKeyMiddleware, keys=keys, metrics_require_key=cfg.router.metrics_require_key
        )
    return app
