"""Tool calls in model text: whole-text extraction and incremental (streamed) parsing.

Two formats, named as vLLM names its ``--tool-call-parser``s, with the same results as vLLM
0.32's parsers on the same text (``tests/router/test_tool_parsers_vs_vllm.py``):

    hermes       text <tool_call>{"name": "f", "arguments": {...}}</tool_call> ...
    llama3_json  {"name": "f", "arguments": {...}}; {"name": "g", "parameters": {...}}
                 (optionally after <|python_tag|>)

Whole text (``extract``): any call that does not parse makes the whole text plain content,
never an error (vLLM's rule); text after the first call is dropped (vLLM's rule; streaming
drops it too). Streaming (``ToolCallStream``): content is released as it comes
except what may belong to a call; inside a call the name is sent once it is complete, then the
raw text of the arguments value as it arrives (concatenated, it is that value's JSON). A call
that turns out malformed before its name was sent is released as content; after that, the
fragments already sent stay sent (an OpenAI stream cannot take a delta back).

One ``ToolCallStream`` per request; not thread-safe.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: ``arguments`` is a JSON string (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())


@dataclass(frozen=True, slots=True)
class Extracted:
    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """One streamed tool-call delta: the header (id + name) or an arguments fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def extract(parser: str, text: str) -> Extracted:
    """All tool calls of a finished text. Malformed calls: the whole text is content."""
    if parser == "hermes":
        return _extract_hermes(text)
    if parser == "llama3_json":
        return _extract_llama3(text)
    raise ValueError(f"unknown tool parser {parser!r}")


def _call_from(obj: object, *, params_ok: bool) -> ToolCall:
    """A call from a decoded object; KeyError/TypeError when it is not one."""
    if not isinstance(obj, dict):
        raise TypeError("a tool call must be a JSON object")
    name = obj["name"]
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    args = obj["arguments"] if ("arguments" in obj or not params_ok) else obj["parameters"]
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _extract_hermes(text: str) -> Extracted:
    if HERMES_START not in text:
        return Extracted(text)
    try:
        bodies = [a or b for a, b in _HERMES_RE.findall(text)]
        calls = tuple(_call_from(json.loads(body), params_ok=False) for body in bodies)
    except (ValueError, KeyError, TypeError):
        return Extracted(text)
    content = text[: text.find(HERMES_START)]
    return Extracted(content or None, calls)


def _extract_llama3(text: str) -> Extracted:
    if PYTHON_TAG not in text and "{" not in text:
        return Extracted(text)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    end = -1
    try:
        for match in re.finditer(r"\{", text):
            start = match.start()
            if start <= end:  # inside an object already decoded
                continue
            obj, n = decoder.raw_decode(text[start:])
            end = start + n
            calls.append(_call_from(obj, params_ok=True))
    except (ValueError, KeyError, TypeError):
        return Extracted(text)
    return Extracted(None, tuple(calls)) if calls else Extracted(text)


# --- streaming -----------------------------------------------------------------------------


class _CallBody:
    """The raw text of one call's JSON object as it grows; finds its name and arguments.

    ``scan`` walks the text with a small JSON lexer (depth, string, escape) and records, at
    depth 1, the string value of key "name" and the span of the value of key "arguments" (or
    "parameters" for llama3_json):

        {"name": "get_weather", "arguments": {"city": "Paris"}}
                                             ^args_start        ^args_end (None until closed)
    """

    def __init__(self, arg_keys: tuple[str, ...]):
        self.text = ""
        self._arg_keys = arg_keys
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.closed_at: int | None = None  # index just past the object's closing brace
        self._pos = 0  # text[:_pos] is lexed
        self._stopped = False  # the object closed, or the text is not an object
        self._lex: tuple = (0, False, False, False, -1, None, None)

    def scan(self) -> None:  # noqa: C901 (one lexer loop reads best in one place)
        """Lex the text added since the last call (``text`` only grows: each new value starts
        with the old one), so a long call costs linear time over its stream."""
        if self._stopped:
            return
        depth, in_str, esc, in_args, str_start, key, pending = self._lex
        text, i = self.text, self._pos
        while i < len(text) and not self._stopped:
            ch = text[i]
            i += 1
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                    if depth == 1 and not in_args:
                        value = _json_str(text[str_start:i])
                        if pending is None:
                            key = value  # a key; its value comes after ":"
                        elif pending == "name":
                            self.name = value
                        pending = None
                continue
            if ch.isspace():
                continue
            if depth == 0 and ch != "{":
                self._stopped = True  # not a JSON object: nothing to report (it will not parse)
                break
            if depth == 1 and pending in self._arg_keys and ch != ":":
                self.args_start, in_args, pending = i - 1, True, None
            if ch == '"':
                in_str, str_start = True, i - 1
            elif ch == ":" and depth == 1 and key is not None:
                pending, key = key, None
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if in_args and depth == 1:
                    self.args_end, in_args = i, False
                if depth == 0:
                    if in_args:
                        self.args_end, in_args = i - 1, False
                    self.closed_at, self._stopped = i, True
            elif ch == "," and depth == 1:
                if in_args:
                    self.args_end, in_args = i - 1, False
                pending = None
        self._pos = i
        self._lex = (depth, in_str, esc, in_args, str_start, key, pending)

    def args_text(self) -> str:
        """The arguments value's raw text seen so far (all of it once ``args_end`` is set)."""
        if self.args_start is None:
            return ""
        end = self.args_end if self.args_end is not None else len(self.text)
        return self.text[self.args_start : end].rstrip()


