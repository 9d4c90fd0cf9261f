"""Run one engine request that copies KV to or from arena slots, with exactly one release.

The slot contract of PddConnector (pdd/engine/connector.py, rule 3) says when the engine is
done with a request's slots: its final output (normal finish) proves it; after an abort only
the request's fence does. ``run_with_kv`` turns that into one call of ``release``:

    finished normally (stop/length) ........ release() right after the stream ended
    aborted / cancelled / engine failed .... release() once the fence is posted (Fences)
    refused before the engine saw it ....... release() at once (no fence will come)

"Refused before the engine saw it" is InvalidRequestError before the first delta:
Engine.generate raises it only when the engine core never received the request. A cancel
that lands before the first delta, even while vLLM is still adding the request, cannot leave
the fence unposted: Engine.generate finishes the add first, then aborts, so the engine core
always sees the request and its connector posts the fence (docs/notes/engine.md).

``release`` runs on the event loop, exactly once, and must not raise.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pdd.engine.connector_params import FenceRef, LoadParams, export_result, load_result, wrap
from pdd.engine.types import EngineDelta
from pdd.errors import InvalidRequestError
from pdd.worker.roles import GenerateCall, KvDelta

if TYPE_CHECKING:
    from pdd.engine.engine import Engine
    from pdd.worker.slots import Fences

log = logging.getLogger(__name__)

REAL_FINISHES = ("stop", "length")


async def run_with_kv(
    engine: Engine,
    fences: Fences,
    call: GenerateCall,
    params: Callable[[FenceRef], dict[str, Any]],
    release: Callable[[], None],
) -> AsyncIterator[EngineDelta]:
    """Stream ``call`` with ``params(fence)`` as its kv_transfer_params; see module doc.

    Raises what Engine.generate raises (OverloadedError when no fence is free: then
    ``release`` has already run).
    """
    try:
        fence = fences.take()
    except BaseException:
        release()
        raise
    finished = False
    started = False
    never_ran = False
    try:
        stream = engine.generate(
            call.request_id, call.prompt, call.sampling, params(fence), cache_salt=call.cache_salt
        )
        async with aclosing(stream):  # closing it early aborts the engine request
            async for delta in stream:
                started = True
                finished = delta.finish_reason in REAL_FINISHES
                yield delta
    except InvalidRequestError:
        never_ran = not started  # refused before the add: the engine core never saw it
        raise
    finally:
        end_fence(fences, fence, release, reached=not never_ran, finished=finished)


def end_fence(
    fences: Fences, fence: FenceRef, release: Callable[[], None], *, reached: bool,
    finished: bool,
) -> None:  # fmt: skip
    """The request that carried ``fence`` ended: ``release`` its slots now when the engine
    core never saw it (no post will come) or it finished normally (its final output proves the
    engine is done with them), else once the engine posted the fence (module doc)."""
    if not reached:
        fences.forget(fence)
        release()
    elif finished:
        fences.retire(fence)
        release()
    else:
        fences.watch(fence, release)


async def plain(engine: Engine, call: GenerateCall) -> AsyncIterator[EngineDelta]:
    """The request without KV params (closing it early aborts the engine request)."""
    stream = engine.generate(
        call.request_id, call.prompt, call.sampling, cache_salt=call.cache_salt
    )
    async with aclosing(stream):
        async for delta in stream:
            yield delta


def load_params(
    slots: list[int], tokens: int | None = None
) -> Callable[[FenceRef], dict[str, Any]]:
    """kv_transfer_params that load prompt block i from ``slots[i]`` (``tokens``: the prompt
    tokens they hold, when the last is a block cut short)."""
    return lambda fence: wrap(load=LoadParams(slots=slots, tokens=tokens, fence=fence))


def offered_tokens(
    num_slots: int, block_size: int, prompt_len: int, tokens: int | None = None
) -> int:
    """Prompt tokens a load of ``num_slots`` blocks (holding ``tokens``) provides (vLLM
    computes at least one)."""
    held = num_slots * block_size if tokens is None else tokens
    return min(held, prompt_len - 1) if num_slots else 0


def loaded_tokens(delta: EngineDelta, offered: int, block_size: int) -> int:
    """Prompt tokens the connector copied from slots (final delta; blocks vLLM's own prefix
    cache held are not counted); ``offered`` when the delta carries no report."""
    loaded = load_result(delta.kv_transfer_params)
    if loaded is None:
        return offered
    if not loaded.ok or not loaded.num_blocks:
        return 0
    return loaded.num_tokens - loaded.first_block * block_size


def exported_blocks(kv_transfer_params: dict[str, Any] | None) -> int:
    """Whole prompt blocks the connector copied into slots (slots[:n] hold blocks 0..n-1);
    0 when it reported none or refused the export (logged)."""
    result = export_result(kv_transfer_params)
    if result is None:
        return 0
    if result.error is not None:
        log.warning("KV export refused by the connector: %s", result.error)
    return result.num_blocks


async def stream_loading(
    engine: Engine,
    fences: Fences,
    call: GenerateCall,
    slots: list[int],
    block_size: int,
    release: Callable[[], None],
    tokens: int | None = None,
) -> AsyncIterator[KvDelta]:
    """Run ``call`` loading prompt block i from ``slots[i]`` (``tokens``: what they hold, as
    in load_params); ``release`` as in run_with_kv, or earlier: at the first delta with a
    token, since the connector reads the slots in the request's first step only (it loads
    once). The first delta reports the tokens offered, the final one what the connector
    copied."""
    offered = offered_tokens(len(slots), block_size, len(call.prompt), tokens)
    released = False

    def release_once() -> None:
        nonlocal released
        if not released:
            released = True
            release()

    stream = run_with_kv(engine, fences, call, load_params(slots, tokens), release_once)
    first = True
    async with aclosing(stream):
        async for delta in stream:
            if delta.token_ids:  # the forward after the load ran: the slots are free
                release_once()
            loaded = offered if first else 0
            if delta.finished:
                loaded = loaded_tokens(delta, offered, block_size)
            first = False
            yield KvDelta(delta, loaded_tokens=loaded)
