"""A small streaming load generator for OpenAI-compatible servers (shared by benchmarks).

Measures per request: TTFT (send -> first content chunk), inter-token gaps, E2E, output tokens
(from the server's usage when given, else chunks). Closed loop: `concurrency` streams, each
sending its next request when the previous one ends.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


async def stream_completion(
    http: httpx.AsyncClient, url: str, body: dict, timeout_s: float = 600
) -> RequestResult:
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    itl: list[float] = []
    usage_tokens = None
    try:
        async with http.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {await r.aread()!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                choices = data.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if not text:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=repr(exc))
    end = time.perf_counter()
    if first is None:
        return RequestResult(ok=False, error="no tokens")
    return RequestResult(
        ok=True,
        ttft_s=first - t0,
        e2e_s=end - t0,
        output_tokens=usage_tokens if usage_tokens is not None else chunks,
        itl_s=itl,
    )


async def closed_loop(
    base_url: str, bodies: list[dict], concurrency: int, path: str = "/completions"
) -> tuple[list[RequestResult], float]:
    """Send every body once with `concurrency` streams; returns results and wall time."""
    queue: asyncio.Queue[dict] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as http:

        async def run() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                results.append(await stream_completion(http, path, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(run() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = [g for r in ok for g in r.itl_s]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_median_s": statistics.median(ttft) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90),
        "itl_median_s": statistics.median(itl) if itl else None,
        "output_tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "first_errors": [r.error for r in results if not r.ok][:3],
    }
