"""`pdd bench transfer`: throughput, latency and cancel behaviour of the KV transports.

Each transport is measured next to its raw baseline in the same run, interleaved repeat by
repeat so machine load hits both alike: TCP against one blocking socket (`sendall` into
`recv_into`), UCX against raw ucxx tag send/recv between worker addresses. The receiver is
always a second process. Payloads are KV-sized: one block of SmolLM2 (32 tokens x 23,040 B
= 737,280 B) up to 1 GiB (`--sizes`). A transfer's time runs from `send` until the sender
sees DONE (every chunk landed, verified and acknowledged); the baselines end on an
equivalent one-byte reply.

Cancel: a large transfer is cancelled mid-flight; the receiver records when the last chunk
of it arrived and when it released the transfer; both are compared with the link's RTT.

    pdd bench transfer                                   # loopback, tcp + ucx
    pdd bench transfer --checksum none --sizes 67108864 --no-cancel   # what the check costs
    pdd lab up --prefix pddtx --subnet 10.99.7.0/28 --delay-ms 10 --rate-mbit 100
    pdd bench transfer --lab --lab-prefix pddtx --transports tcp \
        --sizes 737280,8388608,33554432 --repeats 3 --cancel-bytes 33554432 --out results/transfer-lab
    pdd lab down --prefix pddtx
    pdd bench transfer --receiver-netns NS --receiver-host IP   # any two namespaces
    pdd lab up --prefix pddtx --subnet 10.99.7.0/28 --delay-ms 20 --rate-mbit 1000
    pdd bench transfer --lab --lab-prefix pddtx --transports tcp --wan --link-mbit 1000 \
        --out results/transfer-wan            # issue 16: first transfer (cold, warmed up), behind

Writes `transfer.json` and `transfer.png` (matplotlib, Agg) into --out (results/transfer/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pdd.config.transfer import TransferConfig
from pdd.transfer import KVSegment, SendRequest, TransferState, create_transport
from pdd.transfer.testing import PeerProcess, pattern

BLOCK_BYTES = 32 * 23_040  # one KV block of the default model (32 tokens, bf16)
DEFAULT_SIZES = [BLOCK_BYTES, 4 << 20, 64 << 20, 256 << 20]
GiB = float(1 << 30)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdd bench transfer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--transports", default="tcp,ucx", help="comma list of tcp, ucx")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="bytes, comma list")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per size (median)")
    p.add_argument("--streams", type=int, default=4, help="TCP streams per peer")
    p.add_argument("--cancel-bytes", type=int, default=256 << 20, help="size of cancel runs")
    p.add_argument("--no-cancel", action="store_true", help="skip the cancel measurement")
    p.add_argument("--out", default="results/transfer", help="output directory")
    p.add_argument("--receiver-netns", default="", help="run receivers in this namespace")
    p.add_argument("--receiver-host", default="127.0.0.1", help="receivers listen here")
    p.add_argument(
        "--lab",
        action="store_true",
        help="use `pdd lab` (must be up): sender in dc-a, receivers in dc-b",
    )
    p.add_argument("--lab-prefix", default="", help="prefix of the lab to use")
    p.add_argument(
        "--wan",
        action="store_true",
        help="the WAN figures instead: the first transfer to a new peer (--first-bytes), "
        "and a small transfer (--small-bytes) submitted behind a large one (--behind-bytes)",
    )
    p.add_argument("--first-bytes", type=int, default=64 << 20, help="--wan: first transfer")
    p.add_argument(
        "--idle-s",
        type=float,
        default=5.0,
        help="--wan: seconds the warmed-up link sits idle before its first transfer",
    )
    p.add_argument("--behind-bytes", type=int, default=1 << 30, help="--wan: the large one")
    p.add_argument("--small-bytes", type=int, default=2 * BLOCK_BYTES, help="--wan: the small")
    p.add_argument(
        "--link-mbit", type=float, default=0.0, help="--wan: the link's rate (figures against it)"
    )
    p.add_argument(
        "--tls", action="store_true", help="TCP with mutual TLS (a throwaway CA is generated)"
    )
    p.add_argument(
        "--checksum",
        default="xxh3",
        choices=["xxh3", "crc32c", "crc32", "none"],
        help="integrity check (none: measure what the check costs)",
    )
    return p


def _meta(args: argparse.Namespace, config: TransferConfig) -> dict:
    from pdd.transfer.wire import default_checksum_algo

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_1_5_15": [float(x) for x in load],
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "checksum": default_checksum_algo().name,
        "receiver_netns": args.receiver_netns,
        "receiver_host": args.receiver_host,
        "config": config.model_dump(),
        "command": "pdd bench transfer " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
    }


class TransportRunner:
    """A local sender transport and a receiver process landing into one reused buffer."""

    def __init__(self, kind: str, config: TransferConfig, max_bytes: int, netns: str):
        cfg = config.model_dump(exclude_defaults=True)
        self.peer = PeerProcess("receiver", kind, cfg, "--reuse-bytes", str(max_bytes), netns=netns)
        self.sender = create_transport(kind, config)
        self.sender.start()

    def send(self, payload: np.ndarray, deadline_s: float = 600) -> float:
        t0 = time.perf_counter()
        req = SendRequest("bench", [KVSegment(payload)], deadline_s=deadline_s)
        status = self.sender.send(self.peer.address, req).wait(deadline_s)
        if status.state is not TransferState.DONE:
            raise RuntimeError(f"transfer ended {status.state}: {status.reason}")
        return time.perf_counter() - t0

    def drain(self) -> None:
        self.sender.poll_finished()
        self.peer.ask({"cmd": "results"})

    def close(self) -> dict:
        est = self.sender.link_estimate(self.peer.address)
        self.sender.close()
        leftover = {"sender": self.sender.stats().__dict__, "receiver": self.peer.stop()}
        return {"link_estimate": est.__dict__ if est else None, "after_close": leftover}


def _raw_for(kind: str, max_bytes: int, args: argparse.Namespace):
    from pdd.transfer.baseline import RawTcp, RawUcx

    if kind == "tcp":
        return RawTcp(max_bytes, args.receiver_host, args.receiver_netns)
    if kind == "ucx" and not args.receiver_netns:
        return RawUcx(max_bytes)
    return None


def _summary(times: list[float], size: int) -> dict:
    med = statistics.median(times)
    return {
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "gib_s": size / med / GiB,
        "samples": len(times),
    }


def bench_throughput(kind: str, sizes: list[int], args, config: TransferConfig) -> dict:
    """Interleave transport and raw baseline per repeat; medians and their ratio per size."""
    max_bytes = max(sizes)
    runner = TransportRunner(kind, config, max_bytes, args.receiver_netns)
    raw = _raw_for(kind, max_bytes, args)
    rows = []
    try:
        for size in sizes:
            payload = pattern(size, size)
            repeats = args.repeats if size < (512 << 20) else max(3, args.repeats // 2)
            runner.send(payload)  # warm-up: connections, estimates, page faults
            if raw is not None:
                raw.send(payload)
            t_tr, t_raw = [], []
            for _ in range(repeats):
                t_tr.append(runner.send(payload))
                if raw is not None:
                    t_raw.append(raw.send(payload))
                runner.drain()
            row = {"transport": kind, "bytes": size, "transport_stats": _summary(t_tr, size)}
            if t_raw:
                row["raw_stats"] = _summary(t_raw, size)
                row["ratio_to_raw"] = statistics.median(t_raw) / statistics.median(t_tr)
            rows.append(row)
            _print_row(row)
    finally:
        info = runner.close()
        if raw is not None:
            raw.close()
    return {"rows": rows, **info}


def _print_row(row: dict) -> None:
    tr = row["transport_stats"]
    line = f"{row['transport']:>6} {row['bytes']:>12,} B  {tr['gib_s']:7.3g} GiB/s"
    line += f"  {tr['median_s'] * 1e3:9.2f} ms"
    if "raw_stats" in row:
        line += f"   raw {row['raw_stats']['gib_s']:7.3g} GiB/s  ratio {row['ratio_to_raw']:.2f}"
    print(line, flush=True)


def bench_cancel(kind: str, args, config: TransferConfig, runs: int = 3) -> dict:
    """Cancel a big transfer once ~1/8 of it is acknowledged; when did the bytes stop?

    Times are CLOCK_MONOTONIC, which the receiver process (same host, any namespace) shares.
    "Bytes stopped" is when the receiver saw the transfer's last chunk header; "released" is
    when it reported the transfer (every lent buffer back).
    """
    size = args.cancel_bytes
    runner = TransportRunner(kind, config, size, args.receiver_netns)
    payload = pattern(1, size)
    out = []
    try:
        runner.send(payload[: 4 << 20])  # connect and learn the link first
        runner.drain()
        for _ in range(runs):
            out.append(_cancel_once(runner, payload))
            row = out[-1]
            print(
                f"{kind:>6} cancel: bytes stopped +{row['bytes_stopped_after_s'] * 1e3:.2f} ms, "
                f"receiver released +{row['receiver_released_after_s'] * 1e3:.2f} ms, "
                f"RTT {row['rtt_s'] * 1e3:.3f} ms, both idle: {row['both_sides_idle']}",
                flush=True,
            )
    finally:
        info = runner.close()
    return {"runs": out, **info}


def _cancel_once(runner: TransportRunner, payload: np.ndarray) -> dict:
    handle = runner.sender.send(runner.peer.address, SendRequest("c", [KVSegment(payload)]))
    deadline = time.monotonic() + 60
    while handle.status().bytes_acked < payload.nbytes // 8 and time.monotonic() < deadline:
        time.sleep(0.0002)
    t_cancel = time.monotonic()
    handle.cancel()
    status = handle.wait(30)
    t_sender = time.monotonic()
    res = _wait_result(runner, handle.transfer_id)
    est = runner.sender.link_estimate(runner.peer.address)
    rtt = est.rtt_s if est else 0.0
    stopped = max(0.0, res["last_chunk_t"] - t_cancel)
    receiver = runner.peer.ask({"cmd": "stats"})
    sender = runner.sender.stats()
    idle = (sender.open_outbound, sender.pinned_buffers, receiver["open_inbound"]) == (0, 0, 0)
    return {
        "sender_state": status.state.value,
        "receiver_state": res["state"],
        "bytes_acked_at_cancel_end": status.bytes_acked,
        "sender_released_after_s": t_sender - t_cancel,
        "bytes_stopped_after_s": stopped,
        "receiver_released_after_s": res["reported_t"] - t_cancel,
        "rtt_s": rtt,
        "stopped_within_2_rtt": stopped <= 2 * rtt,
        "both_sides_idle": idle and receiver["lent_buffers"] == 0,
    }


def bench_wan(kind: str, args: argparse.Namespace, config: TransferConfig) -> dict:
    """Issue 16's transport figures. ``first``: a sender that never sent to this receiver
    sends ``--first-bytes`` (its flow plan starts from nothing known), against the link's rate.
    ``behind``: once a ``--behind-bytes`` transfer is under way (an eighth acknowledged), a
    ``--small-bytes`` one is submitted to the same peer; it should finish within 2 RTT plus its
    own bytes at the link's rate (the sender shares a link between transfers, not FIFO)."""
    big, small = args.behind_bytes, args.small_bytes
    warmed = _first_after_warm_up(kind, args, config)
    runner = TransportRunner(kind, config, max(args.first_bytes, big), args.receiver_netns)
    addr = runner.peer.address
    try:
        t_first = runner.send(pattern(1, args.first_bytes))
        runner.drain()
        est = runner.sender.link_estimate(addr)
        rtt = est.rtt_s if est else 0.0
        link_bps = args.link_mbit * 1e6 or (est.bandwidth_bps if est else 0.0)
        h_big = runner.sender.send(addr, SendRequest("big", [KVSegment(pattern(2, big))],
                                                     deadline_s=600))  # fmt: skip
        deadline = time.monotonic() + 300
        while h_big.status().bytes_acked < big // 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        t0 = time.perf_counter()
        h_small = runner.sender.send(addr, SendRequest("small", [KVSegment(pattern(3, small))]))
        small_state = h_small.wait(300).state
        t_small = time.perf_counter() - t0
        big_acked_then = h_big.status().bytes_acked
        big_state = h_big.wait(600).state
        runner.drain()
    finally:
        info = runner.close()
    bound = 2 * rtt + (small * 8 / link_bps if link_bps else 0.0)
    first_bps = args.first_bytes * 8 / t_first
    return {
        "rtt_s": rtt,
        "link_mbit": link_bps / 1e6,
        "first": {
            "bytes": args.first_bytes, "seconds": t_first, "mbit_s": first_bps / 1e6,
            "fraction_of_link": first_bps / link_bps if link_bps else None,
        },
        "first_after_warm_up": {
            **warmed, "mbit_s": args.first_bytes * 8 / warmed["seconds"] / 1e6,
            "fraction_of_link": args.first_bytes * 8 / warmed["seconds"] / link_bps
            if link_bps else None,
        },
        "behind": {
            "big_bytes": big, "small_bytes": small, "small_seconds": t_small,
            "bound_seconds": bound, "within_bound": t_small <= bound,
            "big_fraction_acked_when_small_done": big_acked_then / big,
            "states": [small_state.value, big_state.value],
        },
        **info,
    }  # fmt: skip


def _first_after_warm_up(kind: str, args: argparse.Namespace, config: TransferConfig) -> dict:
    """Another new peer, as the router has P meet an MD: WarmKv (``Transport.warm``) when
    the MD is first seen, ``--idle-s`` of nothing, then the first transfer."""
    runner = TransportRunner(kind, config, args.first_bytes, args.receiver_netns)
    addr = runner.peer.address
    try:
        t0 = time.perf_counter()
        started = runner.sender.warm(addr)
        while runner.sender.warming(addr):
            if time.perf_counter() - t0 > 60:
                raise RuntimeError("the warm-up did not end in 60 s")
            time.sleep(0.005)
        t_warm = time.perf_counter() - t0
        est = runner.sender.link_estimate(addr)
        time.sleep(args.idle_s)
        payload = pattern(1, args.first_bytes)
        t_first = runner.send(payload)
        runner.drain()
    finally:
        runner.close()
    return {
        "bytes": args.first_bytes, "seconds": t_first, "warm_up_started": started,
        "warm_up_seconds": t_warm, "idle_s": args.idle_s,
        "estimate_after_warm_up": est.__dict__ if est else None,
    }  # fmt: skip


def claims(results: dict) -> dict:
    """The figures the issue asks for, read off this run."""
    out: dict = {}
    for kind, res in results["throughput"].items():
        row = next((r for r in res["rows"] if r["bytes"] == 64 << 20), None)
        if row is None:
            continue
        if kind == "tcp" and "ratio_to_raw" in row:
            out["tcp_64MiB_ratio_to_raw"] = row["ratio_to_raw"]
            out["tcp_64MiB_at_least_80pct_of_raw"] = row["ratio_to_raw"] >= 0.8
        if kind == "ucx":
            out["ucx_64MiB_gib_s"] = row["transport_stats"]["gib_s"]
            out["ucx_64MiB_at_least_5_gib_s"] = row["transport_stats"]["gib_s"] >= 5.0
    for kind, res in results.get("wan", {}).items():
        frac = res["first"]["fraction_of_link"]
        if frac is not None:
            out[f"{kind}_first_transfer_cold_fraction_of_link"] = frac
        warm = res["first_after_warm_up"]["fraction_of_link"]
        if warm is not None:
            out[f"{kind}_first_transfer_after_warm_up_fraction_of_link"] = warm
            out[f"{kind}_first_transfer_after_warm_up_at_least_80pct_of_link"] = warm >= 0.8
        out[f"{kind}_small_behind_large_within_2_rtt_plus_its_bytes"] = res["behind"][
            "within_bound"
        ]
    for kind, res in results["cancel"].items():
        runs = res["runs"]
        out[f"{kind}_cancel_stopped_within_2_rtt"] = all(r["stopped_within_2_rtt"] for r in runs)
        out[f"{kind}_cancel_both_sides_released"] = all(r["both_sides_idle"] for r in runs)
    return out


def _wait_result(runner: TransportRunner, tid: int, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in runner.peer.ask({"cmd": "results"})["results"]:
            if r["transfer_id"] == tid:
                return r
        time.sleep(0.01)
    raise RuntimeError(f"receiver never reported transfer {tid}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, res in results["throughput"].items():
        rows = res["rows"]
        xs = [r["bytes"] / (1 << 20) for r in rows]
        ax.plot(xs, [r["transport_stats"]["gib_s"] for r in rows], "o-", label=f"{kind} transport")
        if rows and "raw_stats" in rows[0]:
            ys = [r["raw_stats"]["gib_s"] for r in rows]
            ax.plot(xs, ys, "x--", label=f"raw {kind} baseline")
    ax.set_xscale("log")
    ax.set_xlabel("transfer size (MiB)")
    ax.set_ylabel("throughput (GiB/s, median)")
    ax.set_title(
        f"pdd transfer, {results['meta']['host']} (load {results['meta']['loadavg_1_5_15'][0]})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _lab_reexec(args: argparse.Namespace, argv: list[str]) -> int:
    """Resolve the lab's namespaces and run this benchmark again inside dc-a."""
    cmd = [sys.executable, "-m", "pdd.cli", "lab", "status", "--json", "--no-measure"]
    if args.lab_prefix:
        cmd += ["--prefix", args.lab_prefix]
    status = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if status["state"] != "up":
        print(f"pdd bench transfer: lab is {status['state']} (run `pdd lab up`)", file=sys.stderr)
        return 2
    dcs = {d["name"]: d for d in status["datacenters"]}
    rest = [a for a in argv if a != "--lab"]
    inner = [
        sys.executable,
        "-m",
        "pdd.cli",
        "bench",
        "transfer",
        *rest,
        "--receiver-netns",
        dcs["dc-b"]["netns"],
        "--receiver-host",
        dcs["dc-b"]["wan_ip"],
    ]
    return subprocess.run(["ip", "netns", "exec", dcs["dc-a"]["netns"], *inner]).returncode


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.lab:
        return _lab_reexec(args, argv)
    kinds = [k for k in args.transports.split(",") if k]
    sizes = sorted(int(s) for s in args.sizes.split(","))
    config = TransferConfig(
        wan_streams=args.streams, listen_host=args.receiver_host, checksum=args.checksum
    )
    if args.tls:
        import tempfile

        from pdd.transfer.testing import make_pki

        pki = make_pki(tempfile.mkdtemp(prefix="pdd-bench-pki-"))
        files = {"tls_cert_file": "receiver.pem", "tls_key_file": "receiver.key"}
        tls = {k: pki[v] for k, v in files.items()} | {"tls_ca_file": pki["ca.pem"]}
        config = config.model_copy(update={"tls": True, **tls})
    results: dict = {"meta": _meta(args, config), "throughput": {}, "cancel": {}}
    print(results["meta"]["uptime"], flush=True)
    for kind in kinds:
        if args.wan:
            wan = results.setdefault("wan", {})[kind] = bench_wan(kind, args, config)
            print(
                f"{kind:>6} wan: {json.dumps({k: wan[k] for k in ('first', 'first_after_warm_up', 'behind')})}"
            )
            continue
        results["throughput"][kind] = bench_throughput(kind, sizes, args, config)
        if not args.no_cancel:
            results["cancel"][kind] = bench_cancel(kind, args, config)
    results["claims"] = claims(results)
    for name, value in results["claims"].items():
        print(f"  {name}: {value:.3f}" if isinstance(value, float) else f"  {name}: {value}")
    results["meta"]["uptime_after"] = subprocess.run(
        ["uptime"], capture_output=True, text=True
    ).stdout.strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(results, indent=2, default=str))
    if results["throughput"]:
        plot(results, out / "transfer.png")
    print(f"wrote {out / 'transfer.json'}" + (" and transfer.png" if results["throughput"] else ""))
    return 0
