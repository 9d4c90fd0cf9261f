"""The engine core's heap trimmer (pdd.engine.heap) against glibc's real allocator."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pdd.engine import heap

# A fragmented heap: 240 MB of 60 KB buffers (below glibc's mmap threshold: they live in the
# heap), all freed but every 64th, which keeps the freed pages between them from being released
# by free() itself. Prints private resident MiB before and after one trim.
FRAGMENT = textwrap.dedent(
    """
    import sys
    from pdd.engine.heap import HeapTrimmer

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) // 1024

    bufs = [bytearray(60_000) for _ in range(4000)]
    keep = bufs[::64]
    del bufs
    before = anon()
    returned = HeapTrimmer(1).trim()
    print(before, anon(), returned)
    """
)


def test_the_c_library_can_trim() -> None:
    # vLLM's wheels are manylinux (glibc), so every host pdd runs on has malloc_trim
    assert heap.HeapTrimmer(1).supported


def test_trim_returns_freed_heap_pages_to_the_kernel() -> None:
    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()  # fmt: skip
    before, after, returned = int(out[0]), int(out[1]), out[2]
    assert returned == "True"
    assert before - after > 150, f"private memory {before} -> {after} MiB"


def test_start_from_env_runs_a_trimmer_only_when_asked(monkeypatch) -> None:
    monkeypatch.setattr(heap, "_process_trimmer", None)
    for value in ("0", "soon"):
        monkeypatch.setenv(heap.INTERVAL_ENV, value)
        assert heap.start_from_env() is None
    monkeypatch.delenv(heap.INTERVAL_ENV)
    assert heap.start_from_env() is None

    monkeypatch.setenv(heap.INTERVAL_ENV, "0.05")
    trimmer = heap.start_from_env()
    try:
        assert trimmer is not None and trimmer.interval_s == 0.05
        assert heap.start_from_env() is trimmer  # one per process
    finally:
        trimmer.stop()


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        heap.HeapTrimmer(0)
