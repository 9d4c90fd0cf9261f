"""What a running lab records on disk, and the typed status read back from it.

Files under ``run_dir/PREFIX/`` (written by the supervisor, removed by whoever tears down):
``config.json`` (the LabConfig it was built from), ``status.json`` (LabStatus, written once
the lab is up), ``supervisor.pid`` and ``relay.pid``. The log ``run_dir/PREFIX.log`` stays
after the lab is gone, so a crash can be read about.
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdd.config.lab import LabConfig
from pdd.errors import LabError
from pdd.lab.chaos import chaos_summary
from pdd.lab.plan import LabPlan

# Module names: how the processes are started, and the marks that tell them apart in /proc.
SUPERVISOR_MODULE = "pdd.lab.supervisor"
RELAY_MODULE = "pdd.lab.relay"


class DcStatus(BaseModel):
    """One datacenter of a lab, as a user reaches it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Logical name: dc-a | dc-b.")
    netns: str = Field(description="Kernel network namespace (`ip netns exec NETNS ...`).")
    wan_ip: str = Field(description="Address on the shaped WAN link (from the other DC).")
    mgmt_ip: str = Field(description="Address on the unshaped management link (from the host).")
    host_ip: str = Field(description="The host's end of the management link (from this DC).")


class LabStatus(BaseModel):
    """A lab as `status` sees it: its addresses, its link parameters and its health."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str
    state: Literal["up", "down", "broken"] = Field(
        description="up: everything runs; down: nothing exists; broken: part of it exists "
        "(`down` removes it)."
    )
    datacenters: list[DcStatus] = Field(default_factory=list)
    delay_ms: float
    rate_mbit: float
    loss: float
    mtu: int
    queue_bytes: int
    chaos: str = Field("", description="The chaos options in force (pdd.lab.chaos), or empty.")
    supervisor_pid: int | None = None
    relay_pid: int | None = None
    problems: list[str] = Field(default_factory=list, description="Why the lab is broken.")

    def dc(self, name: str) -> DcStatus:
        for d in self.datacenters:
            if d.name == name or d.netns == name:
                return d
        raise LabError(f"no datacenter {name!r} in lab {self.prefix!r} (state {self.state})")


def status_from_plan(plan: LabPlan, state: str, **pids: int | None) -> LabStatus:
    cfg = plan.cfg
    return LabStatus(
        prefix=cfg.prefix,
        state=state,  # type: ignore[arg-type]
        datacenters=[
            DcStatus(
                name=dc.name,
                netns=dc.netns,
                wan_ip=str(dc.wan_ip),
                mgmt_ip=str(dc.mgmt_ip),
                host_ip=str(dc.host_ip),
            )
            for dc in plan.dcs
        ],
        delay_ms=cfg.delay_ms,
        rate_mbit=cfg.rate_mbit,
        loss=cfg.loss,
        mtu=cfg.mtu,
        queue_bytes=plan.queue_bytes,
        chaos=chaos_summary(cfg),
        **pids,
    )


def write_config(plan: LabPlan) -> None:
    plan.state_dir.mkdir(parents=True, exist_ok=True)
    (plan.state_dir / "config.json").write_text(plan.cfg.model_dump_json())


def read_config(plan: LabPlan) -> LabConfig | None:
    """The config a running lab of this prefix was built from (None if there is none)."""
    try:
        return LabConfig.model_validate_json((plan.state_dir / "config.json").read_text())
    except FileNotFoundError:
        return None


def write_pid(plan: LabPlan, who: str, pid: int) -> None:
    (plan.state_dir / f"{who}.pid").write_text(f"{pid}\n")


def read_pid(plan: LabPlan, who: str) -> int | None:
    try:
        return int((plan.state_dir / f"{who}.pid").read_text())
    except (FileNotFoundError, ValueError):
        return None


def write_status(plan: LabPlan, status: LabStatus) -> None:
    tmp = plan.state_dir / "status.json.tmp"
    tmp.write_text(status.model_dump_json(indent=2))
    tmp.replace(plan.state_dir / "status.json")


def read_status(plan: LabPlan) -> LabStatus | None:
    try:
        return LabStatus.model_validate_json((plan.state_dir / "status.json").read_text())
    except FileNotFoundError:
        return None


def clear(plan: LabPlan) -> None:
    """Remove the lab's state folder (not its log)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(plan.state_dir)
