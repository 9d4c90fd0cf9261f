"""``pdd plan-validate``: does the planner predict the lab? ``pdd plan``'s simulator replays a
``pdd bench serve`` run.

    pdd plan-validate --run results/validate \\
        --profiles cpu.yaml cpu2.yaml --chips C=cpu2,P=cpu,RLD=cpu,MD=cpu \\
        --wan 100Mbps,20ms --out docs/results/plan/validate

For each mode of the run:

- the trace (``trace-MODE.jsonl``, the planner's JSONL trace): what was asked of the mode, never
  how fast it was served. The warm-up requests at the times they were sent (a closed loop;
  ``measured: false``), then the measured ones at the arrival times the load pattern scheduled
  (the log's ``scheduled_s``) after the warm-up phase's wall time. A bench conversation is a
  planner conversation; prompt and output tokens as the server counted them (from any mode
  where the request succeeded); ``prefix_tokens`` what the prompt shares with the request it
  builds on (the log's ``after``): its conversation's previous prompt (the benchmark appends a
  tool call and its result to the history, not the model's answer), or, for a branch from
  another conversation, ``shared_tokens`` rescaled to the server's count with ``prefix_of``
  naming that conversation.
- the fleet the mode ran (the workers of its topology config, by role) on the chips ``--chips``
  names, the lab's WAN (``--wan``), the router policy of the mode's config, pdd's own routing of
  the baselines (no prefix affinity, as the router runs them);
- the figures: TTFT P50/P90, TPOT P50, SLA goodput (the run's SLA; the window from the first
  measured arrival to the last measured end, the benchmark's), WAN bytes of the measured
  requests (simulated KV against the KV the workers reported and the bytes metered on the
  link), pipelines and RLD token share.

Writes ``validate.json`` and ``validate.md`` (measured, simulated, relative error per figure)
under ``--out``. The simulator runs in milliseconds; the run it replays takes the lab's time.
It reads the results folder as files (no import of pdd.bench). Exit
codes: 0 every mode within the target, 1 some mode outside it, 2 bad input.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdd.config import load_config
from pdd.config.router import PddPolicyConfig
from pdd.errors import ConfigError
from pdd.plan.cli import ROLE_OF, parse_bandwidth, parse_wan
from pdd.plan.fleet import ROLES, Fleet, Group
from pdd.plan.profile import ChipProfile, load_profiles
from pdd.plan.sim import SimSettings, Simulation, Wan
from pdd.plan.stats import HANDOFFS, PIPES, Sla, measured_requests
from pdd.plan.workload import load_trace
from pdd.protocol import Role, RouterMode

TARGET = 0.25  # the bound on |simulated / measured - 1| for the targeted figures
TARGETED = ("ttft_p50_s", "goodput_rps", "link_bytes")
NO_WAN = (RouterMode.COLOCATED, RouterMode.PD_LOCAL)  # no KV crosses the WAN


def asked(records: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[int, int]]:
    """(group, index) -> (prompt, output tokens) as a server counted them in any mode where
    the request succeeded (every mode of a run sends the same requests): a request that failed
    in one mode (a 429, with no usage) is still what was asked there."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for r in records:
        if r["status"] == 200 and r["prompt_tokens"] > 0:
            out.setdefault((r["group"], r["index"]), (r["prompt_tokens"], r["output_tokens"]))
    return out


