"""``pdd plan``: size a fleet for a workload and an SLA by simulating pdd's routing.

    pdd plan --profiles configs/profiles/chip-a.yaml configs/profiles/chip-b.yaml \\
             --wan 25Gbps,40ms,0.02 --sla ttft=5,tpot=0.05 \\
             --workload agentic:requests=2000,rate=4,hit_rate=0.9 --out plan/

``--workload`` is ``agentic[:key=value,...]`` (pdd.plan.workload.AgenticWorkload fields), a
YAML file of those fields, or a JSONL trace (``.jsonl``). ``--fleet`` simulates one fleet
instead of searching (``pdd:P=A*43,RLD=A*4,MD=B*32``). Exit codes: 0 a plan (or the fleet)
meets the SLA, 1 none does (the answer says which resource binds), 2 bad input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from pdd.config.router import PddPolicyConfig
from pdd.errors import ConfigError
from pdd.plan import bathtub, report
from pdd.plan.fleet import ROLES, SHORT, Fleet, Group
from pdd.plan.profile import ChipProfile, load_profiles
from pdd.plan.search import Searcher, SearchResult
from pdd.plan.sim import SimSettings, Wan
from pdd.plan.stats import Sla
from pdd.plan.workload import AgenticWorkload, Workload, agentic, load_trace
from pdd.protocol import Role, RouterMode

ROLE_OF = {v: k for k, v in SHORT.items()}
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)(bps|bit/s|b)?\s*", text)
    if not m:
        raise ConfigError(f"--wan: bandwidth {text!r} is not like 25Gbps or 1e10")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ConfigError("--wan: bandwidth must be positive")
    return value


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ms|s)?\s*", text)
    if not m:
        raise ConfigError(f"--wan: RTT {text!r} is not like 40ms or 0.04")
    value = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    if value < 0:
        raise ConfigError("--wan: RTT must not be negative")
    return value


def parse_wan(text: str) -> Wan:
    """``BANDWIDTH,RTT[,PRICE_PER_GB]``, e.g. ``25Gbps,40ms,0.02``."""
    parts = [p for p in text.split(",")]
    if len(parts) not in (2, 3):
        raise ConfigError(f"--wan: expected BANDWIDTH,RTT[,PRICE_PER_GB], got {text!r}")
    price = 0.0
    if len(parts) == 3:
        try:
            price = float(parts[2])
        except ValueError:
            raise ConfigError(f"--wan: price per GB {parts[2]!r} is not a number") from None
    return Wan(parse_bandwidth(parts[0]), parse_seconds(parts[1]), price)


def _kv(text: str, what: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"{what}: {part!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def parse_workload(text: str) -> Workload:
    if text == "agentic" or text.startswith("agentic:"):
        fields = _kv(text.partition(":")[2], "--workload")
        return agentic(_agentic(fields, "--workload"))
    path = Path(text)
    if path.suffix == ".jsonl":
        return load_trace(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--workload {path}: cannot read it ({exc.strerror})") from None
    return agentic(_agentic(data or {}, f"--workload {path}"))


def _agentic(fields: dict, where: str) -> AgenticWorkload:
    try:
        return AgenticWorkload.model_validate(fields)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{where}: {bad}") from None


def parse_fleet(text: str, profiles: dict[str, ChipProfile]) -> Fleet:
    """``MODE:ROLE=CHIP*N,...`` with ROLE one of C, P, RLD, MD."""
    mode_s, _, rest = text.partition(":")
    mode = _mode(mode_s)
    groups = []
    for role_s, spec in _kv(rest, "--fleet").items():
        chip, _, count = spec.partition("*")
        if role_s not in ROLE_OF:
            raise ConfigError(f"--fleet: role {role_s!r} is not one of {sorted(ROLE_OF)}")
        _chip(chip, profiles, "--fleet")
        try:
            groups.append(Group(ROLE_OF[role_s], chip, int(count or 1)))
        except ValueError:
            raise ConfigError(f"--fleet: count {count!r} of {role_s} is not an integer") from None
    return Fleet(mode, tuple(groups))


def _mode(text: str) -> RouterMode:
    try:
        return RouterMode(text.strip())
    except ValueError:
        raise ConfigError(f"mode {text!r} is not one of {[m.value for m in RouterMode]}") from None


def _chip(name: str, profiles: dict[str, ChipProfile], what: str) -> str:
    if name not in profiles:
        raise ConfigError(f"{what}: chip {name!r} has no profile (have {sorted(profiles)})")
    return name


def candidates(modes: list[RouterMode], chips_arg: str | None,
               profiles: dict[str, ChipProfile]) -> list[tuple[RouterMode, dict[Role, str]]]:  # fmt: skip
    """Every (mode, chip per role) to search: ``--chips P=A,RLD=A,MD=A|B`` limits the kinds."""
    allowed = {r: sorted(profiles) for r in Role}
    for role_s, kinds in _kv(chips_arg or "", "--chips").items():
        if role_s not in ROLE_OF:
            raise ConfigError(f"--chips: role {role_s!r} is not one of {sorted(ROLE_OF)}")
        allowed[ROLE_OF[role_s]] = [_chip(k, profiles, "--chips") for k in kinds.split("|")]
    out = []
    for mode in modes:
        roles = ROLES[mode]
        for combo in itertools.product(*(allowed[r] for r in roles)):
            out.append((mode, dict(zip(roles, combo, strict=True))))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdd plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+", type=Path, required=True, help="chip profiles")
    ap.add_argument("--wan", required=True, help="BANDWIDTH,RTT[,PRICE_PER_GB]")
    ap.add_argument("--sla", required=True, help="ttft=S,tpot=S[,attainment=0.9]")
    ap.add_argument(
        "--workload", default="agentic", help="agentic[:k=v,...] | FILE.yaml | TRACE.jsonl"
    )
    ap.add_argument("--prices", default="", help="CHIP=PRICE_PER_HOUR,... (overrides profiles)")
    ap.add_argument("--modes", default="pdd,pd_local,pd_wan,colocated")
    ap.add_argument("--chips", default=None, help="chip kinds per role, e.g. P=A,RLD=A,MD=A|B")
    ap.add_argument(
        "--fleet", default=None, help="simulate this fleet only: pdd:P=A*4,RLD=A*1,MD=B*4"
    )
    ap.add_argument("--policy", default="", help="router.pdd fields, e.g. ttft_budget_s=0.5")
    ap.add_argument("--baseline-routing", choices=("affinity", "least_loaded"), default="affinity")
    ap.add_argument("--exact-cache", action="store_true", help="RadixIndex per block (slow)")
    ap.add_argument("--max-instances", type=int, default=512)
    ap.add_argument(
        "--max-sims",
        type=int,
        default=150,
        help="simulations per searched mode and chip set (growth, shrink, trades)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write plan.json, plan.md, plan.png")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--bathtub", default=None,
                    help="hit rates, e.g. 0,0.2,0.5,0.9: search again at each (agentic only); "
                    "writes bathtub.json/.md/.png under --out")  # fmt: skip
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    profiles = load_profiles(args.profiles)
    prices = {k: _price(k, v, profiles) for k, v in _kv(args.prices, "--prices").items()}
    wan, sla = parse_wan(args.wan), Sla.parse(args.sla)
    workload = parse_workload(args.workload)
    try:
        policy = PddPolicyConfig.model_validate(_kv(args.policy, "--policy"))
    except ValidationError as exc:
        raise ConfigError(f"--policy: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
    settings = SimSettings(policy=policy, exact_cache=args.exact_cache,
                           baseline_affinity=args.baseline_routing == "affinity")  # fmt: skip
    searcher = Searcher(profiles, wan, workload, sla, settings, args.max_instances,
                        args.max_sims, prices)  # fmt: skip
    inputs = {"profiles": [str(p) for p in args.profiles], "wan": vars(args)["wan"],
              "sla": args.sla, "workload": args.workload, "requests": workload.requests,
              "prices": {k: prices.get(k, p.price_per_hour) for k, p in profiles.items()},
              "policy": policy.model_dump(), "baseline_routing": args.baseline_routing}  # fmt: skip
    if args.fleet:
        res = searcher.simulate(parse_fleet(args.fleet, profiles))
        print(json.dumps(res.to_dict(), indent=2, default=str))
        return 0 if res.meets_sla else 1
    modes = [_mode(m) for m in args.modes.split(",") if m]
    if args.bathtub:
        return _bathtub(args, searcher, profiles, modes, inputs)
    results: list[SearchResult] = []
    for mode, chips in candidates(modes, args.chips, profiles):
        results.append(searcher.search(mode, chips))
        print(f"searched {results[-1].label}: {len(results[-1].tried)} simulations",
              file=sys.stderr)  # fmt: skip
    if args.out:
        for path in report.write(args.out, results, inputs):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(results, inputs), indent=2, default=str))
    else:
        print(report.table(results))
        best = report.best_overall(results)
        print(
            "\nbest: "
            + (
                f"{best.label}: {best.best.fleet}, BCR {best.best.bcr:.4g}"  # type: ignore[union-attr]
                if best
                else "no fleet meets the SLA (see the reasons above)"
            )
        )
    return 0 if report.best_overall(results) else 1


def _bathtub(args: argparse.Namespace, searcher: Searcher, profiles: dict[str, ChipProfile],
             modes: list[RouterMode], inputs: dict) -> int:  # fmt: skip
    if args.out is None:
        raise ConfigError("--bathtub needs --out DIR")
    if args.workload.endswith(".jsonl"):
        raise ConfigError("--bathtub needs a synthetic workload (agentic:... or a YAML of it)")
    try:
        hits = [float(h) for h in args.bathtub.split(",") if h]
    except ValueError:
        raise ConfigError(f"--bathtub: {args.bathtub!r} is not a list of numbers") from None
    if not hits or any(not 0 <= h < 1 for h in hits):
        raise ConfigError("--bathtub: hit rates must be in [0, 1)")
    base = (_agentic(_kv(args.workload.partition(":")[2], "--workload"), "--workload")
            if args.workload.startswith("agentic")
            else _agentic(yaml.safe_load(Path(args.workload).read_text()) or {}, "--workload"))  # fmt: skip
    points = bathtub.sweep(searcher, base, hits, candidates(modes, args.chips, profiles))
    for path in bathtub.write(args.out, points, inputs):
        print(f"wrote {path}", file=sys.stderr)
    print((args.out / "bathtub.md").read_text())
    return 0


def _price(chip: str, value: str, profiles: dict[str, ChipProfile]) -> float:
    _chip(chip, profiles, "--prices")
    try:
        price = float(value)
    except ValueError:
        raise ConfigError(f"--prices: {chip}={value!r} is not a number") from None
    if price < 0:
        raise ConfigError(f"--prices: {chip} must not be negative")
    return price
