"""`pdd serve` section: how the launcher supervises the processes it started (pdd.launch)."""

from __future__ import annotations

from pydantic import Field, model_validator

from pdd.config.base import Section


class LaunchConfig(Section):
    restart: bool = Field(
        True,
        description="Start a child (worker or router) again when it dies; false: `pdd serve` "
        "stops everything when one dies, as before.",
    )
    restart_backoff_s: float = Field(
        1.0, gt=0, description="Wait before the first restart of a child; doubles per restart."
    )
    restart_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait between two starts of one child."
    )
    max_failed_starts: int = Field(
        3,
        ge=1,
        description="Starts in a row that end before the child's ready line (at the first "
        "start too) after which `pdd serve` gives up and exits 1 with that child's error.",
    )
    stable_after_s: float = Field(
        60.0,
        gt=0,
        description="A child up this long after its ready line is healthy again: its next "
        "restart waits restart_backoff_s, not the doubled backoff.",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> LaunchConfig:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("launch.restart_backoff_max_s is below launch.restart_backoff_s")
        return self
