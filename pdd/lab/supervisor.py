"""The lab supervisor: builds the lab, runs the relay, and removes the lab when the relay ends.

Lifecycle (one daemon per running lab)::

    Lab.up() ─spawn─> supervisor ─fork─> daemon (the first process exits at once)
      daemon: build namespaces and links, open the WAN TUNs, start the relay with their fds,
              wait for the relay's ready byte, write status.json, answer "ok" on --ready-fd
      then waits on the relay. Whatever ends it (SIGTERM forwarded by `pdd lab down`, a crash,
      kill -9), the daemon removes everything and exits.

If the daemon itself is killed, the kernel signals the relay (PR_SET_PDEATHSIG), which then
removes the lab itself: either process surviving the other is enough to clean up.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from pdd.config.lab import LabConfig
from pdd.errors import LabError
from pdd.lab import netns, state, topology
from pdd.lab.plan import LabPlan

log = logging.getLogger("pdd.lab.supervisor")

RELAY_START_TIMEOUT_S = 30.0


class _Supervisor:
    """Owns the relay process and the teardown; one instance per daemon."""

    def __init__(self, plan: LabPlan, config_path: Path):
        self.plan = plan
        self.config_path = config_path
        self.relay: subprocess.Popen | None = None
        self.stop_requested = False

    def on_signal(self, signum: int, frame: object) -> None:
        """SIGTERM/SIGINT/SIGHUP: stop the relay; the main flow then tears down."""
        log.info("got %s", signal.Signals(signum).name)
        self.stop_requested = True
        if self.relay is not None and self.relay.returncode is None:
            # Not reaped yet, so its pid cannot have been reused.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.relay.pid, signal.SIGTERM)

    def start(self) -> None:
        """Build the lab and start the relay. Raises LabError/OSError (caller tears down)."""
        topology.build(self.plan)
        fds = topology.open_wan(self.plan)
        ready_r, ready_w = os.pipe()
        try:
            self.relay = subprocess.Popen(
                [sys.executable, "-m", state.RELAY_MODULE, "--config", str(self.config_path)]
                + ["--fd-a", str(fds["dc-a"]), "--fd-b", str(fds["dc-b"])]
                + ["--supervisor", str(os.getpid()), "--ready-fd", str(ready_w)],
                pass_fds=(*fds.values(), ready_w),
                stdin=subprocess.DEVNULL,
            )
        finally:
            # The relay holds the TUNs now: they must vanish with it, not linger with us.
            for fd in (*fds.values(), ready_w):
                os.close(fd)
        try:
            reply = netns.await_reply(ready_r, RELAY_START_TIMEOUT_S, "relay")
        finally:
            os.close(ready_r)
        if reply != "ok":
            raise LabError(f"relay: {reply}")
        state.write_pid(self.plan, "relay", self.relay.pid)
        status = state.status_from_plan(
            self.plan, "up", supervisor_pid=os.getpid(), relay_pid=self.relay.pid
        )
        state.write_status(self.plan, status)

    def wait_and_clean(self) -> int:
        """Block until the relay exits, then remove the lab. Returns the daemon's exit code."""
        assert self.relay is not None
        if self.stop_requested:
            self.relay.terminate()
        code = self.relay.wait()
        if self.stop_requested:
            log.info("relay stopped (exit %s): removing the lab", code)
        else:
            log.error("relay exited unexpectedly (exit %s): removing the lab", code)
        self.clean()
        return 0 if self.stop_requested else 1

    def clean(self) -> None:
        topology.teardown(self.plan)
        state.clear(self.plan)
        log.info("lab %s removed", self.plan.cfg.prefix)


def _report(fd: int, message: str) -> None:
    os.write(fd, (message.replace("\n", " ") + "\n").encode())
    os.close(fd)


def _daemon(plan: LabPlan, config_path: Path, ready_fd: int) -> int:
    sup = _Supervisor(plan, config_path)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, sup.on_signal)
    state.write_pid(plan, "supervisor", os.getpid())
    try:
        sup.start()
    except (LabError, OSError) as exc:
        log.error("lab %s did not come up: %s", plan.cfg.prefix, exc)
        if sup.relay is not None and sup.relay.poll() is None:
            sup.relay.kill()
            sup.relay.wait()
        sup.clean()
        _report(ready_fd, f"error: {exc}")
        return 1
    log.info("lab %s up", plan.cfg.prefix)
    _report(ready_fd, "ok")
    return sup.wait_and_clean()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdd.lab.supervisor", description=__doc__)
    p.add_argument("--config", required=True, type=Path, help="LabConfig as JSON")
    p.add_argument("--ready-fd", required=True, type=int, help="pipe for 'ok' or 'error: ...'")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s[%(process)d] %(message)s")
    plan = LabPlan.from_config(LabConfig.model_validate_json(args.config.read_text()))
    if os.fork() > 0:
        os._exit(0)  # the daemon below is re-parented; Lab.up() reaps this first process
    return _daemon(plan, args.config, args.ready_fd)


if __name__ == "__main__":
    sys.exit(main())
