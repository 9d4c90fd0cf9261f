"""HTTP endpoints: the OpenAI API, health, metrics and debug views.

Handlers stay thin: validate (``validation``), tokenize in a thread, hand the typed request to
``RouterService.stream``, format (``responses``). A streamed response waits for the first
delta before sending headers, so routing and worker failures before the first token still
get their proper status (429/503/502) instead of an error inside a 200 stream. Every
completion response carries the ``x-pdd-pipeline`` header (the pipeline that served it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from pdd.errors import InvalidRequestError, PddError, WorkerError
from pdd.observability.context import bind_request
from pdd.protocol import new_request_id
from pdd.router.debug import recent_view, request_view, workers_view
from pdd.router.http.admission import with_deadline
from pdd.router.http.request_fields import (
    bad_words,
    chat_options,
    check_unserved,
    constraint,
    tool_plan,
    with_tool_call,
)
from pdd.router.http.responses import (
    Answer,
    ChatFormat,
    Choices,
    Collected,
    CompletionFormat,
    ResponseContext,
    collected,
)
from pdd.router.http.responses_api import (
    ResponsesFormat,
    ResponsesRequest,
    chat_request,
    renamed,
)
from pdd.router.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from pdd.router.http.sse import (
    ClientDisconnected,
    EventStreamResponse,
    cancel_on_disconnect,
    merged,
)
from pdd.router.http.tenants import check_overrides, grant_of
from pdd.router.http.validation import (
    build_chat_request,
    build_completion_request,
    chat_messages,
    check_model,
    check_token_ids,
    choice_requests,
    completion_prompt,
)
from pdd.router.metrics import CONTENT_TYPE
from pdd.router.state import RouterState
from pdd.router.text.tool_prompt import ToolPlan, prompt_ids, prompt_text
from pdd.router.types import GenerationRequest, OutputDelta, PddSummary

router = APIRouter()

PIPELINE_HEADER = "x-pdd-pipeline"


def _state(request: Request) -> RouterState:
    return request.app.state.pdd


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    reqs, plan, ctx = await _chat_requests(body, request, time.monotonic(), "chatcmpl")
    answer = Choices([ChatFormat(ctx, plan, i) for i in range(len(reqs))])
    return await _respond(request, _state(request), reqs, answer, stream=body.stream)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API, served as the chat completion it is (``responses_api``)."""
    arrival = time.monotonic()
    try:
        chat = chat_request(body)
        (req,), plan, ctx = await _chat_requests(chat, request, arrival, "resp")
    except PddError as exc:
        raise renamed(exc) from None
    answer = ResponsesFormat(ChatFormat(ctx, plan), body)
    return await _respond(request, _state(request), [req], answer, stream=body.stream)


async def _chat_requests(
    body: ChatCompletionRequest, request: Request, arrival: float, prefix: str
) -> tuple[list[GenerationRequest], ToolPlan | None, ResponseContext]:
    """A chat body's request per choice, its tool plan and its response context."""
    st = _state(request)
    check_model(body.model, st.limits)
    check_overrides(body.pdd, request.scope)  # 403 unless an admin key
    check_unserved(body)
    structured = constraint(body)
    st.service.check_capacity()
    messages = chat_messages(body.messages)
    plan = tool_plan(body, st.cfg.model.tool_parser)
    structured = with_tool_call(structured, plan)
    options = chat_options(body)
    prompt = await asyncio.to_thread(prompt_ids, st.codec, messages, plan, options)
    rid = new_request_id(prefix)
    req = build_chat_request(body, prompt, st.limits, request_id=rid, arrival=arrival)
    req = _with_bad_words(replace(req, constraint=structured), body, st)
    if plan is not None and plan.parses and plan.parser == "hermes":
        # vLLM's hermes rule: <tool_call> is a special token in some models' vocabularies
        req = replace(req, text=replace(req.text, skip_special_tokens=False))
    req = _in_tenant_cache(request, req, body)
    reqs = choice_requests(req, body.n, st.cfg.router.max_queued_requests)
    _charge(request, reqs)
    return reqs, plan, _context(st, req, body.stream_options, logprobs=body.logprobs)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    st = _state(request)
    check_model(body.model, st.limits)
    check_overrides(body.pdd, request.scope)  # 403 unless an admin key
    check_unserved(body)
    structured = constraint(body)
    st.service.check_capacity()
    prompt = completion_prompt(body)
    if isinstance(prompt, str):
        prompt_ids = await asyncio.to_thread(st.codec.encode, prompt)
    else:
        check_token_ids(prompt, st.limits, "prompt")
        prompt_ids = list(prompt)
    rid = new_request_id("cmpl")
    req = build_completion_request(
        body, prompt_ids, st.limits, request_id=rid, arrival=arrival, decode=_prompt_text(st)
    )
    req = _with_bad_words(replace(req, constraint=structured), body, st)
    req = _in_tenant_cache(request, req, body)
    reqs = choice_requests(req, body.n, st.cfg.router.max_queued_requests)
    _charge(request, reqs)
    ctx = _context(st, req, body.stream_options, logprobs=body.logprobs is not None)
    answer = Choices([CompletionFormat(ctx, i) for i in range(len(reqs))])
    return await _respond(request, st, reqs, answer, stream=body.stream)


