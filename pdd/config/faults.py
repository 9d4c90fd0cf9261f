"""Fault injection for tests: the ``faults:`` section of one worker (off by default).

A worker with any fault configured logs a warning at start and on every fault it injects.
Two kinds:

- KV chunk faults (``kv_send``): rules applied by this worker's transport senders to each
  outbound KV chunk just before it goes on the wire (``pdd.transfer.faulty``):

      corrupt   one payload byte is flipped: the receiver's checksum refuses the chunk and
                the transfer fails (its bytes are never used)
      delay     the chunk leaves ``delay_s`` later (the stream behind it waits too)
      drop      the chunk never arrives: the stream stalls until the transfer's deadline
                passed (a black-holed link); both ends fail the transfer at their deadline
      truncate  the connection is cut at this chunk: the transfer ends short and fails

  A rule picks chunks by index inside their transfer (``chunks``; empty: every chunk), by
  ``probability`` (seeded), by transport and by transfer size (``min_bytes``/``max_bytes``,
  so one topology can run different faults on prompts of different sizes).
- Process kills (``pdd.worker.faults``): the worker exits hard (``os._exit``, after killing
  its engine core) once it emitted ``kill_after_tokens`` tokens of one request (0: when a
  request's first output is ready, before it is sent), or when it is about to put its
  ``kill_at_kv_chunk``-th KV chunk on the wire.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdd.config.base import Section


class KvChunkFault(Section):
    action: Literal["corrupt", "delay", "drop", "truncate"] = Field(
        ..., description="What happens to a chosen chunk: corrupt | delay | drop | truncate."
    )
    chunks: list[int] = Field(
        default_factory=list,
        description="Chunk indices (0-based, inside one transfer) the rule applies to; "
        "empty: every chunk.",
    )
    probability: float = Field(
        1.0, ge=0.0, le=1.0, description="Chance that a matching chunk gets the fault."
    )
    seed: int = Field(0, description="Seed of the rule's random draws (reproducible runs).")
    delay_s: float = Field(0.0, ge=0.0, description="delay: how long the chunk is held back.")
    transport: Literal["any", "tcp", "ucx", "inproc"] = Field(
        "tcp", description="Sender transport the rule applies to (tcp: the WAN path to MD)."
    )
    min_bytes: int = Field(
        0, ge=0, description="Only transfers of at least this many payload bytes."
    )
    max_bytes: int | None = Field(
        None, ge=0, description="Only transfers of at most this many payload bytes (null: any)."
    )

    @model_validator(mode="after")
    def _check(self) -> KvChunkFault:
        if self.action == "delay" and self.delay_s <= 0:
            raise ValueError("a delay fault needs delay_s > 0")
        if any(i < 0 for i in self.chunks):
            raise ValueError("chunk indices must be >= 0")
        return self


class FaultsConfig(Section):
    kv_send: list[KvChunkFault] = Field(
        default_factory=list, description="Faults on outbound KV chunks (tests only)."
    )
    kill_after_tokens: int | None = Field(
        None,
        ge=0,
        description="Exit hard once this many tokens of one request were emitted (0: before "
        "the first). Null: never.",
    )
    kill_at_kv_chunk: int | None = Field(
        None,
        ge=1,
        description="Exit hard when the N-th KV chunk of this process (1-based, any "
        "transfer) is about to be sent. Null: never.",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.kv_send) or (
            self.kill_after_tokens is not None or self.kill_at_kv_chunk is not None
        )
