"""A ``threading.Event`` that SIGTERM/SIGINT set, safely.

Setting an Event from a signal handler can deadlock: Python runs the handler on the main
thread between two bytecodes, possibly inside that thread's own ``Event.wait()`` while it
holds the Event's (non-reentrant) lock; ``set()`` then blocks on that lock forever. A
supervisor that waits on its stop event in the main thread (``pdd serve``) hit this about
once in 25 SIGTERMs and never stopped.

Here the handler does nothing in Python: the interpreter's C-level handler writes the signal
number to a wakeup pipe (``signal.set_wakeup_fd``), and a daemon thread that reads the pipe
sets the Event. Main thread only (``set_wakeup_fd`` requires it); once per process.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_event(signals: Iterable[signal.Signals] = STOP_SIGNALS) -> threading.Event:
    """An Event set once any of ``signals`` arrives (from a watcher thread)."""
    wanted = {int(s) for s in signals}
    stop = threading.Event()
    read_fd, write_fd = os.pipe()  # not inherited by children (PEP 446)
    os.set_blocking(write_fd, False)  # a full pipe drops a byte, never blocks the handler
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in wanted:
        signal.signal(sig, _noted)
    threading.Thread(
        target=_watch, args=(read_fd, wanted, stop), name="stop-signals", daemon=True
    ).start()
    return stop


def _noted(signum: int, frame: object) -> None:
    """The Python half of the handler: nothing (the wakeup byte already went out)."""


def _watch(read_fd: int, wanted: set[int], stop: threading.Event) -> None:
    while data := os.read(read_fd, 64):
        if wanted.intersection(data):
            stop.set()
