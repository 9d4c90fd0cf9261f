"""Request body size limit (413), enforced before anything parses the body.

A pure ASGI middleware: a ``Content-Length`` above the limit is refused without reading the
body; otherwise the body is read chunk by chunk (chunked uploads included) and refused as soon
as it passes the limit. An accepted body is replayed to the app as one message, after which
``receive`` is the server's again (so the app still sees ``http.disconnect``).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdd.errors import InvalidRequestError, PayloadTooLargeError
from pdd.router.http.errors import error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            err = InvalidRequestError("invalid Content-Length header")
            await error_response(err)(scope, receive, send)
            return
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client left before sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int | None) -> None:
        got = f"{size} bytes" if size is not None else "more than that"
        err = PayloadTooLargeError(
            f"request body too large: the limit is {self.max_body_bytes} bytes, got {got}"
        )
        await error_response(err)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """Declared body size; None when absent, -1 when malformed."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                n = int(value)
            except ValueError:
                return -1
            return n if n >= 0 else -1
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
