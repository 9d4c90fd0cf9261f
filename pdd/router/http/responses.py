"""OpenAI response bodies: chat and text completions, streamed chunks and whole responses.

Pure formatting from ``OutputDelta``s (no I/O). Shapes follow OpenAI's API reference:
``chat.completion`` / ``chat.completion.chunk`` (logprobs as ``{"content": [...]}``) and
``text_completion`` (legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset).
With ``stream_options.include_usage`` every chunk carries ``"usage": null`` and one extra chunk
with empty ``choices`` carries the usage, as OpenAI does; with vLLM's
``continuous_usage_stats`` too, every chunk carries the usage so far instead of null.

Extensions: vLLM's ``prompt_logprobs`` (a key of the completion's choice, of the chat
response; only when asked): ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]``,
one entry per prompt token, the prompt's own token first, then its top alternatives. The
request's ``"pdd"`` record (``types.PddSummary``) is a top-level key of the
whole response and of the streamed chunk that carries ``finish_reason`` (always sent, unlike
the usage chunk); other chunks have no ``pdd`` key.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdd.errors import PddError, WorkerError
from pdd.router.http.errors import pdd_error_body
from pdd.router.http.sse import DONE, sse_event
from pdd.router.text.tool_calls import ToolCallStream, ToolDelta, extract
from pdd.router.text.tool_prompt import ToolPlan
from pdd.router.types import LogprobText, OutputDelta, PddSummary, Usage

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class ResponseContext:
    response_id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: bool = False
    continuous_usage: bool = False  # each chunk's usage so far (needs include_usage)
    prompt_tokens: int = 0


class RunningUsage:
    """A stream's ``usage`` key: null, or with ``continuous_usage`` the tokens so far."""

    def __init__(self, ctx: ResponseContext):
        self._ctx = ctx
        self._tokens = 0

    def count(self, delta: OutputDelta) -> None:
        self._tokens += len(delta.token_ids)

    def stamp(self, body: dict[str, Any]) -> dict[str, Any]:
        c = self._ctx
        if c.include_usage:
            running = Usage(c.prompt_tokens, self._tokens) if c.continuous_usage else None
            body["usage"] = usage_body(running)
        return body


@dataclass(slots=True)
class Collected:
    """A whole (non-streamed) result."""

    text: str = ""
    logprobs: list[LogprobText] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    pdd: PddSummary | None = None
    prompt_logprobs: tuple[LogprobText, ...] | None = None


def collected(deltas: Sequence[OutputDelta]) -> Collected:
    """One choice's whole result from its deltas."""
    out = Collected()
    for d in deltas:
        out.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            out.prompt_logprobs = d.prompt_logprobs
        if d.pdd is not None:
            out.pdd = d.pdd
        if d.finish_reason is not None:
            out.finish_reason, out.usage = d.finish_reason, d.usage
    out.text = "".join(d.text for d in deltas)
    return out


def combined_usage(usages: Sequence[Usage | None]) -> Usage | None:
    """The usage of a request's choices: the prompt counted once (as vLLM and OpenAI count
    it), every choice's tokens; None when a choice has none."""
    if not usages or any(u is None for u in usages):
        return None
    first = usages[0]
    assert first is not None
    tokens = sum(u.completion_tokens for u in usages if u is not None)
    return Usage(first.prompt_tokens, tokens, first.cached_tokens)


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def with_pdd(body: dict[str, Any], summary: PddSummary | None) -> dict[str, Any]:
    if summary is not None:
        body["pdd"] = summary.as_json()
    return body


