"""The typed messages PddConnector reads from and writes to ``kv_transfer_params``.

No vLLM, no torch: the router and the roles build these and read the results without loading
the engine. Everything lives under one key, ``"pdd"``, of vLLM's free-form
``kv_transfer_params`` dict, which vLLM carries in ``SamplingParams.extra_args`` on the way in
and in ``RequestOutput.kv_transfer_params`` on the way out:

    in  (P):  {"pdd": {"export": {"transfer_id": "t1"}}}
    out (P):  {"pdd": {"exported": {"transfer_id": "t1", "num_tokens": 450, ...}}}
    in  (D):  {"pdd": {"load": {"transfer_id": "t1", "num_tokens": 450}}}
    out (D):  {"pdd": {"loaded": {"transfer_id": "t1", "num_tokens": 450, "ok": true, ...}}}

Also: ``ConnectorSettings``, the connector's ``kv_connector_extra_config`` (one per engine).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

PARAMS_KEY = "pdd"


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExportParams(_Msg):
    """On a producer (P): stream this request's prompt KV into the channel as it is computed."""

    transfer_id: str = Field(..., min_length=1, description="Channel key of the stream.")
    lease_s: float | None = Field(
        None, gt=0, description="Max seconds to hold the blocks after the request finished."
    )


class LoadParams(_Msg):
    """On a consumer (RLD/MD): load the first ``num_tokens`` prompt tokens from the channel."""

    transfer_id: str = Field(..., min_length=1, description="Channel key of the stream.")
    num_tokens: int = Field(..., gt=0, description="Prompt tokens the stream carries.")
    deadline_s: float | None = Field(
        None, gt=0, description="Max seconds to wait for the whole load, from its start."
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
    """Returned by P when its request finishes; the router forwards it as a LoadParams."""

    transfer_id: str
    num_tokens: int = Field(description="Prompt tokens whose KV entered the stream.")
    num_blocks: int
    complete: bool = Field(description="False if the export was cut short (abort, preemption).")


class LoadResult(_Msg):
    """Returned by D when its request finishes: how the load went."""

    transfer_id: str
    num_tokens: int = Field(description="Prompt tokens asked from the stream.")
    num_blocks: int
    ok: bool = Field(description="False: the load failed and vLLM recomputed the prompt.")
    seconds: float = Field(description="Load start to end, in the worker.")
    error: str | None = None


def wrap(**entries: _Msg) -> dict[str, Any]:
    """kv_transfer_params holding the given messages under the pdd key (JSON-safe)."""
    return {PARAMS_KEY: {k: v.model_dump() for k, v in entries.items()}}


class ChannelSpec(_Msg):
    """Which KV channel implementation to build, and its options."""

    kind: str = Field(
        "shm",
        description="'shm' (directory store, tests and single host) or 'package.module' of a "
        "module with make_sink(options, layout) and make_source(options, layout).",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Passed to the factory.")


class ConnectorSettings(_Msg):
    """PddConnector's ``kv_connector_extra_config``."""

    channel: ChannelSpec = Field(default_factory=ChannelSpec)
    lease_s: float = Field(
        30.0, gt=0, description="Default hold time of a finished request's blocks on P."
    )
    load_deadline_s: float = Field(30.0, gt=0, description="Default deadline of one load.")
