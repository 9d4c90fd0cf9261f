"""SlotArena / FenceBoard across real processes (multiprocessing spawn and fresh interpreters)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pdd.cache.arena import SHM_DIR, ArenaRef, FenceBoard, SlotArena, unlink_stale
from pdd.cache.host_tier import HostTier
from pdd.errors import CacheError

PREFIX = "pddtest"
SLOT = 1000  # deliberately not a power of two


def _ours() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


@pytest.fixture(autouse=True)
def no_leaks():
    before = _ours()
    yield
    assert _ours() - before == set(), "a test left an arena in /dev/shm"


def _pattern(seed: int, n: int = SLOT) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(n))


def _child_mirror(ref_json: str) -> None:
    """Spawned child: slot 2 := slot 1 reversed, then exit normally."""
    ref = ArenaRef.model_validate_json(ref_json)
    arena = SlotArena.attach_ref(ref)
    arena.view(2)[:] = bytes(arena.view(1))[::-1]
    arena.close()


def _child_write_and_die(ref_json: str) -> None:
    """Spawned child: write slot 0, then die by SIGKILL (no cleanup at all)."""
    arena = SlotArena.attach_ref(ArenaRef.model_validate_json(ref_json))
    arena.view(0)[:] = _pattern(5)
    os.kill(os.getpid(), signal.SIGKILL)


def _child_post_fence(ref_json: str) -> None:
    board = FenceBoard.attach(ArenaRef.model_validate_json(ref_json))
    board.post(3, (1 << 64) - 1)
    board.post(0, 42)
    board.close()


def _spawn(target, arg: str) -> int:
    proc = mp.get_context("spawn").Process(target=target, args=(arg,))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode is not None, "child did not finish"
    return proc.exitcode


def test_bytes_written_on_either_side_are_seen_by_the_other():
    with SlotArena.create(4, SLOT, PREFIX) as arena:
        arena.view(1)[:] = _pattern(1)
        assert _spawn(_child_mirror, arena.ref.model_dump_json()) == 0
        assert bytes(arena.view(2)) == _pattern(1)[::-1]
        assert bytes(arena.view(0)) == bytes(SLOT) and bytes(arena.view(3)) == bytes(SLOT)
        assert len(arena.buffer) == 4 * SLOT and len(arena.view(3)) == SLOT


def test_unlink_removes_the_segment_and_is_idempotent():
    arena = SlotArena.create(2, SLOT, PREFIX)
    path = SHM_DIR / arena.ref.name
    assert path.stat().st_size == 2 * SLOT
    arena.view(0)[:3] = b"abc"
    arena.unlink()
    assert not path.exists()
    assert bytes(arena.view(0)[:3]) == b"abc"  # the owner's mapping outlives the name
    arena.unlink()
    arena.close()
    arena.close()
    with pytest.raises(CacheError, match="closed"):
        arena.view(0)


def test_a_killed_attacher_neither_unlinks_nor_corrupts():
    with SlotArena.create(2, SLOT, PREFIX) as arena:
        arena.view(1)[:] = _pattern(9)
        assert _spawn(_child_write_and_die, arena.ref.model_dump_json()) == -signal.SIGKILL
        assert (SHM_DIR / arena.ref.name).exists()
        again = SlotArena.attach_ref(arena.ref)
        assert bytes(again.view(0)) == _pattern(5) and bytes(again.view(1)) == _pattern(9)
        again.close()


def test_attach_refuses_what_does_not_match():
    with SlotArena.create(2, SLOT, PREFIX) as arena:
        with pytest.raises(CacheError, match="expected 3000"):
            SlotArena.attach(arena.ref.name, 3, SLOT)
        attached = SlotArena.attach_ref(arena.ref)
        with pytest.raises(CacheError, match="not owned"):
            attached.unlink()
        with pytest.raises(CacheError, match="out of range"):
            attached.view(2)
        attached.close()
    with pytest.raises(CacheError, match="does not exist"):
        SlotArena.attach_ref(arena.ref)


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )


def test_no_resource_tracker_warning_and_exit_cleans_up():
    """A whole owner program: spawned attachers, then exit without unlink() (finalizer)."""
    proc = _run_python(
        f"""
        import multiprocessing as mp
        from pdd.cache.arena import SlotArena
        from tests.cache.test_arena import _child_mirror, _child_post_fence
        from pdd.cache.arena import FenceBoard
        if __name__ == "__main__":
            arena = SlotArena.create(4, {SLOT}, "{PREFIX}")
            board = FenceBoard.create(4, "{PREFIX}")
            arena.view(1)[:] = bytes(range(200)) * 5
            for target, ref in ((_child_mirror, arena.ref), (_child_post_fence, board.ref)):
                p = mp.get_context("spawn").Process(target=target, args=(ref.model_dump_json(),))
                p.start(); p.join(60); assert p.exitcode == 0
            assert bytes(arena.view(2)) == (bytes(range(200)) * 5)[::-1]
            assert (board.read(0), board.read(3)) == (42, (1 << 64) - 1)
            print(arena.ref.name, board.ref.name)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
    for name in proc.stdout.split():
        assert not (SHM_DIR / name).exists()


def test_unlink_stale_removes_only_arenas_of_dead_owners():
    proc = _run_python(
        f"""
        import os
        from pdd.cache.arena import SlotArena
        arena = SlotArena.create(1, 64, "{PREFIX}")
        print(arena.ref.name, flush=True)
        os._exit(0)  # no finalizers: as if SIGKILLed
        """
    )
    assert proc.returncode == 0, proc.stderr
    dead = proc.stdout.strip()
    assert (SHM_DIR / dead).exists()
    with SlotArena.create(1, 64, PREFIX) as alive:
        assert unlink_stale(PREFIX) == [dead]
        assert not (SHM_DIR / dead).exists() and (SHM_DIR / alive.ref.name).exists()


def test_an_arena_backs_the_drc_host_tier():
    with SlotArena.create(3, SLOT, PREFIX) as arena:
        tier = HostTier(arena.num_slots, arena.slot_bytes, arena.buffer)
        assert (tier.num_slots, tier.block_bytes) == (3, SLOT)


def test_fence_board_words_are_unsigned_64_bit():
    board = FenceBoard.create(4, PREFIX)
    try:
        assert [board.read(i) for i in range(4)] == [0, 0, 0, 0]
        assert _spawn(_child_post_fence, board.ref.model_dump_json()) == 0
        assert [board.read(i) for i in range(4)] == [42, 0, 0, (1 << 64) - 1]
        with pytest.raises(CacheError, match="8-byte slots"):
            FenceBoard(SlotArena.attach(board.ref.name, 2, 16))
    finally:
        board.close()
        board.unlink()