def _lp(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def with_prompt_logprobs(
    body: dict[str, Any], entries: tuple[LogprobText, ...] | None
) -> dict[str, Any]:
    """``body["prompt_logprobs"]`` in vLLM's shape when the request asked for them."""
    if entries is None:
        return body
    positions: list[dict[str, dict[str, Any]] | None] = [None]
    for e in entries:
        own = {"logprob": _lp(e.logprob or 0.0), "rank": e.rank, "decoded_token": e.token}
        position = {str(e.token_id): own}
        for rank, t in enumerate(e.top, 1):
            entry = {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": t.token}
            position.setdefault(str(t.token_id), entry)
        positions.append(position)
    body["prompt_logprobs"] = positions
    return body


class ChatFormat:
    """chat.completion and chat.completion.chunk bodies. With a ``ToolPlan`` that parses, the
    text is searched for tool calls (``text.tool_calls``): one instance per request, since
    streaming keeps the parser's state."""

    def __init__(self, ctx: ResponseContext, tools: ToolPlan | None = None, index: int = 0):
        self.ctx = ctx
        self.index = index  # the choice this instance formats (n > 1: one instance each)
        self._usage = RunningUsage(ctx)
        self._plan = tools if tools is not None and tools.parses else None
        self._stream = None
        if self._plan is not None:
            self._stream = ToolCallStream(
                self._plan.parser, prefix=self._plan.forced_prefix, parallel=self._parallel
            )

    @property
    def _parallel(self) -> bool:
        plan = self._plan
        return plan is not None and plan.parallel and plan.choice in ("auto", "required")

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.ctx
        return self._usage.stamp({
            "id": c.response_id, "object": "chat.completion.chunk", "created": c.created,
            "model": c.model, "choices": choices,
        })  # fmt: skip

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        return [self._chunk([choice])]

    def chunk(self, delta: OutputDelta) -> dict[str, Any] | None:
        """One chunk, or None when there is nothing to send yet (text held by the parser)."""
        self._usage.count(delta)
        content, calls = delta.text, []
        if self._stream is not None:
            content, calls = self._stream.feed(delta.text)
            if delta.finish_reason is not None:
                more, tail = self._stream.flush()
                content, calls = content + more, calls + tail
        if not (content or calls or delta.logprobs or delta.finish_reason is not None):
            return None
        body: dict[str, Any] = {"content": content} if content else {}
        if calls:
            body["tool_calls"] = tool_call_deltas(calls)
        called = self._stream is not None and self._stream.calls > 0
        choice = {
            "index": self.index,
            "delta": body,
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": _finish(delta.finish_reason, called),
        }
        return with_pdd(self._chunk([choice]), delta.pdd if delta.finish_reason else None)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage_body(usage)
        return body

    def response(self, result: Collected) -> dict[str, Any]:
        c = self.ctx
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if self._plan is not None:
            found = extract(self._plan.parser, self._plan.forced_prefix + result.text)
            calls = found.calls if self._parallel else found.calls[:1]
            message["content"] = found.content
            if calls:
                message["tool_calls"] = [
                    {"id": t.id, "type": "function",
                     "function": {"name": t.name, "arguments": t.arguments}}
                    for t in calls
                ]  # fmt: skip
        choice = {
            "index": self.index,
            "message": message,
            "logprobs": self._logprobs(result.logprobs),
            "finish_reason": _finish(result.finish_reason, "tool_calls" in message),
        }
        body = {
            "id": c.response_id, "object": "chat.completion", "created": c.created,
            "model": c.model, "choices": [choice], "usage": usage_body(result.usage),
        }  # fmt: skip
        return with_pdd(with_prompt_logprobs(body, result.prompt_logprobs), result.pdd)

    def _logprobs(self, entries: list[LogprobText] | tuple[LogprobText, ...]) -> Any:
        if not self.ctx.logprobs:
            return None
        content = [
            {
                "token": e.token,
                "logprob": _lp(e.logprob or 0.0),
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.token_bytes)}
                    for t in e.top
                ],
            }
            for e in entries
        ]
        return {"content": content}


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_call_deltas(deltas: list[ToolDelta]) -> list[dict[str, Any]]:
    """Streamed ``delta.tool_calls``: a call's first entry has index, id, type and name (and
    arguments ""), later ones index and an arguments fragment; one entry per call per chunk."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
            continue
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id is not None:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        out.append(entry)
    return out


class CompletionFormat:
    """text_completion bodies (streamed and whole)."""

    def __init__(self, ctx: ResponseContext, index: int = 0):
        self.ctx = ctx
        self.index = index  # the choice this instance formats (n > 1: one instance each)
        self._usage = RunningUsage(ctx)

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.ctx
        return {
            "id": c.response_id, "object": "text_completion", "created": c.created,
            "model": c.model, "choices": choices,
        }  # fmt: skip

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: OutputDelta) -> dict[str, Any] | None:
        self._usage.count(delta)
        if not (delta.text or delta.logprobs or delta.finish_reason is not None):
            return None
        body = self._body([self._choice(delta.text, delta.logprobs, delta.finish_reason)])
        return with_pdd(self._usage.stamp(body), delta.pdd if delta.finish_reason else None)

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        body = self._body([])
        body["usage"] = usage_body(usage)
        return body

    def response(self, result: Collected) -> dict[str, Any]:
        choice = self._choice(result.text, result.logprobs, result.finish_reason)
        body = self._body([with_prompt_logprobs(choice, result.prompt_logprobs)])
        body["usage"] = usage_body(result.usage)
        return with_pdd(body, result.pdd)

    def _choice(self, text: str, entries: Any, finish_reason: str | None) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": text,
            "logprobs": self._logprobs(entries),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: list[LogprobText] | tuple[LogprobText, ...]) -> Any:
        if not self.ctx.logprobs:
            return None
        top: list[dict[str, float] | None] = []
        for e in entries:
            if e.logprob is None:  # an echoed prompt's first token
                top.append(None)
                continue
            alternatives = {t.token: _lp(t.logprob) for t in e.top}
            alternatives.setdefault(e.token, _lp(e.logprob))
            top.append(alternatives)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [None if e.logprob is None else _lp(e.logprob) for e in entries],
            "top_logprobs": top,
            "text_offset": [e.text_offset for e in entries],
        }


Format = ChatFormat | CompletionFormat
Indexed = tuple[int, OutputDelta]  # a choice's index and one of its deltas (``sse.merged``)


class Answer(Protocol):
    """How a request's choices become its HTTP answer (``Choices``; the Responses API's
    ``responses_api.ResponsesFormat``)."""

    def whole(self, results: list[Collected]) -> dict[str, Any]:
        """The body of the non-streamed answer; ``results[i]`` is choice i's."""
        ...

    def events(self, first: Indexed, rest: AsyncIterator[Indexed]) -> AsyncIterator[bytes]:
        """The stream's SSE bytes; it closes ``rest`` on every exit."""
        ...


