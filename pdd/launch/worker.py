"""`pdd worker|prefill|relay-decode|main-decode --config FILE [--worker ID] [--set k=v ...]`.

The composition root of one worker process, above the roles (the only module where they
meet; the worker shell, pdd.worker, never imports a role): it picks the role policy
(pdd.prefill, pdd.relay_decode, pdd.main_decode; colocated: pdd.worker.roles.PlainRole),
builds the KV plane the role asks for (shared-memory arena, fences, transports), the engine with the KV
connector mapping that arena, and the gRPC service. Lifecycle:

    load config -> KV arena -> /metrics + /health up (503) -> gRPC server up (Health: not
    ready) -> role start (transports) -> engine start
    -> print "pdd worker ready: id=ID grpc=HOST:PORT metrics=HOST:PORT" (the only stdout line)
    -> serve until SIGTERM/SIGINT -> drain: refuse new work (UNAVAILABLE, Health not ready),
    let in-flight requests and KV transfers finish for up to ``workers[].drain_timeout_s``,
    abort what is left and let the final responses go out -> stop the gRPC server, stop the
    engine (no child left), release every slot the role holds, close the transports, unlink
    the arenas -> exit 0.

With ``security.worker_token_file`` every gRPC call must carry the token (pdd.worker.auth);
with ``security.grpc_tls`` the server speaks TLS (mutual by default).

vLLM's CPU engine starts its engine core with `spawn`, which re-imports ``__main__``: keep the
``__main__`` guard and keep work out of module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time

from pdd.config import PddConfig, WorkerConfig, load_config
from pdd.config.exposure import check_worker
from pdd.engine.env import configure_process_env
from pdd.errors import ConfigError, PddError
from pdd.observability.context import RequestIdServerInterceptor
from pdd.observability.logging import setup_logging
from pdd.protocol import Role

log = logging.getLogger("pdd.worker")
SHUTDOWN_GRACE_S = 5.0  # final responses of aborted streams get this long to go out
DRAIN_POLL_S = 0.1


def _parse(argv: list[str], prog: str, need_worker: bool) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description="Run one pdd worker process.")
    ap.add_argument("--config", required=True, help="YAML topology config")
    ap.add_argument(
        "--worker", required=need_worker, help="worker id in the config (default: the only one)"
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--register",
        metavar="URL",
        help="router URL to register with and heartbeat to "
        "(sets the worker's register_url; the router needs router.fleet.accept_registrations)",
    )
    return ap.parse_args(argv)


def _pick_worker(cfg: PddConfig, worker_id: str | None, role: Role | None) -> WorkerConfig:
    if worker_id is not None:
        worker = cfg.worker(worker_id)
    else:
        candidates = [w for w in cfg.workers if role is None or w.role == role]
        if len(candidates) != 1:
            ids = [w.id for w in candidates]
            raise ConfigError(f"--worker is required: the config has workers {ids}")
        worker = candidates[0]
    if role is not None and worker.role != role:
        raise ConfigError(f"worker {worker.id!r} has role {worker.role.value}, not {role.value}")
    return worker


def _role_class(role: Role):
    """The role policy a worker runs (the composition root is the only place roles meet)."""
    if role is Role.PREFILL:
        from pdd.prefill import PrefillRole

        return PrefillRole
    if role is Role.RELAY_DECODE:
        from pdd.relay_decode import RelayDecodeRole

        return RelayDecodeRole
    if role is Role.MAIN_DECODE:
        from pdd.main_decode import MainDecodeRole

        return MainDecodeRole
    from pdd.worker.roles import PlainRole

    return PlainRole


async def _build(cfg: PddConfig, worker: WorkerConfig, parts: dict):
    """Arena (KV roles) -> engine -> role -> metrics -> service; records each in ``parts``
    as it is made, so the caller can tear down whatever exists if a later step fails."""
    from pdd.engine.model import prepare_model  # cheap: no vLLM
    from pdd.worker.capacity import check_arenas
    from pdd.worker.kv_plane import KvPlane
    from pdd.worker.layout import block_bytes_of
    from pdd.worker.metrics import WorkerMetrics
    from pdd.worker.roles import RoleContext
    from pdd.worker.service import WorkerService

    # The model folder before anything imports vLLM (seconds): a wrong model.path fails at once.
    await asyncio.to_thread(prepare_model, cfg.model)  # ModelError
    engine_cfg = cfg.engine_for(worker.id)
    role_cls = _role_class(worker.role)
    plane, block_bytes = None, 0
    if hasattr(role_cls, "plane_spec"):
        block_bytes = await asyncio.to_thread(
            block_bytes_of, cfg.model, engine_cfg.block_size, engine_cfg.kv_dtype(cfg.model.dtype)
        )
        spec = role_cls.plane_spec(worker, block_bytes, cfg)
        for warning in check_arenas(  # ConfigError: an arena cannot hold one request
            spec.arenas, max_model_len=engine_cfg.max_model_len,
            max_num_seqs=engine_cfg.max_num_seqs, block_size=engine_cfg.block_size,
            block_bytes=block_bytes,
        ):  # fmt: skip
            log.warning("worker %s: %s", worker.id, warning)
        plane = parts["plane"] = KvPlane(spec, block_bytes, worker, cfg.transfer)
    from pdd.engine.engine import Engine  # imports vLLM: after the environment is set

    engine = parts["engine"] = Engine(
        cfg.model,
        engine_cfg,
        plane.connector_spec() if plane is not None else None,
        measure_prefill=worker.role is Role.MAIN_DECODE,  # for router.pdd.md_recompute
        streams_kv=cfg.streams_kv(worker.id),  # a P (on a GPU: smaller steps, KV leaves sooner)
    )
    ctx = RoleContext(engine, plane, worker, cfg, engine_cfg.block_size, block_bytes)
    role = parts["role"] = role_cls(ctx)
    metrics = parts["metrics"] = WorkerMetrics(
        worker.role.value,
        lambda: engine.stats() if engine.ready else None,
        lambda: role.kv_stats() if engine.ready else None,
    )
    service = WorkerService(engine, worker, cfg.model.name, metrics, role)
    if plane is not None:
        service.stall_reason = plane.fences.stall_reason
    metrics.ready = lambda: service.ready
    return service


async def _teardown(parts: dict) -> None:
    """Stop what exists, engine first: no slot is released while the engine may use it."""
    if "engine" in parts:
        await parts["engine"].stop()
    if "role" in parts:
        await parts["role"].stop()
    if "plane" in parts:
        await parts["plane"].stop()
    if "metrics" in parts:
        parts["metrics"].close()


async def _serve(cfg: PddConfig, worker: WorkerConfig, insecure: list[str] | None = None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    parts: dict = {}
    server = None
    try:
        _install_kv_credential(cfg, worker)
        service = await _build(cfg, worker, parts)
        engine, metrics = parts["engine"], parts["metrics"]
        metrics.insecure = insecure or []
        metrics_port = metrics.serve(worker.host, worker.metrics_port)  # /health: 503 for now
        server, grpc_port = _grpc_server(cfg, worker, service)
        await server.start()
        await parts["role"].start()
        if not await _until_ready_or_stopped(engine, stop):
            return 0
        print(
            f"pdd worker ready: id={worker.id} grpc={worker.host}:{grpc_port} "
            f"metrics={worker.host}:{metrics_port}",
            flush=True,
        )
        geometry = parts["engine"].kv_geometry
        registration = await _register(cfg, worker, grpc_port, metrics_port, geometry)
        await stop.wait()
        if registration is not None:  # leave the fleet first: no new work routed here
            await registration.stop()
        await _drain(service, engine, parts["role"], worker.drain_timeout_s)
        return 0
    finally:
        if server is not None:
            await server.stop(SHUTDOWN_GRACE_S)
        await _teardown(parts)
        log.info("worker %s stopped", worker.id)


async def _register(cfg: PddConfig, worker: WorkerConfig, grpc_port: int, metrics_port: int,  # type: ignore[no-untyped-def]
                    geometry=None):  # fmt: skip
    """With ``register_url``: join that router's fleet and heartbeat (pdd.worker.register)."""
    if worker.register_url is None:
        return None
    from pdd.worker.register import RegistrationClient, registration_for

    seqs = cfg.engine_for(worker.id).max_num_seqs
    msg = registration_for(worker, grpc_port, metrics_port, seqs, geometry)
    client = RegistrationClient(
        worker.register_url, msg, worker.register_interval_s, cfg.security.worker_token()
    )
    await client.start()
    return client


