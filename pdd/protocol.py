"""Ids and enums shared by every layer. No torch, no I/O."""

from __future__ import annotations

import enum
import uuid


class Role(str, enum.Enum):
    """What one worker process does."""

    COLOCATED = "colocated"  # one engine does prefill and decode (baseline, `pdd serve` default)
    PREFILL = "prefill"
    RELAY_DECODE = "relay_decode"
    MAIN_DECODE = "main_decode"


class RouterMode(str, enum.Enum):
    """Which serving flow the router runs (the baselines share all code with pdd)."""

    COLOCATED = "colocated"
    PD_LOCAL = "pd_local"
    PD_WAN = "pd_wan"
    PDD = "pdd"


class Pipeline(str, enum.Enum):
    """The path one request takes. P-RLD alone is not a pipeline, by design."""

    COLOCATED = "colocated"
    PD = "pd"
    P_MD = "p_md"
    P_RLD_MD = "p_rld_md"


class HandoffMode(str, enum.Enum):
    NONE = "none"
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"
    RLD_FINISHED = "rld_finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# Sampling bounds the router checks (a 400 naming the field) and the engine re-checks: one
# source, so a value the router admits is never a worker's 400.
MAX_LOGPROBS = 20
MAX_REPETITION_PENALTY = 100.0  # vLLM has no bound; past this every token is suppressed anyway
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
