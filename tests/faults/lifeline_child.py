"""A process that starts one multiprocessing child with pdd's lifeline (tests/faults/test_lifeline.py).

Usage: ``python -m tests.faults.lifeline_child START_METHOD``; prints the child's pid."""

from __future__ import annotations

import multiprocessing
import sys
import time

from pdd.engine.lifeline import start_lifeline


def child() -> None:
    assert start_lifeline()
    time.sleep(120)


if __name__ == "__main__":
    proc = multiprocessing.get_context(sys.argv[1]).Process(target=child)
    proc.start()
    print(proc.pid, flush=True)
    proc.join()