def _install_kv_credential(cfg: PddConfig, worker: WorkerConfig) -> None:
    """The worker token guards this worker's KV receivers too: every UCX and TCP sender
    answers a fresh challenge with it (pdd.transfer.ucx_auth); the TCP (WAN) bytes are
    encrypted by mutual TLS (``transfer.tls``). Raises ConfigError."""
    from pdd.transfer.ucx_auth import set_kv_token

    token = cfg.security.worker_token()
    set_kv_token(token)
    if token is not None and worker.role is Role.MAIN_DECODE and not cfg.transfer.tls:
        log.warning(
            "security.worker_token_file is set but transfer.tls is off: this main_decode's "
            "KV arrives in cleartext; turn on transfer.tls for WAN links"
        )


def _grpc_server(cfg: PddConfig, worker: WorkerConfig, service):  # type: ignore[no-untyped-def]
    """The gRPC server (not started) with the worker token check and TLS of ``security``;
    returns (server, bound port). Raises ConfigError (bad security files), PddError (bind)."""
    import grpc

    from pdd.proto import worker_pb2_grpc as pb_grpc
    from pdd.proto.options import SERVER_OPTIONS
    from pdd.worker.auth import TokenAuthInterceptor, server_credentials

    token = cfg.security.worker_token()
    interceptors: list = [RequestIdServerInterceptor()]
    if token is not None:  # first: nothing runs for a caller without the token
        interceptors.insert(0, TokenAuthInterceptor(token))
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    address = f"{worker.host}:{worker.port}"
    creds = server_credentials(cfg.security.grpc_tls)
    port = (
        server.add_insecure_port(address)
        if creds is None
        else server.add_secure_port(address, creds)
    )
    if port == 0:
        raise PddError(f"cannot bind gRPC on {address}")
    log.info(
        "gRPC on %s: worker token %s, TLS %s",
        address,
        "required" if token is not None else "off",
        "mutual" if creds and cfg.security.grpc_tls.mutual else ("on" if creds else "off"),
    )
    return server, port