def _json_str(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class ToolCallStream:
    """Text deltas in, (content, tool deltas) out. ``prefix``: text forced into the prompt
    that the model's output continues (``tool_choice`` required or named)."""

    def __init__(self, parser: str, *, prefix: str = "", parallel: bool = True):
        if parser not in PARSERS:
            raise ValueError(f"unknown tool parser {parser!r}")
        self._parser = parser
        self._parallel = parallel
        self._arg_keys = ("arguments",) if parser == "hermes" else ("arguments", "parameters")
        self._held = ""  # text not yet released: a possible tag or an open call
        self._in_call = False
        self._body = _CallBody(self._arg_keys)
        self._started = parser == "hermes"  # llama3: a call only at the very start
        self._after_call = False  # llama3: a call ended; more may follow after ";"
        self._sent_args = 0
        self._header_sent = False
        self._call_id = ""
        self.calls = 0  # calls whose header was sent
        self._done = False  # parallel=False and one call finished: ignore the rest
        self._prefix_pending = prefix

    def feed(self, text: str) -> tuple[str, list[ToolDelta]]:
        if self._prefix_pending:
            text, self._prefix_pending = self._prefix_pending + text, ""
        self._held += text
        return self._drain(final=False)

    def flush(self) -> tuple[str, list[ToolDelta]]:
        """End of output: release what is held (an unclosed call that parses still counts)."""
        if self._prefix_pending:
            self._held, self._prefix_pending = self._prefix_pending + self._held, ""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> tuple[str, list[ToolDelta]]:
        content: list[str] = []
        deltas: list[ToolDelta] = []
        while self._held:
            if self._done:
                self._held = ""
                break
            if not self._in_call:
                if not self._enter_call(content, final):
                    break
                continue
            if not self._advance_call(content, deltas, final):
                break
        return "".join(content), deltas

    def _enter_call(self, content: list[str], final: bool) -> bool:
        """Outside a call: release content up to a call start. True if a call started."""
        if self._parser == "llama3_json":
            return self._enter_llama3(content, final)
        at = self._held.find(HERMES_START)
        after_calls = self.calls > 0  # text after a call is dropped, as in ``extract``
        if at < 0:
            keep = 0 if final else _partial_overlap(self._held, HERMES_START)
            if not after_calls:
                content.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            return False
        if not after_calls:
            content.append(self._held[:at])
        self._held = self._held[at + len(HERMES_START) :]
        self._start_call()
        return True

    def _enter_llama3(self, content: list[str], final: bool) -> bool:
        lead = self._held.lstrip()
        if self._after_call:  # between calls: ";" then the next object, or the end
            lead = lead[1:].lstrip() if lead.startswith(";") else lead
            if lead.startswith("{"):
                self._held = lead
                self._start_call()
                return True
            if lead or final:
                self._held = ""  # text after the calls is dropped (vLLM's rule)
            return False
        if self._started:  # the output did not start with a call: all content
            content.append(self._held)
            self._held = ""
            return False
        if lead.startswith(PYTHON_TAG):
            lead = lead[len(PYTHON_TAG) :].lstrip()
        if not final and (not lead or PYTHON_TAG.startswith(lead)):
            return False
        self._started = True
        if not lead.startswith("{"):
            return True  # loop again: released as content
        self._held = lead
        self._start_call()
        return True

    def _start_call(self) -> None:
        self._in_call = True
        self._body = _CallBody(self._arg_keys)
        self._sent_args = 0
        self._header_sent = False

    def _advance_call(self, content: list[str], deltas: list[ToolDelta], final: bool) -> bool:
        """Inside a call: send what is known; at its end, go back to text. True to go on."""
        body, end_tag = self._body, -1
        if self._parser == "hermes":
            end_tag = self._held.find(HERMES_END)
            if end_tag >= 0:
                body.text = self._held[:end_tag]
            else:  # hold back what may be the start of the end tag
                body.text = self._held[: len(self._held) - _partial_overlap(self._held, HERMES_END)]
            body.scan()
            complete = end_tag >= 0
        else:
            body.text = self._held
            body.scan()
            complete = body.closed_at is not None
            if complete:
                body.text = self._held[: body.closed_at]
        if not complete and not final:
            self._send_known(deltas)
            return False
        raw = body.text
        if self._valid(raw):
            self._send_known(deltas, closing=True)
        elif not self._header_sent:  # malformed: it was text after all
            opener = HERMES_START if self._parser == "hermes" else ""
            content.append(opener + raw + (HERMES_END if end_tag >= 0 else ""))
        self._finish_call(raw, end_tag)
        return bool(self._held)

    def _valid(self, raw: str) -> bool:
        try:
            _call_from(json.loads(raw), params_ok=self._parser == "llama3_json")
        except (ValueError, KeyError, TypeError):
            return False
        return True

    def _send_known(self, deltas: list[ToolDelta], *, closing: bool = False) -> None:
        body = self._body
        if not self._header_sent and body.name is not None and body.args_start is not None:
            self._call_id = new_call_id()
            deltas.append(ToolDelta(self.calls, id=self._call_id, name=body.name))
            self._header_sent = True
            self.calls += 1
        if not self._header_sent:
            return
        args = body.args_text()
        if closing and body.args_end is None and body.args_start is None:
            args = "{}"  # a call without arguments: send an empty object
        if len(args) > self._sent_args:
            deltas.append(ToolDelta(self.calls - 1, arguments=args[self._sent_args :]))
            self._sent_args = len(args)

    def _finish_call(self, raw: str, end_tag: int) -> None:
        self._in_call = False
        if self._parser == "hermes":
            self._held = self._held[end_tag + len(HERMES_END) :] if end_tag >= 0 else ""
        else:  # llama3_json: calls are separated by ";"; other text after them is dropped
            self._held = self._held[len(raw) :]
            self._after_call = True
        if not self._parallel and self.calls:
            self._done = True


def _partial_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
