"""Keeps a CPU engine process's C heap from growing without bound under varied prompt lengths.

Measured on vLLM 0.32 CPU (`docs/notes/engine.md`, "Memory"): a prefill engine fed prompts of
many lengths grew its private memory ~1 MiB per request, for as long as the soak ran, all of it
in the engine core's C heap (Python objects stayed flat). Two causes, two remedies:

1. oneDNN caches a compiled matmul per input shape, and a prefill step's token count is a new
   shape almost every time: oneDNN's process-wide primitive cache (1,024 entries by default)
   kept ~1 MiB per step alive. vLLM's own per-layer-shape cache (32 entries) already serves
   the repeats, so ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` defaults to 0 in every process pdd
   starts (``pdd.engine.env.PROCESS_DEFAULTS``; an operator's value wins). Same throughput.
2. What vLLM's cache evicts is freed into glibc's heap in pieces glibc does not give back.
   ``HeapTrimmer`` calls ``malloc_trim(0)`` every ``engine.malloc_trim_interval_s`` from a
   daemon thread of the engine core (started by ``pdd.engine.vllm_plugin``, which vLLM loads
   there), which returns the free pages to the kernel.

Together: the prefill engine's private memory stays within a band instead of climbing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

INTERVAL_ENV = "PDD_MALLOC_TRIM_INTERVAL_S"  # set for the engine core by Engine._spawn_env
THREAD_NAME = "pdd-heap-trim"
PR_SET_NAME = 15


def _name_os_thread(name: str) -> None:
    """Name the calling thread for the kernel (``top -H``, /proc/PID/task/TID/comm)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's ``malloc_trim``, or None on a C library without it (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Returns free heap pages to the kernel every ``interval_s`` (a daemon thread)."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def supported(self) -> bool:
        return self._trim is not None

    def trim(self) -> bool:
        """One trim now; True when memory was returned to the kernel."""
        return self._trim is not None and bool(self._trim(0))

    def start(self) -> None:
        if self._trim is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        _name_os_thread(THREAD_NAME)
        while not self._stop.wait(self.interval_s):
            self.trim()


_process_trimmer: HeapTrimmer | None = None


def start_from_env() -> HeapTrimmer | None:
    """Start this process's trimmer when ``PDD_MALLOC_TRIM_INTERVAL_S`` > 0 (idempotent)."""
    global _process_trimmer
    if _process_trimmer is not None:
        return _process_trimmer
    try:
        interval = float(os.environ.get(INTERVAL_ENV, "0"))
    except ValueError:
        log.warning("%s=%r is not a number: heap trimming off", INTERVAL_ENV,
                    os.environ[INTERVAL_ENV])  # fmt: skip
        return None
    if interval <= 0:
        return None
    trimmer = HeapTrimmer(interval)
    if not trimmer.supported:
        log.info("no malloc_trim in this C library: heap trimming off")
        return None
    trimmer.start()
    _process_trimmer = trimmer
    return trimmer
