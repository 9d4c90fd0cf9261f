"""One streamed request against an OpenAI-compatible server, timed from the client's side.

TTFT is send -> first content chunk; the arrival time of every content chunk is kept (ITL and
the largest stall come from them). Usage (``stream_options.include_usage``) and pdd's
per-request facts (the ``"pdd"`` object on the final chunks; absent in colocated mode) are read
from the stream. Every failure becomes a record with ``error`` set; nothing raises but
cancellation.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from pdd.bench.serve.workload import BenchRequest


class PddFacts(BaseModel):
    """pdd's per-request facts as the router reports them; missing fields mean zero / none."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    pipeline: str = "none"
    prompt_tokens: int = 0
    md_cached_tokens: int = 0
    wan_kv_bytes: int = 0
    wan_kv_raw_bytes: int = 0  # before P's WAN codec (wan_kv_bytes: after it, as expected)
    rld_tokens: int = 0
    handoff: str = "none"
    handoff_rounds: int = 0


@dataclass
class RequestRecord:
    """What one request did, seen from the client. Times in seconds."""

    index: int
    group: str
    warmup: bool
    conversation: str
    max_tokens: int
    target_hit: float | None = None
    expected_prompt_tokens: int | None = None
    shared_tokens: int | None = None  # leading tokens shared with request ``after``'s prompt
    after: int | None = None  # the request whose prompt this one extends or branches from
    anomaly: bool = False
    scheduled_s: float | None = None  # arrival the load pattern scheduled (None: closed loop)
    sent_s: float = 0.0  # send time, from the phase start (later when ``after`` ran late)
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # content chunk arrivals, from send
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    pdd: PddFacts = field(default_factory=PddFacts)
    status: int | None = None
    error: str | None = None
    response_id: str | None = None  # the server's id of the completion
    debug: dict[str, Any] | None = None  # the router's /debug/requests/{id} view (timelines)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "pdd"}
        out["pdd"] = self.pdd.model_dump()
        return out


def new_record(req: BenchRequest) -> RequestRecord:
    return RequestRecord(
        index=req.index,
        group=req.group,
        warmup=req.warmup,
        conversation=req.conversation,
        max_tokens=req.max_tokens,
        target_hit=req.target_hit,
        expected_prompt_tokens=req.prompt_tokens,
        shared_tokens=req.shared_tokens,
        after=req.after,
        anomaly=req.anomaly,
    )


class _Stream:
    """Accumulates one SSE stream into a record."""

    def __init__(self, rec: RequestRecord, t0: float):
        self.rec = rec
        self.t0 = t0
        self.chunks = 0
        self.done = False

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError(f"chunk is not an object: {data[:80]}")
        if "error" in body:
            raise ValueError(f"error in stream: {json.dumps(body['error'])[:300]}")
        if self.rec.response_id is None and isinstance(body.get("id"), str):
            self.rec.response_id = body["id"]
        if body.get("usage"):
            self._usage(body["usage"])
        if isinstance(body.get("pdd"), dict):
            self.rec.pdd = PddFacts.model_validate(body["pdd"])
        for choice in body.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                self._content(time.perf_counter() - self.t0)
            if choice.get("finish_reason"):
                self.rec.finish_reason = choice["finish_reason"]

    def _content(self, at: float) -> None:
        if self.rec.ttft_s is None:
            self.rec.ttft_s = at
        self.rec.chunk_s.append(at)
        self.chunks += 1

    def _usage(self, usage: dict[str, Any]) -> None:
        self.rec.output_tokens = int(usage.get("completion_tokens") or 0)
        self.rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.rec.cached_tokens = int(details.get("cached_tokens") or 0)

    def finish(self) -> None:
        rec = self.rec
        rec.e2e_s = time.perf_counter() - self.t0
        if rec.output_tokens == 0:
            rec.output_tokens = self.chunks  # no usage: one token per chunk, as a fallback
        if rec.ttft_s is None:
            rec.error = "no tokens in the stream"
        elif not self.done and rec.finish_reason is None:
            rec.error = "stream ended early (no finish_reason, no [DONE])"


async def stream_request(
    http: httpx.AsyncClient,
    req: BenchRequest,
    body: dict[str, Any],
    timeout_s: float,
    phase_start: float,
) -> RequestRecord:
    """POST ``body`` (already holding model and sampling fields) as a stream; never raises
    except ``asyncio.CancelledError``."""
    rec = new_record(req)
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    rec.sent_s = t0 - phase_start
    stream = _Stream(rec, t0)
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", req.endpoint(), json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                    rec.e2e_s = time.perf_counter() - t0
                    return rec
                async for line in resp.aiter_lines():
                    stream.feed(line)
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g}s"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, ValidationError) as exc:  # bad JSON, bad pdd object, error chunk
        rec.error = f"bad stream: {exc}"
    if rec.error is None:
        stream.finish()
    else:
        rec.e2e_s = time.perf_counter() - t0
    return rec


async def fetch_debug(http: httpx.AsyncClient, root: str, rec: RequestRecord) -> None:
    """Attach the router's view of the finished request (``GET {root}/debug/requests/{id}``:
    its route, timeline of RPCs and first tokens per worker) to ``rec``; a server without
    that view (vLLM's, or the request no longer kept) leaves ``rec.debug`` None."""
    if rec.response_id is None:
        return
    try:
        resp = await http.get(f"{root}/debug/requests/{rec.response_id}", timeout=10)
        if resp.status_code == 200:
            rec.debug = resp.json()
    except (httpx.HTTPError, ValueError):
        pass
