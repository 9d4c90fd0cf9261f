"""The engine core dies with its worker: a lifeline from vLLM's engine-core child to its parent.

vLLM starts the engine core with ``multiprocessing`` (spawn on CPU) and stops it only when the
parent asks. A worker killed with SIGKILL (OOM killer, a crash, ``kill -9``) never asks, and
its ``VLLM::EngineCore`` would live on under PID 1 holding its memory and KV arena.

How the child learns its parent died: every ``multiprocessing`` child (spawn, forkserver and
fork alike) holds ``multiprocessing.parent_process().sentinel``, the read end of a pipe whose
write end only the parent holds; the kernel closes it when the parent dies, however it dies,
and the sentinel becomes readable. A daemon thread in the child blocks on it (no polling) and
SIGKILLs the child at once. ``PR_SET_PDEATHSIG`` was not used: it fires when the parent
*thread* that spawned the child exits, and pdd spawns the core from a worker thread.

How that thread gets into the child without touching vLLM: while pdd's ``Engine`` constructs
its AsyncLLM (``spawning()``, one engine at a time per process), vLLM's process target
``EngineCoreProc.run_engine_core`` is swapped for ``run_engine_core`` below, a module-level
function that spawn/forkserver pickle by name and fork calls directly. In the child it starts
the lifeline, then runs vLLM's own target unchanged. The swap is undone as soon as the child
was started, so nothing else ever sees it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

log = logging.getLogger(__name__)

# vLLM's target while spawning (a forked child inherits it; a spawned one imports vLLM fresh)
_vllm_target: Callable[..., Any] | None = None


def start_lifeline() -> bool:
    """In a multiprocessing child: die (SIGKILL) as soon as the parent is gone.

    Returns False in a process that has no multiprocessing parent (nothing to watch)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    watcher = threading.Thread(
        target=_die_with, args=(parent.sentinel, parent.pid), name="pdd-lifeline", daemon=True
    )
    watcher.start()
    return True


def _die_with(sentinel: int, parent_pid: int | None) -> None:
    wait([sentinel])  # readable (EOF) once the parent's end of the pipe is closed: it died
    log.error("parent process %s is gone: the engine core exits with it", parent_pid)
    os.kill(os.getpid(), signal.SIGKILL)


def run_engine_core(*args: Any, **kwargs: Any) -> None:
    """The engine-core process target: the lifeline, then vLLM's own target."""
    start_lifeline()
    target = _vllm_target
    if target is None:
        from vllm.v1.engine.core import EngineCoreProc

        target = EngineCoreProc.run_engine_core
    target(*args, **kwargs)


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """While vLLM starts an engine core, make ``run_engine_core`` its process target."""
    global _vllm_target
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.__dict__["run_engine_core"]  # the staticmethod object
    _vllm_target = EngineCoreProc.run_engine_core
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)
    try:
        yield
    finally:
        EngineCoreProc.run_engine_core = original
        _vllm_target = None
