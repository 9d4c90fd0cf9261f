"""OpenAI request bodies for /v1/chat/completions and /v1/completions (pydantic v2).

These models check types only (a wrong type is a 422 schema error). Ranges and combinations
are checked by ``validation`` so they answer 400 with the offending ``param``, as OpenAI and
vLLM do. Fields OpenAI defines that pdd does not act on (``user``, ``metadata``, ...) are
accepted and ignored, like vLLM; ``n``, ``best_of``, ``echo`` and ``suffix`` are declared so
``validation`` can reject values it cannot serve.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class PddOptions(BaseModel):
    """Extension: per-request routing overrides (``"pdd": {...}``), mainly for tests."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str | None = Field(None, description="auto | p_md | p_rld_md (router.mode pdd).")
    handoff: str | None = Field(None, description="auto | one_shot | catch_up (p_rld_md).")


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
    ignore_eos: bool = Field(False, description="Extension (vLLM).")
    include_stop_str_in_output: bool = Field(False, description="Extension (vLLM).")
    skip_special_tokens: bool = Field(True, description="Extension (vLLM).")
    pdd: PddOptions | None = Field(None, description="Extension (pdd): routing overrides.")
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
