"""``pdd status [--config FILE] [--url URL]``: the fleet as a running router sees it.

Reads the router's ``/debug/workers`` and prints one line per worker. Exit status 0 when at
least one worker is healthy, 1 when none is, 2 when the router cannot be reached.
"""

from __future__ import annotations

import argparse
import sys

import httpx

from pdd.config import load_config
from pdd.errors import PddError


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdd status", description="Show the router's fleet.")
    p.add_argument("--config", help="YAML config: the router address comes from router.*")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--url", help="router base URL, e.g. http://127.0.0.1:8000 (overrides config)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    try:
        url = args.url
        if url is None:
            cfg = load_config(args.config, args.set)
            url = f"http://{cfg.router.host}:{cfg.router.port}"
        data = httpx.get(url.rstrip("/").removesuffix("/v1") + "/debug/workers", timeout=5).json()
    except PddError as exc:
        print(f"pdd status: {exc.message}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, ValueError) as exc:
        print(f"pdd status: cannot reach the router: {exc}", file=sys.stderr)
        return 2
    print(f"mode={data['mode']} in_flight={data['in_flight']}")
    for w in data["workers"]:
        state = "healthy" if w["healthy"] else f"UNHEALTHY ({w['last_error']})"
        print(f"  {w['id']:<12} {w['role']:<13} {w['target'] or '-':<22} "
              f"in_flight={w['in_flight']} running={w['running']} {state}")  # fmt: skip
    return 0 if any(w["healthy"] for w in data["workers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
