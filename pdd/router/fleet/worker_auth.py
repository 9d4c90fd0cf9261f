"""The router's side of router <-> worker authentication: one gRPC channel per worker that
carries the worker token on every call, over TLS when ``security.grpc_tls`` is on.

    WorkerCredentials.from_config(security)   reads the token file and TLS files once
    creds.channel(target, options, interceptors) -> grpc.aio.Channel

The token travels as ``authorization: Bearer TOKEN`` metadata (pdd.worker.auth checks it).
Without TLS it crosses the network in clear text: inside one datacenter that is the operator's
call; across the WAN turn ``grpc_tls`` on. The token never appears in logs or errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdd.config.security import SecurityConfig

AUTH_METADATA = "authorization"  # the key pdd.worker.auth reads


class _AddToken:
    """Adds the token to each call's metadata (shared by both interceptor shapes)."""

    def __init__(self, header: str):
        self._header = header

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[AUTH_METADATA] = self._header
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnaryToken(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamToken(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._details(client_call_details), request)


@dataclass(frozen=True)
class WorkerCredentials:
    """What the router presents to workers: the token (or None) and TLS channel credentials."""

    token: bytes | None = None
    tls: grpc.ChannelCredentials | None = None
    server_name: str | None = None

    def __repr__(self) -> str:  # never print the token
        return f"WorkerCredentials(token={'set' if self.token else None}, tls={bool(self.tls)})"

    @classmethod
    def from_config(cls, security: SecurityConfig) -> WorkerCredentials:
        """Reads the files now; ConfigError when one is missing or invalid."""
        tls = None
        if security.grpc_tls.enabled:
            cert, key, ca = security.grpc_tls.read()
            mutual = security.grpc_tls.mutual
            tls = grpc.ssl_channel_credentials(
                root_certificates=ca,
                private_key=key if mutual else None,
                certificate_chain=cert if mutual else None,
            )
        return cls(security.worker_token(), tls, security.grpc_tls.server_name)

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        if self.token is None:
            return []
        header = "Bearer " + self.token.decode()
        return [_UnaryUnaryToken(header), _UnaryStreamToken(header)]

    def channel(
        self,
        target: str,
        options: Sequence[tuple[str, object]],
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> grpc.aio.Channel:
        """A channel to one worker; the token interceptors run first, then ``interceptors``."""
        chain = [*self.interceptors(), *interceptors]
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=list(options), interceptors=chain)
        opts = list(options)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(target, self.tls, options=opts, interceptors=chain)
