"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

What agent SDKs send by default (the OpenAI Agents SDK's ``OpenAIResponsesModel``): ``input``
(a string, or items: messages, ``function_call`` and ``function_call_output``),
``instructions``, function ``tools`` (flat: ``{"type": "function", "name", "parameters"}``),
``tool_choice``, ``text.format`` (structured outputs), ``max_output_tokens``. ``chat_body``
turns the request into the chat completion it is (instructions a system message, calls and
their outputs the assistant's ``tool_calls`` and ``tool`` messages), so it runs on every
pipeline exactly as a chat completion does; ``ResponsesFormat`` turns the chat answer into a
``response`` object (a ``message`` item with ``output_text``, a ``function_call`` item per
call) or, streamed, into the Responses events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``) with their sequence numbers. The
request's ``pdd`` record is a key of the response object (the final event's too).

Nothing is stored: ``previous_response_id``, ``conversation`` and ``background`` are a 400
naming the field (send the history as ``input`` items), as are tool types other than
``function`` and input items other than messages, calls and call outputs.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdd.errors import InvalidRequestError, PddError, WorkerError
from pdd.router.http.errors import pdd_error_body
from pdd.router.http.responses import ChatFormat, Collected, Indexed, with_pdd
from pdd.router.http.schemas import ChatCompletionRequest, PddOptions
from pdd.router.types import OutputDelta, Usage

