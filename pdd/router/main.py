"""``pdd router --config FILE [--set key=value ...]``: run the OpenAI-compatible router.

Loads and logs the effective config, builds the app, binds ``router.host:router.port`` itself
(port 0 picks a free port, so the real port is known), serves with uvicorn, and prints exactly
one line once listening:

    pdd router ready: http://HOST:PORT/v1

SIGTERM and SIGINT drain it (``pdd.router.http.drain``): new requests get 503 with Retry-After, open
requests and streams finish for up to ``router.drain_timeout_s``, then uvicorn stops (what is
still open gets ``GRACEFUL_SHUTDOWN_S``, then is cancelled, which aborts it on the workers); a
second signal stops at once. The exit status is then 0.
Exit status 2: bad config or model folder. ``RouterServer`` is reusable (tests run it in a
thread).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pdd.config import PddConfig, load_config
from pdd.config.exposure import check_router
from pdd.errors import PddError
from pdd.observability.logging import setup_logging

log = logging.getLogger("pdd.router")

GRACEFUL_SHUTDOWN_S = 5.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class _Server(uvicorn.Server):
    """uvicorn's server with a hook that runs once it is listening, and a drain on the first
    SIGTERM/SIGINT (uvicorn's own handlers would stop at once): ``drain`` runs in the serving
    loop and the server exits when it returns; a second signal exits at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_ready: Callable[[], None],
        drain: Callable[[], Awaitable[object]] | None = None,
    ):
        super().__init__(config)
        self._on_ready = on_ready
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("signal %d: %s", sig, "stopping now" if self._draining else "draining")
        self.begin_drain()

    def begin_drain(self) -> None:
        """Any thread: drain, then exit; exit at once when already draining or not serving."""
        loop = self._loop
        if self._draining or self._drain is None or loop is None or not self.started:
            self.should_exit = True
            return
        self._draining = True
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            assert self._drain is not None
            await self._drain()
        finally:
            self.should_exit = True


class RouterServer:
    """Serves one app on one pre-bound socket. ``stop()`` may be called from any thread."""

    def __init__(self, app: FastAPI, sock: socket.socket, on_ready: Callable[[str], None]):
        self.sock = sock
        self.url = base_url(sock)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        gate = getattr(app.state, "pdd_drain", None)  # pdd.router.http.drain.DrainGate
        drain = gate.drain if gate is not None else None
        self._server = _Server(config, lambda: on_ready(self.url), drain)

    @property
    def started(self) -> bool:
        return self._server.started

    async def serve(self) -> None:
        await self._server.serve(sockets=[self.sock])

    def stop(self) -> None:
        """Stop now (open requests get GRACEFUL_SHUTDOWN_S). Any thread."""
        # uvicorn's main loop polls this flag every 0.1 s, from its own thread.
        self._server.should_exit = True

    def drain(self) -> None:
        """What SIGTERM does: 503 for new requests, open ones finish (router.drain_timeout_s),
        then stop. Any thread."""
        self._server.begin_drain()


def _announce(url: str) -> None:
    print(f"pdd router ready: {url}", flush=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd router", description="Run the pdd router.")
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    p.add_argument("--log-level", help="logging level (default: $PDD_LOG_LEVEL, else INFO)")
    p.add_argument(
        "--log-json",
        action="store_true",
        default=None,
        help="JSON log lines with the request id (default: $PDD_LOG_JSON=1)",
    )
    return p.parse_args(argv)


def _load(args: argparse.Namespace) -> tuple[PddConfig, FastAPI, socket.socket]:
    from pdd.router.app import build_app

    cfg = load_config(args.config, args.set)
    log.info("effective config: %s", cfg.model_dump_json())
    insecure = check_router(cfg, os.environ)  # before the tokenizer loads: fail fast
    app = build_app(cfg)
    app.state.pdd_insecure = insecure  # /health reports it
    return cfg, app, bind_socket(cfg.router.host, cfg.router.port)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_level, args.log_json, role="router")
    try:
        _, app, sock = _load(args)
    except PddError as exc:
        print(f"pdd router: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdd router: cannot listen: {exc}", file=sys.stderr)
        return 2
    server = RouterServer(app, sock, on_ready=_announce)

    def _on_signal(signum: int, _: FrameType | None) -> None:
        log.info("signal %d: draining", signum)
        server.drain()

    # uvicorn installs its own handlers while serving and re-raises a caught signal at the end;
    # with ours in place that re-raise lands here (harmless) instead of killing the process.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    try:
        asyncio.run(server.serve())
    finally:
        sock.close()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
