"""A scripted OpenAI-style streaming server behind ``httpx.MockTransport`` (for unit tests of
the client and the runner; the real system is exercised by the slow smoke test).

Each chat request's last message content is its name; ``script[name]`` says how to answer.
Every request's start and end times (perf_counter) are logged in ``log``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Answer:
    tokens: int = 3
    delay_s: float = 0.0  # before the first token
    gap_s: float = 0.0  # between tokens
    status: int = 200
    pdd: dict[str, Any] | None = None
    finish: bool = True  # send finish_reason, usage and [DONE]
    error_chunk: bool = False


@dataclass
class FakeServer:
    script: dict[str, Answer] = field(default_factory=dict)
    log: dict[str, tuple[float, float]] = field(default_factory=dict)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    max_model_len: int = 4096
    health: list[int] = field(default_factory=list)  # statuses /health answers, then 200
    keys: list[str | None] = field(default_factory=list)  # each request's Authorization
    debug: dict[str, dict[str, Any]] = field(default_factory=dict)  # /debug/requests/{id}

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(self.health.pop(0) if self.health else 200)
        if path.startswith("/debug/requests/"):
            view = self.debug.get(path.rsplit("/", 1)[1])
            return httpx.Response(404) if view is None else httpx.Response(200, json=view)
        if path == "/v1/models":
            card = {"id": "fake-model", "max_model_len": self.max_model_len}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(request.content)
        self.bodies.append(body)
        self.keys.append(request.headers.get("authorization"))
        name = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        answer = self.script.get(name, Answer())
        if answer.status != 200:
            self.log[name] = (time.perf_counter(), time.perf_counter())
            return httpx.Response(answer.status, json={"error": {"message": "busy"}})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._events(name, answer),
        )

    async def _events(self, name: str, a: Answer):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        rid = f"chatcmpl-{name}"  # every chunk of a completion carries its id
        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}], "usage": None}, rid)
        await asyncio.sleep(a.delay_s)
        for i in range(a.tokens):
            if i:
                await asyncio.sleep(a.gap_s)
            yield _sse({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}, rid)
        if a.error_chunk:
            yield _sse({"error": {"message": "worker died", "type": "worker_error"}}, rid)
        if a.finish:
            final: dict[str, Any] = {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            }
            if a.pdd is not None:
                final["pdd"] = a.pdd
            yield _sse(final, rid)
            usage = {
                "prompt_tokens": 100,
                "completion_tokens": a.tokens,
                "total_tokens": 100 + a.tokens,
                "prompt_tokens_details": {"cached_tokens": 64},
            }
            yield _sse({"choices": [], "usage": usage}, rid)
            yield b"data: [DONE]\n\n"
        self.log[name] = (start, time.perf_counter())


def _sse(body: dict[str, Any], rid: str) -> bytes:
    return b"data: " + json.dumps(dict(body, id=rid)).encode() + b"\n\n"
