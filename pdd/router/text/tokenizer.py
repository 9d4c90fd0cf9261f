"""The router's tokenizer: a Hugging Face model folder read without transformers.

``tokenizer.json`` is loaded with the ``tokenizers`` library; the chat template comes from
``tokenizer_config.json`` (``chat_template``) or ``chat_template.jinja`` and is rendered with a
sandboxed jinja2 environment configured the way transformers renders chat templates
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``). transformers is not used
because it may import torch, and the router never loads torch.

``TextCodec`` is immutable after loading and safe to share between threads: the API layer
renders and encodes prompts in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer

from pdd.errors import InvalidRequestError, ModelError

REPLACEMENT_CHAR = "\ufffd"
# What the template renders from the request itself; chat_template_kwargs may not set these.
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
     "pad_token", "raise_exception", "strftime_now"}
)  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """How a conversation becomes a prompt (vLLM's chat request extras).

    ``add_generation_prompt``: open the assistant's turn; ``continue_final_message``: the
    prompt ends inside the last message (an assistant's), which the answer continues;
    ``template_kwargs``: more variables for the template (e.g. ``enable_thinking``).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(
                "continue_final_message cannot be combined with add_generation_prompt (set it "
                "to false)",
                param="continue_final_message",
            )
        reserved = sorted(RESERVED_TEMPLATE_VARS & set(self.template_kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )


CHAT_DEFAULTS = ChatOptions()  # a chat completion's: the assistant's turn opened


class TextCodec:
    """Encode, decode, render chat prompts, and describe single tokens (for logprobs)."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], chat_template: str | None):
        self._tok = tokenizer
        self._special = {k: _token_content(config.get(k)) for k in _SPECIAL_KEYS}
        self._template = _compile(chat_template) if chat_template else None
        self._knows_tools = bool(chat_template) and _reads_tools(chat_template)
        self._added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self._byte_level = _is_byte_level(tokenizer)

    @classmethod
    def from_folder(cls, path: str | Path) -> TextCodec:
        """Load ``tokenizer.json`` + chat template from a HF model folder. Raises ModelError."""
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelError(f"no tokenizer.json in model folder {folder}")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
            config = _read_json(folder / "tokenizer_config.json")
        except Exception as exc:  # tokenizers raises a bare Exception on a corrupt file
            raise ModelError(f"cannot load tokenizer from {folder}: {exc}") from exc
        return cls(tokenizer, config, _find_chat_template(folder, config))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (else see ``tool_prompt``)."""
        return self._knows_tools

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token IDs of client text. Raises InvalidRequestError for text that is not valid
        Unicode (JSON can carry lone surrogates such as "\\ud800")."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as exc:
            raise InvalidRequestError(f"text cannot be tokenized: {exc}") from exc

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        options: ChatOptions = CHAT_DEFAULTS,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Apply the chat template (``tools`` as transformers passes them: None when there are
        none). With ``continue_final_message`` the text ends where the last message's content
        does, as vLLM cuts it. A template error is the client's (400)."""
        if self._template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            text = self._template.render(
                **options.template_kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=options.add_generation_prompt,
                **self._special,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. str + None
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc
        if not options.continue_final_message:
            return text
        final = messages[-1]
        cut = text.rfind(final["content"]) if final["content"] else -1
        if final["role"] != "assistant" or cut < 0:
            raise InvalidRequestError(
                "continue_final_message needs the last message to be the assistant's, with content",
                param="continue_final_message",
            )
        return text[: cut + len(final["content"])]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render with the generation prompt and tokenize (the template adds special tokens)."""
        text = self.render_chat(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)

    def pieces(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's own string of each token (e.g. "Ġthe" in a byte-level BPE)."""
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a byte-level token may be part of a character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and piece not in self._added:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """Text of one token; a partial character shows as ``bytes:\\xNN`` like OpenAI does."""
        text = self.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return text
        return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))


# --- loading helpers -----------------------------------------------------------------------

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _find_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelError(f"chat template does not compile: {exc}") from exc


def _reads_tools(source: str) -> bool:
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateError:
        return False


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes stand for themselves, every other
    byte is shifted to a code point above 255, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table: dict[str, int] = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table
