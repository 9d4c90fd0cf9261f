"""The worker's side of router <-> worker authentication: token check and TLS credentials.

    TokenAuthInterceptor(token)   every gRPC call must carry ``authorization: Bearer TOKEN``
    server_credentials(tls)       grpc.ServerCredentials for ``security.grpc_tls`` (or None)

The token comes from ``security.worker_token_file`` (``SecurityConfig.worker_token``). A call
without it, or with another one, is answered UNAUTHENTICATED before any handler runs, and is
logged with the method name and the reason, never with what was sent. The comparison is
constant-time, length included (``SecretCheck``).
"""

from __future__ import annotations

import logging
import time

import grpc

from pdd.config.security import GrpcTlsConfig, SecretCheck

log = logging.getLogger(__name__)

AUTH_METADATA = "authorization"
LOG_EVERY_S = 10.0  # refusals are logged at most this often (a scan must not flood the log)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not present the worker token. Counts refusals."""

    def __init__(self, token: bytes):
        self._check = SecretCheck(b"Bearer " + token)
        self.refused = 0
        self._last_log = 0.0
        self._unlogged = 0

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA:
                presented = value.encode() if isinstance(value, str) else value
                break
        if presented is not None and self._check.matches(presented):
            return await continuation(handler_call_details)
        reason = "no worker credential" if presented is None else "wrong worker credential"
        self._note_refusal(handler_call_details.method, reason)
        return _refusal(reason)

    def _note_refusal(self, method: str, reason: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log < LOG_EVERY_S:
            self._unlogged += 1
            return
        extra = f" ({self._unlogged} more since the last report)" if self._unlogged else ""
        log.warning("refused %s: %s%s", method, reason, extra)
        self._last_log, self._unlogged = now, 0


def _refusal(reason: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED (grpc serves it for any call shape)."""

    async def refuse(request, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{reason}: this worker requires the token of security.worker_token_file",
        )

    return grpc.unary_unary_rpc_method_handler(refuse)


def server_credentials(tls: GrpcTlsConfig) -> grpc.ServerCredentials | None:
    """TLS server credentials (client certificates required when ``tls.mutual``)."""
    if not tls.enabled:
        return None
    cert, key, ca = tls.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=tls.mutual
    )
