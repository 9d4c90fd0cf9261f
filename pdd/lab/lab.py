"""The lab's Python API: bring a two-datacenter lab up and down, look at it, run things in it.

A ``Lab`` is a handle named by its config's ``prefix``; it holds no process. ``up()`` starts
the supervisor daemon (pdd.lab.supervisor), which owns the running lab until ``down()``
(from any process) or the relay's death removes it. So ``pdd lab up`` can return while the
lab keeps running, and ``pdd lab down`` from another shell stops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdd.config.lab import LabConfig
from pdd.errors import LabError
from pdd.lab import netns, state, topology
from pdd.lab.measure import LinkMeasurement, measure_rtt, measure_throughput
from pdd.lab.plan import LabPlan
from pdd.lab.state import LabStatus

log = logging.getLogger(__name__)

UP_TIMEOUT_S = 60.0
DOWN_TIMEOUT_S = 20.0


class Lab:
    """Handle on the lab named ``cfg.prefix`` (which may or may not be running)."""

    def __init__(self, cfg: LabConfig | None = None):
        self.cfg = cfg or LabConfig()
        self.plan = LabPlan.from_config(self.cfg)

    # --- lifecycle ----------------------------------------------------------------------

    def up(self) -> LabStatus:
        """Build the lab from ``cfg`` and return its status once the link carries packets.

        Leftovers of a dead lab with the same prefix are removed first. Raises LabError if
        a lab with this prefix is running, the subnet is taken, or the build fails (in which
        case nothing of it is left).
        """
        netns.check_host()
        current = self.status()
        if current.state == "up":
            raise LabError(f"lab {self.cfg.prefix!r} is already up (`pdd lab down` first)")
        if current.state == "broken":
            log.warning("removing leftovers of lab %s: %s", self.cfg.prefix, current.problems)
            self.down()
        topology.check_free(self.plan)
        state.write_config(self.plan)
        reply = self._spawn_supervisor()
        if reply != "ok":
            self.down()
            raise LabError(f"lab {self.cfg.prefix!r} did not come up: {reply}\n{self.log_tail()}")
        return self.status()

    def _spawn_supervisor(self) -> str:
        """Start the supervisor daemon; return its first line: "ok" or "error: ..."."""
        ready_r, ready_w = os.pipe()
        # The daemon must import this very pdd, wherever the caller found it.
        pkg_root = str(Path(__file__).resolve().parents[2])
        paths = [pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        with open(self.plan.log_path, "w") as log_file:
            first = subprocess.Popen(
                [sys.executable, "-m", state.SUPERVISOR_MODULE]
                + ["--config", str(self.plan.state_dir / "config.json")]
                + ["--ready-fd", str(ready_w)],
                pass_fds=(ready_w,),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
            )
        os.close(ready_w)
        try:
            first.wait(timeout=UP_TIMEOUT_S)  # exits as soon as the daemon is forked
            return netns.await_reply(ready_r, UP_TIMEOUT_S, "lab supervisor")
        except (LabError, subprocess.TimeoutExpired) as exc:
            return f"error: {exc}"
        finally:
            os.close(ready_r)

    def down(self) -> None:
        """Stop the lab's processes and remove everything it made. Idempotent.

        Also stops processes still running inside the lab namespaces (SIGTERM, then SIGKILL).
        Raises LabError if something could not be removed.
        """
        for who, module in (("supervisor", state.SUPERVISOR_MODULE), ("relay", state.RELAY_MODULE)):
            pid = state.read_pid(self.plan, who)
            if pid is not None and netns.pid_alive(pid, module):
                netns.stop_pids([pid], DOWN_TIMEOUT_S, marker=module)
        topology.teardown(self.plan)
        state.clear(self.plan)
        left = topology.leftovers(self.plan)
        if left:
            raise LabError(f"lab {self.cfg.prefix!r}: could not remove {left}")

    def status(self) -> LabStatus:
        """What runs now. A running lab reports the parameters it was built with."""
        recorded = state.read_status(self.plan)
        supervisor = state.read_pid(self.plan, "supervisor")
        sup_alive = supervisor is not None and netns.pid_alive(supervisor, state.SUPERVISOR_MODULE)
        if recorded is None:
            problems = [f"{name} exists" for name in topology.leftovers(self.plan)]
            if sup_alive:
                problems.append(f"supervisor {supervisor} runs (the lab is starting or stuck)")
            return state.status_from_plan(
                self.plan, "broken" if problems else "down", supervisor_pid=supervisor
            ).model_copy(update={"problems": problems})
        problems = []
        if not sup_alive:
            problems.append(f"supervisor {recorded.supervisor_pid} is not running")
        if recorded.relay_pid is None or not netns.pid_alive(
            recorded.relay_pid, state.RELAY_MODULE
        ):
            problems.append(f"relay {recorded.relay_pid} is not running")
        for dc in recorded.datacenters:
            if not netns.netns_exists(dc.netns):
                problems.append(f"namespace {dc.netns} is missing")
        if problems:
            return recorded.model_copy(update={"state": "broken", "problems": problems})
        return recorded

    def set_rate(self, rate_mbit: float) -> LabStatus:
        """Change the WAN rate of this running lab, both directions at once (a running flow
        follows within one queue's worth of packets). At most the rate the lab was built
        with, whose in-flight bytes the relay's delay lines are sized for; not on a lab whose
        chaos schedule changes the rate. Raises LabError otherwise."""
        built = state.read_config(self.plan)
        current = self.status()
        if built is None or current.state != "up":
            raise LabError(f"lab {self.cfg.prefix!r} is not up ({current.state})")
        if not 0 < rate_mbit <= built.rate_mbit:
            raise LabError(
                f"rate_mbit {rate_mbit} must be in (0, {built.rate_mbit}]: the rate lab "
                f"{self.cfg.prefix!r} was built with (`pdd lab up --rate-mbit` for more)"
            )
        if built.rate_factors:
            raise LabError(f"lab {self.cfg.prefix!r} changes its rate by a chaos schedule")
        plan = LabPlan.from_config(built.model_copy(update={"rate_mbit": rate_mbit}))
        for dc in plan.dcs:
            topology.shape_wan(plan, dc)
        state.write_status(self.plan, current.model_copy(update={"rate_mbit": rate_mbit}))
        log.info("lab %s: WAN rate now %s Mbit/s", self.cfg.prefix, rate_mbit)
        return self.status()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.plan.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    # --- running things inside ----------------------------------------------------------

    def netns_of(self, dc: str) -> str:
        """Kernel namespace of a datacenter (``dc-a`` -> ``PREFIX-dc-a``); LabError if absent."""
        try:
            name = self.plan.dc(dc).netns
        except KeyError:
            raise LabError(f"unknown datacenter {dc!r} (have dc-a, dc-b)") from None
        if not netns.netns_exists(name):
            raise LabError(f"lab {self.cfg.prefix!r} is not up ({name} does not exist)")
        return name

    def spawn_in(self, dc: str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside datacenter ``dc`` (``ip netns exec``); the caller owns it.

        The Popen's pid is the command itself (``ip netns exec`` execs it).
        """
        return subprocess.Popen(["ip", "netns", "exec", self.netns_of(dc), *argv], **popen_kwargs)

    def exec(self, dc: str, argv: Sequence[str], **run_kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside datacenter ``dc`` to completion (``subprocess.run`` semantics)."""
        cmd = ["ip", "netns", "exec", self.netns_of(dc), *argv]
        return subprocess.run(cmd, check=False, **run_kwargs)

    @contextlib.contextmanager
    def enter(self, dc: str) -> Iterator[None]:
        """Run the block's calling thread inside datacenter ``dc``: sockets opened there stay
        there. Thread-local (see pdd.lab.netns.enter); never on an asyncio loop thread."""
        with netns.enter(self.netns_of(dc)):
            yield

    def measure_link(self, seconds: float = 1.0) -> LinkMeasurement:
        """RTT (median UDP echo) and throughput (one bulk TCP flow of ``seconds`` of link
        time, cut off at 2 + 3 x ``seconds``), dc-a to dc-b over the WAN.

        Raises LabError if the lab is not up or no probe came back."""
        st = self.status()
        if st.state != "up":
            raise LabError(f"lab {self.cfg.prefix!r} is {st.state}: {st.problems}")
        a, b = st.dc("dc-a"), st.dc("dc-b")
        # A probe is lost once it is late by far more than any queue adds.
        rtt = measure_rtt(a.netns, b.netns, b.wan_ip, timeout_s=0.2 + 4 * st.delay_ms / 1000)
        nbytes = max(1 << 20, int(st.rate_mbit * 1e6 / 8 * seconds))
        rate = measure_throughput(a.netns, b.netns, b.wan_ip, nbytes, max_s=2 + 3 * seconds)
        return LinkMeasurement(rtt_ms=rtt, throughput_mbit=rate)