def _prompt_text(st: RouterState) -> Callable[[Sequence[int]], str]:
    """The text of prompt token ids, as an echo shows it (special tokens included)."""
    return lambda ids: st.codec.decode(ids, skip_special_tokens=False)


def _with_bad_words(
    req: GenerationRequest, body: ChatCompletionRequest | CompletionRequest, st: RouterState
) -> GenerationRequest:
    """The request with vLLM's ``bad_words`` tokenized (``request_fields.bad_words``)."""
    if not body.bad_words:
        return req
    words = bad_words(body.bad_words, st.codec)
    return replace(req, sampling=replace(req.sampling, bad_words=words))


def _in_tenant_cache(
    request: Request, req: GenerationRequest, body: ChatCompletionRequest | CompletionRequest
) -> GenerationRequest:
    """The request in its key's prefix-cache namespace (pdd.router.http.tenants), narrowed by
    the body's own ``cache_salt`` (vLLM's) when it gives one."""
    salt = grant_of(request.scope).cache_salt
    if body.cache_salt:
        salt = json.dumps([salt, body.cache_salt])
    return replace(req, cache_salt=salt)


def _charge(request: Request, reqs: list[GenerationRequest]) -> None:
    """The key's limits per minute (429 + Retry-After); app.state.pdd_key_limiter. The
    prompt counts once, every choice's max_tokens."""
    limiter = getattr(request.app.state, "pdd_key_limiter", None)
    if limiter is not None:
        tokens = len(reqs[0].prompt_token_ids) + sum(r.sampling.max_tokens for r in reqs)
        limiter.admit(request.scope, tokens)


def _context(
    st: RouterState, req: GenerationRequest, options: StreamOptions | None, *, logprobs: bool
) -> ResponseContext:
    options = options or StreamOptions()
    return ResponseContext(
        req.request_id, int(time.time()), st.model_name, options.include_usage, logprobs,
        continuous_usage=options.include_usage and options.continuous_usage_stats,
        prompt_tokens=len(req.prompt_token_ids),
    )  # fmt: skip


async def _respond(
    request: Request, st: RouterState, reqs: list[GenerationRequest], answer: Answer,
    *, stream: bool,
) -> Response:  # fmt: skip
    """Run the request of each choice (``choice_requests``) and give ``answer`` what they
    produce: whole, or streamed."""
    bind_request(reqs[0].request_id)  # logs and worker RPCs of this request carry its id
    timeout_s = st.cfg.router.request_timeout_s
    sources = [with_deadline(st.service.stream(r), r.arrival + timeout_s, timeout_s) for r in reqs]
    deltas = merged(sources, start=lambda i: bind_request(reqs[i].request_id))
    try:
        if not stream:
            results = await cancel_on_disconnect(request.receive, _collect_all(deltas, len(reqs)))
            return JSONResponse(answer.whole(results), headers=_pdd_headers(results[0].pdd))
        first = await cancel_on_disconnect(request.receive, anext(deltas))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads this; the request was cancelled
    except StopAsyncIteration:
        raise WorkerError("the request ended without output") from None
    return EventStreamResponse(answer.events(first, deltas), headers=_pdd_headers(first[1].pdd))


