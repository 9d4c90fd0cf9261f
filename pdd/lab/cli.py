"""`pdd lab up | down | status | set | exec`: the two-datacenter lab from the command line.

The lab's config is the ``lab`` section of a pdd config (``--config F``, ``--set lab.x=y``);
the flags below override it. ``up`` returns once the lab runs (a daemon keeps it running).
"""

from __future__ import annotations

import argparse
import sys

from pdd.config import LabConfig, load_config
from pdd.errors import PddError
from pdd.lab.lab import Lab
from pdd.lab.state import LabStatus

# flag -> LabConfig field
_OVERRIDES = {
    "delay_ms": float,
    "rate_mbit": float,
    "loss": float,
    "mtu": int,
    "queue_bytes": int,
    "loss_b_to_a": float,
    "jitter_ms": float,
    "reorder": float,
    "reorder_ms": float,
    "duplicate": float,
    "flap_every_s": float,
    "rate_change_every_s": float,
    "chaos_seed": int,
    "prefix": str,
    "subnet": str,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdd lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    cmds = {
        "up": sub.add_parser("up", help="make the namespaces, the links and the relay"),
        "down": sub.add_parser("down", help="remove everything the lab made (idempotent)"),
        "status": sub.add_parser("status", help="addresses, link parameters, a fresh measurement"),
        "exec": sub.add_parser("exec", help="run a command inside a datacenter: exec dc-a -- CMD"),
        "set": sub.add_parser("set", help="change a running lab's WAN rate (up to its built one)"),
    }
    for name, cp in cmds.items():
        cp.add_argument("--config", help="pdd YAML config (its `lab` section is used)")
        cp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        cp.add_argument("--prefix", help="lab name prefix (default: pdd)")
        if name == "up":
            for field, kind in _OVERRIDES.items():
                if field != "prefix":
                    flag = "--" + field.replace("_", "-")
                    cp.add_argument(flag, type=kind, help=LabConfig.model_fields[field].description)
    for name in ("up", "status"):
        cmds[name].add_argument("--no-measure", action="store_true", help="skip the measurement")
        cmds[name].add_argument(
            "--seconds", type=float, default=1.0, help="length of the throughput flow in link time"
        )
    cmds["status"].add_argument("--json", action="store_true", help="print LabStatus as JSON")
    cmds["set"].add_argument("--rate-mbit", dest="new_rate", type=float, required=True,
                             help="the WAN rate from now on, each direction")  # fmt: skip
    cmds["exec"].add_argument("dc", help="dc-a or dc-b")
    cmds["exec"].add_argument("argv", nargs="*", help="-- CMD [ARGS...]")
    cmds["exec"].epilog = "Options go before `--`; everything after it is the command."
    return p


def _lab_config(args: argparse.Namespace) -> LabConfig:
    """The config's lab section with --set and the flags applied (flags win)."""
    flags = {f: getattr(args, f, None) for f in _OVERRIDES}
    overrides = args.set + [f"lab.{k}={v}" for k, v in flags.items() if v is not None]
    return load_config(args.config, overrides).lab


def format_status(st: LabStatus) -> str:
    lines = [f"lab {st.prefix}: {st.state}"]
    lines += [f"  problem: {p}" for p in st.problems]
    if st.state == "down":
        return "\n".join(lines)
    lines.append(
        f"  link   delay {st.delay_ms:g} ms each way, rate {st.rate_mbit:g} Mbit/s, "
        f"loss {st.loss:g}, mtu {st.mtu}, queue {st.queue_bytes} B per direction"
    )
    if st.chaos:
        lines.append(f"  chaos  {st.chaos}")
    for dc in st.datacenters:
        lines.append(
            f"  {dc.name}   netns {dc.netns}, wan {dc.wan_ip}, mgmt {dc.mgmt_ip} "
            f"(host end {dc.host_ip})"
        )
    lines.append(f"  pids   supervisor {st.supervisor_pid}, relay {st.relay_pid}")
    return "\n".join(lines)


def _show(lab: Lab, st: LabStatus, args: argparse.Namespace) -> None:
    print(format_status(st), flush=True)
    if st.state == "up" and not args.no_measure:
        m = lab.measure_link(seconds=args.seconds)
        print(
            f"  measured rtt {m.rtt_ms:.2f} ms, throughput {m.throughput_mbit:.1f} Mbit/s "
            "(dc-a -> dc-b, one bulk TCP flow)"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv[:1] == ["exec"] and "--" in argv:  # options may come after DC: split at "--"
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = _parser().parse_args(argv)
    try:
        lab = Lab(_lab_config(args))
        if args.cmd == "up":
            _show(lab, lab.up(), args)
        elif args.cmd == "down":
            lab.down()
            print(f"lab {lab.cfg.prefix}: down")
        elif args.cmd == "status":
            st = lab.status()
            if args.json:
                print(st.model_dump_json(indent=2))
            else:
                _show(lab, st, args)
            return 0 if st.state == "up" else 1
        elif args.cmd == "set":
            print(format_status(lab.set_rate(args.new_rate)), flush=True)
        else:
            return _exec(lab, args.dc, command or args.argv)
    except PddError as exc:
        print(f"pdd lab {args.cmd}: {exc.message}", file=sys.stderr)
        return 1
    return 0


def _exec(lab: Lab, dc: str, argv: list[str]) -> int:
    """Exit code of the command; 128+N if a signal N killed it (as a shell reports it)."""
    if not argv:
        print("pdd lab exec: give a command: pdd lab exec dc-a -- CMD [ARGS...]", file=sys.stderr)
        return 2
    code = lab.exec(dc, argv).returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