def mode_trace(records: list[dict[str, Any]], group: str,
               tokens: dict[tuple[str, int], tuple[int, int]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The planner trace of one mode's requests of ``group`` (the module docstring);
    ``tokens``: ``asked`` of the whole run (default: this mode's own counts)."""
    tokens = tokens if tokens is not None else asked(records)
    recs = sorted((r for r in records if r["group"] == group), key=lambda r: r["index"])
    if any("scheduled_s" not in r or "after" not in r for r in recs):
        raise ConfigError("the run's requests.jsonl has no scheduled_s / after: it predates "
                          "them (pdd bench serve writes them since 2026-12-02); run it again")  # fmt: skip
    warm_wall = max((r["sent_s"] + r["e2e_s"] for r in recs if r["warmup"]), default=0.0)
    by_index = {r["index"]: r for r in recs}
    lines = []
    for r in recs:
        key = (group, r["index"])
        if key not in tokens:
            raise ConfigError(f"request {r['index']} of {group} failed in every mode: its "
                              "prompt length is unknown")  # fmt: skip
        prompt, output = tokens[key]
        closed = r["scheduled_s"] is None  # the warm-up (closed loop): when it was sent
        line = {"timestamp": round(r["sent_s"] if closed else warm_wall + r["scheduled_s"], 6),
                "conversation_id": r["conversation"], "prompt_tokens": prompt,
                "output_tokens": output, "prefix_tokens": 0, "measured": not r["warmup"]}  # fmt: skip
        src = by_index.get(r["after"]) if r["after"] is not None else None
        if src is not None and src["conversation"] == r["conversation"]:
            line["prefix_tokens"] = min(tokens.get((group, src["index"]), (0, 0))[0], prompt)
        elif src is not None and r.get("shared_tokens"):  # a branch: shared in the bench's
            scale = prompt / max(r["expected_prompt_tokens"] or prompt, 1)  # own token count
            line["prefix_tokens"] = min(round(r["shared_tokens"] * scale), prompt)
            line["prefix_of"] = src["conversation"]
        lines.append(line)
    return lines


def mode_fleet(entry: dict[str, Any], chips: dict[Role, str]) -> tuple[Fleet, PddPolicyConfig]:
    """The fleet a bench mode ran and its router policy (from its topology config)."""
    cfg = load_config(entry["config"], list(entry.get("overrides") or []))
    mode = RouterMode(cfg.router.mode)
    counts = Counter(Role(w.role) for w in cfg.workers)
    if mode in (RouterMode.PD_LOCAL, RouterMode.PD_WAN):
        counts = Counter({Role.PREFILL: counts[Role.PREFILL], Role.MAIN_DECODE: 1})  # one D
    missing = [r.value for r in ROLES[mode] if r not in chips]
    if missing:
        raise ConfigError(f"--chips: no chip for {missing} (mode {entry['name']})")
    groups = tuple(Group(r, chips[r], counts[r]) for r in ROLES[mode])
    return Fleet(mode, groups), cfg.router.pdd


def simulate(fleet: Fleet, policy: PddPolicyConfig, profiles: dict[str, ChipProfile], wan: Wan,
             trace: Path, sla: Sla, local_bps: float) -> dict[str, Any]:  # fmt: skip
    settings = SimSettings(policy=policy, local_bandwidth_bps=local_bps, baseline_affinity=False)
    sim = Simulation(fleet, profiles, wan, load_trace(trace), sla, settings)
    res = sim.run()
    idx, _ = measured_requests(sim)
    log = sim.log
    out = sum(log.out[i] for i in idx)
    return {
        "fleet": res.fleet, "requests": res.requests, "measured": res.measured,
        "ttft_p50_s": res.ttft_p50_s, "ttft_p90_s": res.ttft_p90_s, "tpot_p50_s": res.tpot_p50_s,
        "goodput_rps": res.goodput_rps, "sla_attainment": res.attainment,
        "wan_bytes": sum(log.wan[i] for i in idx),
        "rld_token_share": sum(log.rld[i] for i in idx) / max(out, 1),
        "pipelines": dict(Counter(PIPES[log.pipe[i]] for i in idx)),
        "handoffs": dict(Counter(HANDOFFS[log.handoff[i]] for i in idx)),
        "utilisation": res.utilisation, "wan_utilisation": res.wan_utilisation,
    }  # fmt: skip


def measured_figures(summary: dict[str, Any], records: list[dict[str, Any]],
                     sla: Sla) -> dict[str, Any]:  # fmt: skip
    """The run's figures of one mode; goodput recounted from its measured requests for ``sla``
    (the benchmark's definitions: ``pdd.bench.serve.metrics``), so any SLA can be compared."""
    keys = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "rld_token_share", "pipelines", "handoffs")
    out = {k: summary.get(k) for k in keys}
    good = 0
    ok = [r for r in records if not r["warmup"] and r["status"] == 200 and r["ttft_s"] is not None]
    for r in ok:
        n = r["output_tokens"]
        tpot = (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n > 1 else 0.0
        good += r["ttft_s"] <= sla.ttft_s and tpot <= sla.tpot_s
    out["goodput_rps"] = good / summary["wall_s"] if summary.get("wall_s") else 0.0
    out["sla_attainment"] = good / max(summary.get("requests") or len(ok), 1)
    out["wan_bytes"] = summary.get("wan_bytes_total")  # KV payload the workers reported
    out["link_bytes"] = summary.get("link_bytes_total")  # metered on the lab's WAN, both ways
    out["measured"] = summary.get("requests")
    return out


def error(sim: float | None, real: float | None) -> float | None:
    """Relative error of the simulated figure; 0 when both are 0; None when undefined."""
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return sim / real - 1


def request_records(run: Path) -> list[dict[str, Any]]:
    """The records of the run's requests.jsonl (or requests.jsonl.gz, as results pages keep it)."""
    plain = run / "requests.jsonl"
    if plain.exists() or not plain.with_suffix(".jsonl.gz").exists():
        text = plain.read_text()
    else:
        text = gzip.decompress(plain.with_suffix(".jsonl.gz").read_bytes()).decode()
    return [json.loads(x) for x in text.splitlines() if x]


def validate(run: Path, profiles: dict[str, ChipProfile], chips: dict[Role, str], wan: Wan,
             local_bps: float, out: Path, group: str = "agentic",
             sla: Sla | None = None) -> dict[str, Any]:  # fmt: skip
    """Every mode of ``run`` measured against simulated (``sla``: default the run's own)."""
    results = json.loads((run / "results.json").read_text())
    records = request_records(run)
    config = results["config"]
    sla = sla or Sla(config["sla"]["ttft_s"], config["sla"]["tpot_s"])
    out.mkdir(parents=True, exist_ok=True)
    tokens = asked(records)
    rows: dict[str, Any] = {}
    for entry in config["modes"]:
        name = entry["name"]
        summary = results["modes"][name]["workloads"][group]["summary"]
        trace = mode_trace([r for r in records if r["mode"] == name], group, tokens)
        path = out / f"trace-{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in trace))
        fleet, policy = mode_fleet(entry, chips)
        sim = simulate(fleet, policy, profiles, wan, path, sla, local_bps)
        real = measured_figures(summary, [r for r in records if r["mode"] == name
                                          and r["group"] == group], sla)  # fmt: skip
        keys = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "goodput_rps")
        errors = {k: error(sim[k], real[k]) for k in keys}
        if fleet.mode not in NO_WAN:  # (pd_local's workers report their local KV as WAN KV)
            errors["wan_bytes"] = error(sim["wan_bytes"], real["wan_bytes"])
            errors["link_bytes"] = error(sim["wan_bytes"], real["link_bytes"])
        within = all(e is not None and abs(e) <= TARGET
                     for k, e in errors.items() if k in TARGETED)  # fmt: skip
        real["errors"] = summary.get("errors", 0)
        rows[name] = {"measured": real, "simulated": sim, "error": errors, "within": within}
    report = {"run": str(run), "group": group, "wan": asdict(wan), "local_bandwidth_bps": local_bps, "chips": {r.value: c for r, c in chips.items()},
              "profiles": {n: p.description for n, p in profiles.items()},
              "sla": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s}, "target": TARGET,
              "modes": rows}  # fmt: skip
    (out / "validate.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "validate.md").write_text(markdown(report))
    return report


def _fmt(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if key.endswith("_s"):
        return f"{v * 1000:.0f} ms"
    if key.endswith("bytes"):
        return f"{v / 1e6:.1f} MB"
    return f"{v:.3g}"


def markdown(report: dict[str, Any]) -> str:
    cols = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "goodput_rps", "wan_bytes", "link_bytes")
    head = ["mode", "TTFT P50", "TTFT P90", "TPOT P50", "goodput req/s", "WAN KV",
            "link (metered)", "pipelines (measured / simulated)", f"within {TARGET:.0%}"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["modes"].items():
        real, sim, err = row["measured"], row["simulated"], row["error"]
        cells = [name]
        for k in cols:
            e = err.get(k)
            if k.endswith("bytes") and k not in err:
                cells.append("n/a (no WAN KV)")
                continue
            sim_v = sim["wan_bytes"] if k == "link_bytes" else sim[k]
            shown = f"{_fmt(k, real[k])} / {_fmt(k, sim_v)}"
            cells.append(shown + ("" if e is None else f" ({e:+.0%})"))
        pipes = (", ".join(f"{p} {n}" for p, n in sorted((real["pipelines"] or {}).items()))
                 + " / " + ", ".join(f"{p} {n}" for p, n in sorted(sim["pipelines"].items())))  # fmt: skip
        cells += [pipes, "yes" if row["within"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    note = ("Each cell: measured / simulated (simulated / measured - 1). Targeted: TTFT P50, "
            "goodput and the link's bytes (modes with WAN KV). WAN KV: the KV bytes the workers "
            "reported; link: every byte metered on the lab's WAN, both ways (the simulator counts "
            "KV only).")  # fmt: skip
    return "\n".join([*lines, "", note, ""])


def parse_chips(text: str) -> dict[Role, str]:
    out = {}
    for part in filter(None, text.split(",")):
        key, _, chip = part.partition("=")
        if key.strip() not in ROLE_OF or not chip.strip():
            raise ConfigError(f"--chips: {part!r} is not ROLE=CHIP (roles {sorted(ROLE_OF)})")
        out[ROLE_OF[key.strip()]] = chip.strip()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdd plan-validate",
                                 description="replay a pdd bench serve run through pdd plan's "
                                 "simulator, mode by mode")  # fmt: skip
    ap.add_argument("--run", type=Path, required=True, help="a pdd bench serve results folder")
    ap.add_argument("--profiles", type=Path, nargs="+", required=True)
    ap.add_argument("--chips", required=True, help="chip per role, e.g. C=cpu2,P=cpu,MD=cpu")
    ap.add_argument("--wan", required=True, help="the lab's WAN: BANDWIDTH,RTT")
    ap.add_argument("--local-bandwidth", default="32Gbps", help="P -> RLD / pd_local D inside dc-a")
    ap.add_argument("--workload", default="agentic", help="the run's workload (group) to replay")
    ap.add_argument("--sla", help="ttft=S,tpot=S for goodput (default: the run's own SLA)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        profiles = load_profiles(args.profiles)
        chips = parse_chips(args.chips)
        unknown = sorted(set(chips.values()) - set(profiles))
        if unknown:
            raise ConfigError(f"--chips: no profile named {unknown} (have {sorted(profiles)})")
        report = validate(args.run, profiles, chips, parse_wan(args.wan),
                          parse_bandwidth(args.local_bandwidth), args.out, args.workload,
                          Sla.parse(args.sla) if args.sla else None)  # fmt: skip
    except (ConfigError, OSError, KeyError) as exc:
        print(f"plan_validate: {exc}", file=sys.stderr)
        return 2
    print((args.out / "validate.md").read_text())
    return 0 if all(r["within"] for r in report["modes"].values()) else 1
