"""The proxy of vLLM's own P/D flow (the `vllm_nixl` benchmark mode), as vLLM's P/D examples
run it: one OpenAI-compatible endpoint in front of a prefill and a decode `vllm serve`.

Per request (``/v1/completions`` and ``/v1/chat/completions``)::

    client -> proxy -> P: the body with max_tokens 1, not streamed, and
                          kv_transfer_params {"do_remote_decode": true}
                       <- P: its one token (dropped) and kv_transfer_params naming the blocks
                          P holds for D (and its NIXL side channel)
              proxy -> D: the client's body with P's kv_transfer_params
                       <- D: pulls the blocks its own prefix cache lacks from P (NIXL READ),
                          then streams every token: relayed to the client as it comes

An error from P is the client's answer (P's status and body); D's answer is relayed whole.
Run by `pdd bench serve` next to P: ``python -m pdd.bench.serve.nixl_proxy --prefill URL
--decode URL --host H --port N``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What P needs to keep the prompt's blocks for D instead of freeing them when it finishes.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P's request: the client's, for one token, not streamed, holding its KV for D."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """D's request: the client's, with what P said about the blocks it holds."""
    return dict(body, kv_transfer_params=kv_transfer_params)


def bad_gateway(message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "server_error", "code": 502}}, status_code=502
    )


def build_app(
    prefill: str,
    decode: str,
    timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,  # tests only
) -> FastAPI:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    clients = {
        url: httpx.AsyncClient(
            base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport
        )
        for url in (prefill, decode)
    }

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(title="vLLM P/D proxy (pdd bench serve, vllm_nixl)", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        async def one(url: str) -> int:
            try:
                return (await clients[url].get("/health", timeout=5)).status_code
            except httpx.HTTPError:
                return 503

        codes = await asyncio.gather(one(prefill), one(decode))
        ok = all(c == 200 for c in codes)
        body = {"prefill": codes[0], "decode": codes[1]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        resp = await clients[decode].get("/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def relay(path: str, request: Request) -> Response:
        body = await request.json()
        try:
            first = await clients[prefill].post(path, json=prefill_body(body))
        except httpx.HTTPError as exc:
            return bad_gateway(f"prefill {prefill}: {type(exc).__name__}: {exc}")
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        params = first.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return bad_gateway("prefill returned no kv_transfer_params: is its "
                               "kv_transfer_config a NixlConnector?")  # fmt: skip
        req = clients[decode].build_request("POST", path, json=decode_body(body, params))
        try:
            resp = await clients[decode].send(req, stream=True)
        except httpx.HTTPError as exc:
            return bad_gateway(f"decode {decode}: {type(exc).__name__}: {exc}")
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", required=True, help="P's base URL (http://host:port)")
    ap.add_argument("--decode", required=True, help="D's base URL (http://host:port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    print(f"vllm_nixl proxy on {args.host}:{args.port}: prefill {args.prefill}, decode "
          f"{args.decode}", flush=True)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
