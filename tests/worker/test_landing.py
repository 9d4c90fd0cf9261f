"""The shell's inbound-KV landing state machine (pdd.worker.landing.Landings) over a scripted
slot source: what it does for both receivers, and the three things the source's ``caches``
decides (RLD's pool does not cache, MD's DRC does)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from pdd.errors import TransferCancelled, TransferError
from pdd.transfer import InboundResult, TransferState
from pdd.transfer.wire import ChunkHeader
from pdd.worker.kv_wire import KvWireCheck
from pdd.worker.landing import Landing, Landings

SLOT = 16


@dataclass
class Held:
    expected: int | None = None
    blocks: set[int] = field(default_factory=set)


class Source:
    """Slots are bytearrays; ``released`` lists the landings given back, in order."""

    noun = "landing"
    opens_on_chunk = False

    def __init__(self, caches: bool) -> None:
        self.caches = caches
        self.released: list[str] = []

    def open(self, kv_id: str) -> Held:
        return Held()

    def buffer(self, rec: Landing[Held], header: ChunkHeader, src) -> memoryview:
        rec.slots.blocks.add(header.block_start)
        return memoryview(bytearray(header.nbytes))

    def verified(self, rec, header):
        return None

    def received(self, rec, done):
        return None

    def ready_blocks(self, rec: Landing[Held]) -> int:
        return len(rec.slots.blocks) if rec.inbound.done else 0

    def release(self, rec: Landing[Held]) -> None:
        self.released.append(rec.kv_id)


def landings(caches: bool) -> tuple[Landings[Held], Source]:
    source = Source(caches)
    machine = Landings(source, KvWireCheck(SLOT, lambda: None), lease_s=60)
    machine.reserve("kv", 0, False, lambda held, lease: held or Held(expected=2))
    return machine, source


def header(block: int, transfer_id: int = 1) -> ChunkHeader:
    return ChunkHeader(
        transfer_id=transfer_id, request_id="kv", chunk_index=block, chunk_count=2,
        segment_index=block, block_start=block, block_end=block + 1, layer_start=0,
        layer_end=1, dtype="uint8", shape=(SLOT,), offset=0, nbytes=SLOT,
        segment_nbytes=SLOT, total_bytes=2 * SLOT,
    )  # fmt: skip


def ended(machine: Landings[Held], state=TransferState.DONE, transfer_id: int = 1) -> None:
    machine.received(InboundResult(transfer_id, "kv", state, "", 2 * SLOT))


@pytest.mark.parametrize("caches", [False, True])
def test_after_the_generate_took_it_only_a_cache_still_lands_chunks(caches: bool) -> None:
    async def run():
        machine, source = landings(caches)
        machine.waiters.bind(asyncio.get_running_loop())
        machine.allocate(header(0))
        machine.consume("kv")  # the transfer is open: the landing stays
        if caches:
            assert machine.allocate(header(1)).nbytes == SLOT
        else:
            with pytest.raises(TransferError, match="no longer wanted"):
                machine.allocate(header(1))
        ended(machine)
        await asyncio.sleep(0)  # the settle runs on the loop
        return source.released, machine.open_records

    assert asyncio.run(run()) == (["kv"], 0)


@pytest.mark.parametrize("given_up", ["cancel", "lease"])
def test_a_chunk_after_the_landing_was_given_up_cancels_or_fails_its_transfer(given_up) -> None:
    """RLD handed off (CancelKv): the rest of P's send is refused as cancelled (the request
    moved on, not a failure); a landing whose lease ran out first fails it."""

    async def run():
        machine, _ = landings(caches=False)
        machine.waiters.bind(asyncio.get_running_loop())
        machine.allocate(header(0))
        if given_up == "cancel":
            machine.cancel("kv", "handed off to MD")
        else:
            machine.expire(now=float("inf"))
        with pytest.raises(TransferError) as refused:
            machine.allocate(header(1))
        return refused.value

    refusal = asyncio.run(run())
    if given_up == "cancel":
        assert isinstance(refusal, TransferCancelled)
        assert str(refusal) == "KV of 'kv' is no longer wanted here (handed off to MD)"
    else:
        assert not isinstance(refusal, TransferCancelled)
        assert str(refusal) == "KV of 'kv' is no longer wanted here (lease expired)"


@pytest.mark.parametrize("caches", [False, True])
def test_a_cancel_with_a_transfer_open_releases_at_once_only_for_a_cache(caches: bool) -> None:
    async def run():
        machine, source = landings(caches)
        machine.waiters.bind(asyncio.get_running_loop())
        machine.allocate(header(0))
        assert machine.cancel("kv", "switch")
        during = (list(source.released), machine.open_records)
        ended(machine, TransferState.CANCELLED)
        await asyncio.sleep(0)
        answer = await machine.await_kv("kv", 0)
        return during, (source.released, machine.open_records), answer.state

    during, after, state = asyncio.run(run())
    assert during == ((["kv"], 1) if caches else ([], 1))  # the record waits for the transfer
    assert after == (["kv"], 0) and state == "cancelled"


@pytest.mark.parametrize("caches", [False, True])
def test_cancelling_kv_that_all_arrived_keeps_it_done_only_in_a_cache(caches: bool) -> None:
    async def run():
        machine, _ = landings(caches)
        machine.waiters.bind(asyncio.get_running_loop())
        machine.allocate(header(0))
        machine.allocate(header(1))
        ended(machine)
        await asyncio.sleep(0)
        machine.cancel("kv", "late")
        answer = await machine.await_kv("kv", 0)
        return answer.state, answer.blocks_ready

    assert asyncio.run(run()) == (("done", 2) if caches else ("cancelled", 0))


def test_a_taken_landing_is_held_until_its_reader_is_done_even_after_cancel() -> None:
    async def run():
        machine, source = landings(caches=False)
        machine.waiters.bind(asyncio.get_running_loop())
        machine.allocate(header(0))
        ended(machine)
        await asyncio.sleep(0)
        rec = machine.take("kv")
        assert rec is not None and rec.users == 1
        machine.cancel("kv", "switch")
        machine.expire(now=float("inf"))
        held = list(source.released)
        machine.done_with(rec)
        return held, source.released, machine.open_records

    assert asyncio.run(run()) == ([], ["kv"], 0)


def test_a_landing_no_transfer_reached_is_given_up_when_consumed() -> None:
    async def run():
        machine, source = landings(caches=True)
        machine.waiters.bind(asyncio.get_running_loop())
        assert machine.expecting("kv")
        assert machine.take("kv") is None
        with pytest.raises(TransferError, match="no landing for the KV"):
            machine.allocate(header(0))  # too late: the record is gone
        answer = await machine.await_kv("kv", 0)
        return source.released, (answer.state, answer.reason)

    released, answer = asyncio.run(run())
    assert released == ["kv"] and answer == ("cancelled", "consumed before its KV arrived")
