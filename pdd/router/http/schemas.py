"""OpenAI request bodies for /v1/chat/completions and /v1/completions (pydantic v2).

These models check types only (a wrong type is a 422 schema error). Ranges and combinations
are checked by ``validation`` so they answer 400 with the offending ``param``, as OpenAI and
vLLM do. Fields OpenAI defines that pdd does not act on (``user``, ``metadata``, ...) are
accepted and ignored, like vLLM; fields that would change the answer and are not served get a
400 from ``request_fields`` (never a silent drop); ``n``, ``best_of``, ``echo`` and ``suffix``
are declared so ``validation`` can reject values it cannot serve.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False, description="Extension (vLLM): with include_usage, each chunk's usage so far."
    )


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCallBody(_Body):
    name: str
    arguments: str = Field(description="The call's arguments, a JSON string.")


class MessageToolCall(_Body):
    """One entry of an assistant message's ``tool_calls`` (history sent back by the client)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="role assistant.")
    tool_call_id: str | None = Field(None, description="role tool: the call this answers.")


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments.")
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class PddOptions(BaseModel):
    """Extension: per-request routing overrides (``"pdd": {...}``, an admin key's, mainly for
    tests) and hints (``CLIENT_HINTS``: any key's)."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str | None = Field(None, description="auto | p_md | p_rld_md (router.mode pdd).")
    handoff: str | None = Field(None, description="auto | one_shot | catch_up (p_rld_md).")
    kv_wait: str | None = Field(
        None,
        description="in_generate (the default: the last tier's Generate is sent at once and "
        "waits on the worker for its KV) | await_first (AwaitKv answers, then the Generate "
        "is sent: one WAN round trip more; for comparisons).",
    )
    stream_kv: bool | None = Field(
        None,
        description="Override router.pdd.stream_kv for this request: true, P's KV leaves while "
        "P prefills (each chunk's blocks as its forward ends); false, once P's token is out.",
    )
    one_off: bool | None = Field(
        None,
        description="true: this prompt's prefix will not be sent again, so when RLD ends the "
        "request before MD's KV landed the rest is not sent to MD (by default it still "
        "crosses, behind every other transfer, for the next turn). A hint any key may give.",
    )


class SamplingFields(_Body):
    """Fields shared by both endpoints. ``None`` means "not given" (defaults apply later)."""

    model: str | None = Field(None, description="Must name the served model.")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="Extension (vLLM): -1 or 0 disables.")
    max_tokens: int | None = None
    min_tokens: int = Field(0, description="Extension (vLLM).")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="Extension (vLLM).")
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = Field(None, description="Extension (vLLM).")
    min_p: float | None = Field(None, description="Extension (vLLM): 0 disables.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="Extension (vLLM): sample only among these token ids."
    )
    ignore_eos: bool = Field(False, description="Extension (vLLM).")
    cache_salt: str | None = Field(
        None,
        max_length=256,
        description="Extension (vLLM): prefix-cache namespace within the key's own: requests "
        "hit only cache their salt wrote.",
    )
    bad_words: list[str] | None = Field(
        None, description="Extension (vLLM): words never to generate (their last token is banned)."
    )
    prompt_logprobs: int | None = Field(
        None,
        description="Extension (vLLM): the logprob of each prompt token (and its top-k "
        "alternatives); not with stream.",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        description="Extension (vLLM): keep only the prompt's last N tokens (-1: as many "
        "as max_model_len holds).",
    )
    include_stop_str_in_output: bool = Field(False, description="Extension (vLLM).")
    skip_special_tokens: bool = Field(True, description="Extension (vLLM).")
    pdd: PddOptions | None = Field(None, description="Extension (pdd): routing overrides.")
    user: str | None = None


class ChatTemplateFields(_Body):
    """vLLM's chat-template extras (``tokenizer.ChatOptions``)."""

    add_generation_prompt: bool = Field(True, description="Extension (vLLM).")
    continue_final_message: bool = Field(
        False, description="Extension (vLLM): the answer continues the last (assistant) message."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM): more variables for the chat template."
    )


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    # Unknown keys are kept (``model_extra``) so validation can refuse the ones that would
    # change the answer and that pdd does not serve (``request_fields.UNSERVED_FIELDS``).
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")  # see ChatCompletionRequest

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's ``/tokenize``: ``prompt`` (text, special tokens added by default) or
    ``messages`` (rendered as /v1/chat/completions renders them, tools included)."""

    model_config = ConfigDict(extra="allow")  # unserved fields get a 400 (request_fields)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: bool | None = Field(
        None, description="Default: true for prompt, false for messages (the template's own)."
    )
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's ``/detokenize``."""

    model: str | None = None
    tokens: list[int]
