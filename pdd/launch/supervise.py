"""Keeping the children of `pdd serve` running: the restart policy and the loop applying it.

``RestartPolicy`` is pure: given what one child did (died before or after its ready line, how
long it had been ready), it says how long to wait before starting it again, or to give up.
``Supervisor`` applies it to every child of a topology from the launcher's main thread (a
child must be forked there: see ``pdd.launch.children``)::

    child dies -> policy: wait backoff (1 s, 2 s, 4 s ... up to restart_backoff_max_s)
               -> start it again (same command line: same ports, same config)
               -> the router's health polls readmit a worker; a restarted router
                  re-reads its config and polls every worker
    max_failed_starts deaths in a row before the ready line -> give up: `pdd serve` exits
               with that child's error
    ready for stable_after_s -> the next death waits restart_backoff_s again

The other children keep running through all of it: one dead worker is not an outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdd.config.launch import LaunchConfig
from pdd.launch.children import Child

log = logging.getLogger("pdd.launch")


@dataclass
class RestartState:
    """What the policy remembers of one child."""

    restarts: int = 0  # starts after the first one
    failed_starts: int = 0  # deaths before the ready line, in a row
    backoff_s: float = 0.0  # the wait before the last restart (0: none yet)


class RestartPolicy:
    """When to start a dead child again (pure: no clock, no processes)."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg

    def after_death(self, state: RestartState, ready_for_s: float | None) -> float | None:
        """Seconds to wait before the next start, or None to give up; updates ``state``.
        ``ready_for_s``: how long the child had been ready when it died (None: never)."""
        if not self.cfg.restart:
            return None
        if ready_for_s is None:
            state.failed_starts += 1
            if state.failed_starts >= self.cfg.max_failed_starts:
                return None
        else:
            state.failed_starts = 0
            if ready_for_s >= self.cfg.stable_after_s:
                state.backoff_s = 0.0
        wait = self.cfg.restart_backoff_s if state.backoff_s == 0 else state.backoff_s * 2
        state.backoff_s = min(wait, self.cfg.restart_backoff_max_s)
        return state.backoff_s


class GaveUp(Exception):
    """The policy gave up on a child: ``message`` says which and why, with its last output."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Supervisor:
    """Restarts the dead children of one topology; call ``tick`` from the main thread."""

    def __init__(
        self,
        children: list[Child],
        cfg: LaunchConfig,
        env: dict[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = RestartPolicy(cfg)
        self.env = env
        self.clock = clock
        self.states = {c.name: RestartState() for c in children}
        self._children = children
        self._due: dict[str, float] = {}  # child name -> when to start it again

    def restarts(self) -> dict[str, int]:
        return {name: st.restarts for name, st in self.states.items()}

    def pending(self, child: Child) -> bool:
        """Dead, and waiting for its restart."""
        return child.name in self._due

    def tick(self) -> None:
        """Schedule a restart for each newly dead child, start those that are due. Raises
        GaveUp when the policy gives up on one."""
        now = self.clock()
        for child in self._children:
            if child.proc is None or child.alive():
                continue
            if child.name not in self._due:
                self._schedule(child, now)
            elif now >= self._due[child.name]:
                del self._due[child.name]
                self.states[child.name].restarts += 1
                child.restart(self.env)

    def _schedule(self, child: Child, now: float) -> None:
        ready_for = None if child.ready_at is None else now - child.ready_at
        state = self.states[child.name]
        wait = self.policy.after_death(state, ready_for)
        what = "died" if ready_for is not None else "exited before it was ready"
        if wait is None:
            message = child.describe_failure(what)
            if self.policy.cfg.restart:
                message += (
                    f"\npdd serve: gave up on {child.name} after {state.failed_starts} failed "
                    "starts in a row (launch.max_failed_starts)"
                )
            raise GaveUp(message)
        log.warning(
            "pdd serve: starting %s again in %.1f s (restart %d): %s",
            child.name, wait, state.restarts + 1, child.describe_failure(what),
        )  # fmt: skip
        self._due[child.name] = now + wait