class Choices:
    """Chat and text completions: ``fmts[i]`` formats choice i."""

    def __init__(self, fmts: Sequence[Format]):
        self._fmts = fmts

    def whole(self, results: list[Collected]) -> dict[str, Any]:
        """With n > 1 the usage is ``combined_usage`` and each choice carries its own ``pdd``
        record (each choice is a request of its own; the top-level record is the first's)."""
        fmts = self._fmts
        body = fmts[0].response(results[0])
        if len(results) == 1:
            return body
        body["choices"] = []
        for fmt, result in zip(fmts, results, strict=True):
            choice = fmt.response(result)["choices"][0]
            if result.pdd is not None:
                choice["pdd"] = result.pdd.as_json()
            body["choices"].append(choice)
        body["usage"] = usage_body(combined_usage([r.usage for r in results]))
        return body

    async def events(self, first: Indexed, rest: AsyncIterator[Indexed]) -> AsyncIterator[bytes]:
        """Chunks for one stream of every choice. A failure after the first chunk becomes an
        error event."""
        fmts = self._fmts
        async with aclosing(rest):  # type: ignore[type-var]
            for fmt in fmts:
                for body in fmt.opening_chunks():
                    yield sse_event(body)
            finished: dict[int, Usage | None] = {}
            i, delta = first
            try:
                while True:
                    body = fmts[i].chunk(delta)
                    if body is not None:
                        yield sse_event(body)
                    if delta.finish_reason is not None:
                        finished[i] = delta.usage
                        if len(finished) == len(fmts):
                            break
                    i, delta = await anext(rest)
            except StopAsyncIteration:
                yield sse_event(pdd_error_body(WorkerError("the request ended without finishing")))
            except PddError as exc:
                yield sse_event(pdd_error_body(exc))
            else:
                if fmts[0].ctx.include_usage:
                    usages = [finished[k] for k in range(len(fmts))]
                    yield sse_event(fmts[0].usage_chunk(combined_usage(usages)))
            yield DONE