async def _drain(service, engine, role, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM: refuse new work, let what is in flight finish (Generate streams, engine
    requests, KV transfers) for up to ``timeout_s``, then abort what is left."""
    service.start_drain()
    log.info("draining: refusing new requests; waiting up to %.0f s for in-flight ones", timeout_s)

    def busy() -> tuple[int, int, int]:
        stats = engine.stats()
        return service.active, stats.running + stats.waiting, role.kv_stats().open_transfers

    deadline = time.monotonic() + timeout_s
    while any(busy()) and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    streams, requests, transfers = busy()
    if streams or requests:
        log.warning(
            "drain timeout: aborting %d requests (%d streams, %d open transfers)",
            requests, streams, transfers,
        )  # fmt: skip
        await engine.abort_all()
    else:
        log.info("drained: nothing in flight")


async def _until_ready_or_stopped(engine, stop: asyncio.Event) -> bool:
    """Start the engine; False if a signal came first (the engine is stopped by the caller)."""
    starting = asyncio.ensure_future(engine.start())
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if starting in done:
        starting.result()  # raises the start failure
        return True
    log.info("signal during engine start-up: waiting for it to finish, then stopping")
    with contextlib.suppress(PddError):
        await starting
    return False


def _run(argv: list[str] | None, prog: str, role: Role | None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv), prog, need_worker=role is None)
    setup_logging(role=prog.removeprefix("pdd "))
    configure_process_env()
    try:
        cfg = load_config(args.config, args.overrides)
        worker = _pick_worker(cfg, args.worker, role)
        if args.register:
            worker = worker.model_copy(update={"register_url": args.register})
        insecure = check_worker(cfg, worker)
    except ConfigError as err:
        print(f"{prog}: {err.message}", file=sys.stderr)
        return 2
    setup_logging(role=worker.role.value, worker=worker.id)
    log.info("worker %s effective config: %s", worker.id, cfg.model_dump_json())
    try:
        return asyncio.run(_serve(cfg, worker, insecure))
    except PddError as err:
        log.error("worker %s failed: %s", worker.id, err.message)
        return 1


def main(argv: list[str] | None = None) -> int:
    """`pdd worker`: any role, chosen by the worker's entry in the config."""
    return _run(argv, "pdd worker", None)


def main_prefill(argv: list[str] | None = None) -> int:
    return _run(argv, "pdd prefill", Role.PREFILL)


def main_relay_decode(argv: list[str] | None = None) -> int:
    return _run(argv, "pdd relay-decode", Role.RELAY_DECODE)


def main_main_decode(argv: list[str] | None = None) -> int:
    return _run(argv, "pdd main-decode", Role.MAIN_DECODE)


if __name__ == "__main__":
    sys.exit(main())
