"""The restart policy of `pdd serve` (pure), and the supervisor over fake children."""

from __future__ import annotations

import pytest

from pdd.config import LaunchConfig
from pdd.launch.supervise import GaveUp, RestartPolicy, RestartState, Supervisor

CFG = LaunchConfig(restart_backoff_s=1, restart_backoff_max_s=8, max_failed_starts=3,
                   stable_after_s=60)  # fmt: skip


def test_backoff_doubles_up_to_its_cap_while_the_child_keeps_dying_after_ready():
    policy, state = RestartPolicy(CFG), RestartState()
    assert [policy.after_death(state, ready_for_s=5) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert state.failed_starts == 0  # it did start every time


def test_a_child_that_was_stable_starts_from_the_first_backoff_again():
    policy, state = RestartPolicy(CFG), RestartState()
    assert [policy.after_death(state, 5) for _ in range(3)] == [1, 2, 4]
    assert policy.after_death(state, ready_for_s=60) == 1
    assert policy.after_death(state, ready_for_s=1) == 2


def test_gives_up_after_max_failed_starts_in_a_row_and_a_ready_start_resets_the_count():
    policy, state = RestartPolicy(CFG), RestartState()
    assert policy.after_death(state, None) == 1
    assert policy.after_death(state, None) == 2
    assert policy.after_death(state, 3.0) == 4  # it started once: the count starts over
    assert policy.after_death(state, None) == 8
    assert policy.after_death(state, None) == 8
    assert policy.after_death(state, None) is None
    assert state.failed_starts == 3


def test_restart_off_never_restarts():
    assert RestartPolicy(LaunchConfig(restart=False)).after_death(RestartState(), 100) is None


def test_backoff_cap_below_the_first_backoff_is_a_config_error():
    with pytest.raises(ValueError, match="restart_backoff_max_s"):
        LaunchConfig(restart_backoff_s=10, restart_backoff_max_s=1)


class FakeChild:
    """What the supervisor reads of a child, and its restarts."""

    def __init__(self, name: str) -> None:
        self.name, self.proc, self.ready_at, self.running, self.starts = (
            name,
            object(),
            0.0,
            True,
            1,
        )

    def alive(self) -> bool:
        return self.running

    def restart(self, env) -> None:
        self.running, self.ready_at, self.starts = True, None, self.starts + 1

    def describe_failure(self, what: str) -> str:
        return f"{self.name} {what}"


def test_supervisor_restarts_only_the_dead_child_when_its_backoff_is_due():
    now = [100.0]
    a, b = FakeChild("a"), FakeChild("b")
    sup = Supervisor([a, b], CFG, {}, clock=lambda: now[0])
    b.running = False  # died 100 s after its ready line
    sup.tick()
    assert sup.pending(b) and not sup.pending(a) and b.starts == 1
    now[0] += 0.5
    sup.tick()
    assert b.starts == 1  # the 1 s backoff is not over
    now[0] += 0.6
    sup.tick()
    assert (a.starts, b.starts, sup.restarts()) == (1, 2, {"a": 0, "b": 1})
    assert not sup.pending(b)


def test_supervisor_gives_up_with_the_childs_failure():
    now = [0.0]
    child = FakeChild("md")
    sup = Supervisor([child], CFG, {}, clock=lambda: now[0])
    for _ in range(2):
        child.running, child.ready_at = False, None
        sup.tick()  # schedules
        now[0] += 10
        sup.tick()  # restarts
    child.running = False
    with pytest.raises(GaveUp, match="md exited before it was ready") as exc:
        sup.tick()
    assert "gave up on md after 3 failed starts in a row" in exc.value.message
