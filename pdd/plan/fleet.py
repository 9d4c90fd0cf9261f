"""A fleet to simulate: the router mode, and how many instances of which chip per role.

    Fleet(RouterMode.PDD, (Group(PREFILL, "A", 43), Group(RELAY_DECODE, "A", 4),
                           Group(MAIN_DECODE, "B", 32)))

Placement follows pdd's topologies: P and RLD in dc-a; MD in dc-b for pdd and pd_wan (the WAN
between), in dc-a for pd_local (the baseline's D is a main_decode next to P); colocated in dc-a.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.errors import ConfigError
from pdd.protocol import Role, RouterMode

ROLES: dict[RouterMode, tuple[Role, ...]] = {
    RouterMode.COLOCATED: (Role.COLOCATED,),
    RouterMode.PD_LOCAL: (Role.PREFILL, Role.MAIN_DECODE),
    RouterMode.PD_WAN: (Role.PREFILL, Role.MAIN_DECODE),
    RouterMode.PDD: (Role.PREFILL, Role.RELAY_DECODE, Role.MAIN_DECODE),
}
SHORT = {Role.COLOCATED: "C", Role.PREFILL: "P", Role.RELAY_DECODE: "RLD", Role.MAIN_DECODE: "MD"}


@dataclass(frozen=True, slots=True)
class Group:
    role: Role
    chip: str
    count: int


@dataclass(frozen=True, slots=True)
class Fleet:
    mode: RouterMode
    groups: tuple[Group, ...]

    def __post_init__(self) -> None:
        roles = {g.role for g in self.groups}
        if roles != set(ROLES[self.mode]) or any(g.count < 1 for g in self.groups):
            raise ConfigError(
                f"fleet for {self.mode.value}: needs at least one worker of each of "
                f"{[r.value for r in ROLES[self.mode]]}, got {self.label()}"
            )

    def datacenter(self, role: Role) -> str:
        remote = role is Role.MAIN_DECODE and self.mode in (RouterMode.PDD, RouterMode.PD_WAN)
        return "dc-b" if remote else "dc-a"

    def count(self, role: Role) -> int:
        return sum(g.count for g in self.groups if g.role is role)

    @property
    def counts(self) -> tuple[int, ...]:
        """Instances per group, in order: the fleet's key within one search."""
        return tuple(g.count for g in self.groups)

    def cost_per_hour(self, prices: dict[str, float]) -> float:
        return sum(g.count * prices[g.chip] for g in self.groups)

    def chips(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.chip] = out.get(g.chip, 0) + g.count
        return out

    def label(self) -> str:
        return " + ".join(f"{g.count} {SHORT[g.role]}:{g.chip}" for g in self.groups)

    def with_count(self, role: Role, count: int) -> Fleet:
        groups = tuple(Group(g.role, g.chip, count if g.role is role else g.count)
                       for g in self.groups)  # fmt: skip
        return Fleet(self.mode, groups)
