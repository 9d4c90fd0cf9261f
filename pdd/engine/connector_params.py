"""The typed messages PddConnector reads from and writes to ``kv_transfer_params``.

No vLLM, no torch: the worker shell, the roles and the router build these and read the results
without loading the engine. Everything lives under one key, ``"pdd"``, of vLLM's free-form
``kv_transfer_params`` dict, which vLLM carries in ``SamplingParams.extra_args`` on the way in
and in ``RequestOutput.kv_transfer_params`` (final output only) on the way out:

    in  (P):  {"pdd": {"export": {"slots": [9, 8, 7], "fence": {"index": 0, "ticket": 17}}}}
    out (P):  {"pdd": {"exported": {"num_blocks": 3, "num_tokens": 96, "complete": true,
                                    "error": null}}}
    in  (D):  {"pdd": {"load": {"slots": [9, 8, 7], "fence": {"index": 1, "ticket": 18}}}}
    out (D):  {"pdd": {"loaded": {"num_blocks": 3, "first_block": 0, "num_tokens": 96,
                                  "ok": true, "seconds": 0.0021, "error": null}}}

``slots[i]`` is the arena slot of prompt block ``i`` (tokens ``[i * block_size, (i+1) *
block_size)``), or of block ``first_block + i`` for an export that skips the blocks its caller
holds; ``first_block + len(slots)`` must not exceed the prompt's blocks, ``ceil(len(prompt) /
block_size)``. A last block cut short (the prompt's tail) is exported once the whole prompt is
computed; a load of it takes only the tokens ``LoadParams.tokens`` says the slots hold. Also:
``ConnectorSettings``, the connector's ``kv_connector_extra_config`` (one per engine).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdd.cache.arena import ArenaRef

PARAMS_KEY = "pdd"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FenceRef(_Msg):
    """Where the connector posts "done with this request's slots" (see arena.FenceBoard)."""

    index: int = Field(..., ge=0, description="Word of the engine's fence board.")
    ticket: int = Field(..., ge=1, lt=1 << 64, description="Value posted; unique per request.")


class _SlotParams(_Msg):
    slots: list[int] = Field(
        ..., min_length=1, description="Arena slot of prompt block i, for i < len(slots)."
    )
    fence: FenceRef | None = Field(
        None, description="Posted once the engine will never touch these slots again."
    )

    @field_validator("slots")
    @classmethod
    def _distinct_non_negative(cls, slots: list[int]) -> list[int]:
        if min(slots) < 0:
            raise ValueError("slot ids must be >= 0")
        if len(set(slots)) != len(slots):
            raise ValueError("slot ids must be distinct")
        return slots


class ExportParams(_SlotParams):
    """On a producer (P; MD storing its own blocks): copy prompt block ``first_block + i``
    into ``slots[i]`` as soon as it is computed."""

    first_block: int = Field(
        0, ge=0, description="Blocks below it are not copied (the caller already holds them)."
    )


class LoadParams(_SlotParams):
    """On a consumer (RLD/MD): take prompt block i from ``slots[i]`` instead of computing it."""

    tokens: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens the slots hold (None: len(slots) * block_size); less when "
        "the last slot holds a block cut short (the sender's prompt ended inside it).",
    )


class RequestKvParams(_Msg):
    """What a request asks of the connector; at most one of the two."""

    export: ExportParams | None = None
    load: LoadParams | None = None

    @classmethod
    def parse(cls, kv_transfer_params: dict[str, Any] | None) -> RequestKvParams | None:
        """The ``"pdd"`` entry of a request's kv_transfer_params, or None when absent.

        Raises pydantic.ValidationError for a malformed entry (callers turn it into a log line
        inside the engine, where raising would kill the engine core).
        """
        if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
            return None
        return cls.model_validate(kv_transfer_params[PARAMS_KEY])


class ExportResult(_Msg):
    """Returned by P when its request finishes: which slots hold the prompt's blocks."""

    num_blocks: int = Field(
        description="slots[:num_blocks - first_block] hold prompt blocks "
        "first_block..num_blocks-1 (first_block: ExportParams')."
    )
    num_tokens: int = Field(
        description="Prompt tokens the blocks hold (the last may be cut short: the prompt's tail)."
    )
    complete: bool = Field(description="Every requested slot was filled.")
    error: str | None = Field(None, description="Why the export was refused.")


class LoadResult(_Msg):
    """Returned by D when its request finishes: how much of the prompt came from slots."""

    num_blocks: int = Field(description="Blocks copied from slots[first_block:...].")
    first_block: int = Field(description="Blocks below came from vLLM's own prefix cache.")
    num_tokens: int = Field(description="Prompt tokens with KV before computing (cache + load).")
    ok: bool = Field(description="False: the load was refused; vLLM computed the prompt.")
    seconds: float | None = Field(None, description="Copy time; None if not reported yet.")
    error: str | None = None


def export_result(kv_transfer_params: dict[str, Any] | None) -> ExportResult | None:
    """P's ``exported`` result in a final output's kv_transfer_params (None: no report)."""
    raw = ((kv_transfer_params or {}).get(PARAMS_KEY) or {}).get("exported")
    return None if raw is None else ExportResult.model_validate(raw)


def load_result(kv_transfer_params: dict[str, Any] | None) -> LoadResult | None:
    """D's ``loaded`` result in a final output's kv_transfer_params (None: no report)."""
    raw = ((kv_transfer_params or {}).get(PARAMS_KEY) or {}).get("loaded")
    return None if raw is None else LoadResult.model_validate(raw)


def wrap(**entries: _Msg) -> dict[str, Any]:
    """kv_transfer_params holding the given messages under the pdd key (JSON-safe)."""
    return {PARAMS_KEY: {k: v.model_dump() for k, v in entries.items()}}


class ConnectorSettings(_Msg):
    """PddConnector's ``kv_connector_extra_config``: the shell's arenas, by name."""

    arena: ArenaRef = Field(..., description="The KV slot arena (slot_bytes = one KV block).")
    fences: ArenaRef | None = Field(
        None, description="The fence board (8-byte slots); needed by requests with a fence."
    )
    progress: ArenaRef | None = Field(
        None,
        description="The export progress board (8-byte slots, as many as fences): after each "
        "step's copies, word ``fence.index`` of an exporting request holds the end of the "
        "prompt blocks its slots hold (P streams them while it prefills).",
    )
