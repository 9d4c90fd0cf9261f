"""The per-row state of a vLLM v1 logits processor, kept in step with the persistent batch.

vLLM tells a logits processor how its batch changed (``BatchUpdate``: removed, then added, then
moved, in that order); ``update_rows`` applies that to a dict of batch index -> row state, so
each processor only says how to build a row for an added request (None: it has nothing to do
for that request)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

Row = TypeVar("Row")
NewRow = Callable[[SamplingParams, list[int] | None, list[int]], Row | None]


def update_rows(rows: dict[int, Row], batch_update: BatchUpdate | None, new_row: NewRow) -> None:
    """``new_row(params, prompt_token_ids, output_token_ids)`` for each added request; the
    output list is vLLM's live one (it grows as the request decodes)."""
    if batch_update is None:
        return
    for index in batch_update.removed:
        rows.pop(index, None)
    for index, params, prompt, output in batch_update.added:
        row = new_row(params, prompt, output) if params is not None else None
        if row is None:
            rows.pop(index, None)
        else:
            rows[index] = row
    for a, b, direction in batch_update.moved:
        ra, rb = rows.pop(a, None), rows.pop(b, None)
        if ra is not None:
            rows[b] = ra
        if rb is not None and direction is MoveDirectionality.SWAP:
            rows[a] = rb