async def _collect_all(deltas: AsyncIterator[tuple[int, OutputDelta]], n: int) -> list[Collected]:
    """Every choice's whole result from the merged deltas."""
    by_choice: list[list[OutputDelta]] = [[] for _ in range(n)]
    async with aclosing(deltas):  # type: ignore[type-var]
        async for i, delta in deltas:
            by_choice[i].append(delta)
    return [collected(ds) for ds in by_choice]


def _pdd_headers(summary: PddSummary | None) -> dict[str, str]:
    return {} if summary is None else {PIPELINE_HEADER: summary.pipeline}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(_state(request))]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    """OpenAI's retrieve: the served model's card, or 404 model_not_found."""
    st = _state(request)
    check_model(model, st.limits)
    return JSONResponse(_model_card(st))


def _model_card(st: RouterState) -> dict:
    return {
        "id": st.model_name,
        "object": "model",
        "created": st.started_at,
        "owned_by": "pdd",
        "root": st.model_name,  # never the model's filesystem path
        "max_model_len": st.limits.max_model_len,
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """vLLM's /tokenize: the token ids /v1/completions (``prompt``) or /v1/chat/completions
    (``messages``) would send for the same input."""
    st = _state(request)
    check_model(body.model, st.limits)
    check_unserved(body)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        messages = chat_messages(body.messages)
        plan = tool_plan(body, st.cfg.model.tool_parser)
        text = await asyncio.to_thread(prompt_text, st.codec, messages, plan, chat_options(body))
        special = bool(body.add_special_tokens)
    else:
        text, special = body.prompt, body.add_special_tokens is not False
    ids = await asyncio.to_thread(st.codec.encode, text, add_special_tokens=special)
    strs = st.codec.pieces(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": st.limits.max_model_len,
                         "tokens": ids, "token_strs": strs})  # fmt: skip


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """vLLM's /detokenize: the text of token ids (special tokens kept, as vLLM's)."""
    st = _state(request)
    check_model(body.model, st.limits)
    check_token_ids(body.tokens, st.limits, "tokens")
    text = await asyncio.to_thread(st.codec.decode, body.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = _state(request)
    body: dict = {"workers": st.pool.describe()}
    insecure = getattr(request.app.state, "pdd_insecure", None)
    if insecure:  # security.insecure let this router start without these credentials
        body["insecure"] = insecure
    if st.pool.any_healthy():
        return JSONResponse({"status": "ok", **body})
    return JSONResponse(
        {"status": "unavailable", **body}, status_code=503, headers={"Retry-After": "1"}
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = _state(request)
    st.metrics.update_fleet(st.pool.view())
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/debug/config")
async def debug_config(request: Request) -> JSONResponse:
    return JSONResponse(_state(request).cfg.model_dump(mode="json"))


@router.get("/debug/workers")
async def debug_workers(request: Request) -> JSONResponse:
    st = _state(request)
    return JSONResponse({"mode": st.cfg.router.mode.value, "in_flight": st.service.in_flight,
                         "workers": workers_view(st.pool),
                         "not_admitted": st.pool.refused()})  # fmt: skip


@router.get("/debug/requests")
async def debug_requests(request: Request) -> JSONResponse:
    """The requests kept for debugging (router.debug_requests), newest first."""
    return JSONResponse({"requests": recent_view(_state(request).requests)})


@router.get("/debug/requests/{request_id}")
async def debug_request(request_id: str, request: Request) -> JSONResponse:
    """One recent request: its route decision, timeline, and outcome (404 if not kept)."""
    st = _state(request)
    record = st.requests.get(request_id)
    if record is None:
        raise HTTPException(404, f"request {request_id!r} is not among the recent requests")
    sla = (st.cfg.router.sla_ttft_s, st.cfg.router.sla_tpot_s)
    return JSONResponse(request_view(record, sla))