# Fields that would need state pdd does not keep, or features it does not serve: a 400.
UNSERVED = ("previous_response_id", "conversation", "prompt", "max_tool_calls", "top_logprobs")
# A chat field named in a 400 -> the Responses field the client sent.
PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input",
          "response_format": "text.format"}  # fmt: skip


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # UNSERVED ones get a 400, annotations pass

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    background: bool = False
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    pdd: PddOptions | None = Field(None, description="Extension (pdd): routing overrides.")


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request ``body`` is. 400 naming the Responses field for what is not
    served."""
    extra = body.model_extra or {}
    for name in UNSERVED:
        if extra.get(name) is not None:
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)
    include = extra.get("include") or []
    asked = [x for x in include if x != "reasoning.encrypted_content"] if isinstance(
        include, list) else [include]  # fmt: skip
    if asked:  # extra output data; a reasoning item's encrypted content: this model has none
        raise InvalidRequestError(f"include {asked[0]!r} is not supported", param="include")
    if body.background:
        raise InvalidRequestError("background is not supported by this server", param="background")
    if body.reasoning and body.reasoning.get("effort") not in (None, "none", "minimal"):
        raise InvalidRequestError("reasoning is not supported by this model", param="reasoning")
    messages = (
        [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    )
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            _add_item(messages, item, f"input[{i}]")
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }  # fmt: skip
    for name, value in (("temperature", body.temperature), ("top_p", body.top_p),
                        ("max_completion_tokens", body.max_output_tokens), ("user", body.user),
                        ("pdd", body.pdd and body.pdd.model_dump(exclude_none=True))):  # fmt: skip
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    return chat


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """``chat_body`` validated; a part of ``body`` the chat schema refuses (a tool without a
    name, say) is a 400 naming the Responses field."""
    try:
        return ChatCompletionRequest.model_validate(chat_body(body))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "input"
        where = ".".join(str(x) for x in first["loc"])
        raise renamed(InvalidRequestError(f"{where}: {first['msg']}", param=field)) from None


def renamed(exc: PddError) -> PddError:
    """A chat validation error, naming the Responses field instead."""
    if exc.param in PARAMS and PARAMS[exc.param] != exc.param:
        exc.message = exc.message.replace(exc.param, PARAMS[exc.param])
        exc.param = PARAMS[exc.param]
    return exc


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text", "output_text", "text"
            ):  # fmt: skip
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"{where}: content part type {kind!r} is not supported (text only)",
                    param="input",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequestError(f"{where}: content must be text or text parts", param="input")


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequestError(f"{where}: role {role!r} is not supported", param="input")
        role = "system" if role == "developer" else role
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": item.get("call_id"),
                "content": output if isinstance(output, str) else json.dumps(output),
            }
        )
    elif kind != "reasoning":  # a reasoning item carries nothing this model reads
        raise InvalidRequestError(f"{where}: item type {kind!r} is not supported", param="input")


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequestError(
            f"{where}: tool type {tool.get('type')!r} is not supported (function only)",
            param="tools",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(f"tool_choice {choice!r} is not supported", param="tool_choice")


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise InvalidRequestError("text.format must be an object", param="text.format")
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError(f"text.format type {fmt.get('type')!r} is not supported",
                              param="text.format")  # fmt: skip


class ResponsesFormat:
    """The chat answer of one request as a ``response`` object, whole or as events."""

    def __init__(self, chat: ChatFormat, body: ResponsesRequest):
        self._chat = chat
        self._body = body
        self._id = "resp_" + uuid.uuid4().hex
        self._created = int(time.time())
        self._seq = 0

    def whole(self, results: list[Collected]) -> dict[str, Any]:
        (result,) = results
        message = self._chat.response(result)["choices"][0]["message"]
        output: list[dict[str, Any]] = []
        if message.get("content"):
            output.append(_message_item(_item_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls", []):
            output.append(_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))  # fmt: skip
        return with_pdd(self._object(output, result.finish_reason, result.usage), result.pdd)

    def _object(
        self, output: list[dict[str, Any]], finish: str | None, usage: Usage | None
    ) -> dict[str, Any]:
        b = self._body
        done = finish is not None
        status = "in_progress" if not done else "incomplete" if finish == "length" else "completed"
        return {
            "id": self._id, "object": "response", "created_at": self._created, "status": status,
            "model": self._chat.ctx.model, "output": output,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls,
            "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "text": b.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": b.metadata, "store": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "usage": _usage(usage) if done else None,
        }  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    async def events(self, first: Indexed, rest: AsyncIterator[Indexed]) -> AsyncIterator[bytes]:
        """The stream's events (``rest`` is closed on every exit). A failure after the start
        is an ``error`` event, then ``response.failed``."""
        async with aclosing(rest):  # type: ignore[type-var]
            async for event in self._events(first[1], rest):
                yield event

    async def _events(
        self, first: OutputDelta, rest: AsyncIterator[Indexed]
    ) -> AsyncIterator[bytes]:
        yield self._event("response.created", response=self._object([], None, None))
        yield self._event("response.in_progress", response=self._object([], None, None))
        items: list[dict[str, Any]] = []  # finished output items
        open_item: dict[str, Any] | None = None  # the message or call being streamed
        delta: OutputDelta | None = first
        try:
            while delta is not None:
                chunk = self._chat.chunk(delta) or {"choices": [{"delta": {}}]}
                choice = chunk["choices"][0]["delta"]
                if choice.get("content"):
                    if open_item is None or open_item["type"] != "message":
                        for event in self._close(open_item, items):
                            yield event
                        open_item = _message_item(_item_id("msg"), "", "in_progress")
                        for event in self._open_message(open_item, len(items)):
                            yield event
                    open_item["content"][0]["text"] += choice["content"]
                    yield self._event("response.output_text.delta", item_id=open_item["id"],
                                      output_index=len(items), content_index=0,
                                      delta=choice["content"], logprobs=[])  # fmt: skip
                for call in choice.get("tool_calls", []):
                    if "id" in call:  # a new call opens
                        for event in self._close(open_item, items):
                            yield event
                        open_item = _call_item(
                            _item_id("fc"), call["id"], call["function"]["name"], "", "in_progress"
                        )
                        yield self._event(
                            "response.output_item.added",
                            output_index=len(items),
                            item=dict(open_item),
                        )
                    fragment = call["function"].get("arguments", "")
                    if fragment and open_item is not None:
                        open_item["arguments"] += fragment
                        yield self._event("response.function_call_arguments.delta",
                                          item_id=open_item["id"], output_index=len(items),
                                          delta=fragment)  # fmt: skip
                if delta.finish_reason is not None:
                    for event in self._close(open_item, items):
                        yield event
                    final = with_pdd(
                        self._object(items, delta.finish_reason, delta.usage), delta.pdd
                    )
                    kind = "completed" if final["status"] == "completed" else "incomplete"
                    yield self._event(f"response.{kind}", response=final)
                    return
                nxt = await anext(rest, None)
                delta = None if nxt is None else nxt[1]
            raise WorkerError("the request ended without finishing")
        except PddError as exc:
            yield self._event("error", **pdd_error_body(exc)["error"])
            failed = self._object(items, "error", None)
            failed.update(status="failed", error=pdd_error_body(exc)["error"])
            yield self._event("response.failed", response=failed)

    def _open_message(self, item: dict[str, Any], index: int) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": []}
        shell = {**item, "content": []}
        return [
            self._event("response.output_item.added", output_index=index, item=shell),
            self._event("response.content_part.added", item_id=item["id"], output_index=index,
                        content_index=0, part=part),
        ]  # fmt: skip

    def _close(self, item: dict[str, Any] | None, items: list[dict[str, Any]]) -> list[bytes]:
        """The events that finish the open item; it joins ``items``."""
        if item is None or item.get("status") == "completed":
            return []
        index, out = len(items), []
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out += [
                self._event("response.output_text.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
            ]  # fmt: skip
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"]))  # fmt: skip
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        items.append(item)
        return out


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip
