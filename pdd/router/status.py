"""``pdd status [--config FILE] [--url URL] [--json]``: the fleet as a running router sees it.

Reads the router's ``/debug/workers`` and prints one line per worker: id, role, address,
datacenter, this router's requests on it, the engine's running / waiting requests and KV
usage, then per role: MainDecode its DRC fill and hit rate (from its last Stats), Prefill
its WAN bandwidth and RTT estimate, its KV geometry (fingerprint / layers / KV heads held
of the total / head dim / block size / KV dtype / layout / device), and last the health
(NOT ADMITTED: a worker of another model, ``pdd.router.fleet.geometry``). ``--json`` prints the raw answer.
Exit status 0 when at least one worker is healthy, 1 when none is, 2 when the router cannot
be reached. With authentication on, the key comes from ``PDD_API_KEY``.

    mode=pdd in_flight=1
      p     prefill       127.0.0.1:50051  dc=dc-a in_flight=1 running=1 waiting=0 kv=3.1% wan=93.2Mbit/s rtt=20.1ms healthy
      md    main_decode   127.0.0.1:50053  dc=dc-b in_flight=0 running=0 waiting=0 kv=0.0% drc=1200/45000(2.7%) hit=91.3%/12000tok kv_geometry=12a5bb421352/L30/kvh0-3of3/d64/B32/float32/cpu_packed_kv/cpu healthy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from pdd.config import load_config
from pdd.errors import PddError


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd status", description="Show the router's fleet.")
    p.add_argument("--config", help="YAML config: the router address comes from router.*")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--url", help="router base URL, e.g. http://127.0.0.1:8000 (overrides config)")
    p.add_argument("--json", action="store_true", help="print /debug/workers as JSON")
    return p.parse_args(argv)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _bandwidth(bps: float) -> str:
    if bps <= 0:
        return "unmeasured"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f}{unit}"
    return f"{bps:.0f}bit/s"


def _details(w: dict[str, Any]) -> list[str]:
    """The role-specific fields: DRC for MainDecode, the WAN estimate for Prefill."""
    out = []
    drc = w.get("drc_stats")
    if drc is not None:
        out.append(f"drc={drc['used_blocks']}/{drc['capacity_blocks']}({_pct(drc['fill'])})")
        out.append(f"hit={_pct(drc['hit_rate'])}/{drc['query_tokens']}tok")
    wan = w.get("wan")
    if wan is not None:
        rtt = f"{wan['rtt_s'] * 1000:.1f}ms" if wan["rtt_s"] > 0 else "unmeasured"
        out.append(f"wan={_bandwidth(wan['bandwidth_bps'])} rtt={rtt}")
    geo = w.get("geometry")
    if geo is not None:  # pdd.kv_geometry.KvGeometry
        out.append(
            f"kv_geometry={geo['fingerprint'][:12]}/L{geo['num_layers']}"
            f"/kvh{geo['kv_head_start']}-{geo['kv_head_end']}of{geo['total_kv_heads']}"
            f"/d{geo['head_dim']}/B{geo['block_size']}/{geo['kv_dtype']}/{geo['layout']}"
            f"/{geo['device']}"
            + (
                f"/tp{geo['tensor_parallel_size']}"
                if geo.get("tensor_parallel_size", 1) > 1
                else ""
            )
        )
    return out


def format_status(data: dict[str, Any]) -> list[str]:
    """The lines ``pdd status`` prints for one ``/debug/workers`` answer."""
    lines = [f"mode={data['mode']} in_flight={data['in_flight']}"]
    for w in data["workers"]:
        state = "healthy" if w["healthy"] else f"UNHEALTHY ({w['last_error']})"
        if not w.get("admitted", True):
            state = f"NOT ADMITTED ({w['last_error']})"
        running = "-" if w["running"] is None else w["running"]
        fields = [
            f"  {w['id']:<12} {w['role']:<13} {w['target'] or '-':<22}",
            f"dc={w.get('datacenter', '-')}",
            f"in_flight={w['in_flight']} running={running} waiting={w.get('waiting', '-')}",
            f"kv={_pct(w.get('kv_cache_usage'))}",
            *_details(w),
            *([f"restarts={w['restarts']}"] if w.get("restarts") else []),
            state,
        ]
        lines.append(" ".join(fields))
    members = {w["id"] for w in data["workers"]}
    for wid, reason in data.get("not_admitted", {}).items():
        if wid not in members:  # refused at registration: never joined
            lines.append(f"  {wid:<12} NOT ADMITTED ({reason})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        url = args.url
        if url is None:
            cfg = load_config(args.config, args.set)
            url = f"http://{cfg.router.host}:{cfg.router.port}"
        key = os.environ.get("PDD_API_KEY")  # the router's key, when authentication is on
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        base = url.rstrip("/").removesuffix("/v1")
        resp = httpx.get(base + "/debug/workers", headers=headers, timeout=5)
        resp.raise_for_status()  # e.g. 401 without the right key
        data = resp.json()
    except PddError as exc:
        print(f"pdd status: {exc.message}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, ValueError) as exc:
        print(f"pdd status: cannot reach the router: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print("\n".join(format_status(data)))
    return 0 if any(w["healthy"] for w in data["workers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
