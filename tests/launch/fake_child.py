"""A stand-in for a worker or the router, for the launcher's unit tests (no engine, no model).

    fake_child.py worker --config FILE --worker ID
    fake_child.py router --config FILE

It behaves as the env var FAKE_<ID> (router: FAKE_ROUTER) says:
    ok (default)  print the ready line, exit 0 on SIGTERM
    crash         print an error and exit 3 before the ready line
    die           print the ready line, exit 4 half a second later
    die_once      like die in the first process of this `pdd serve` run, then like ok
    bad_exit      print the ready line, exit 5 on SIGTERM
    stubborn      print the ready line, ignore SIGTERM
    unhealthy     (router) report every worker unhealthy on /health
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

from pdd.launch.signals import stop_event


def main() -> int:
    kind, args = sys.argv[1], sys.argv[2:]
    cfg = yaml.safe_load(open(args[args.index("--config") + 1]))
    name = args[args.index("--worker") + 1] if kind == "worker" else "router"
    behaviour = os.environ.get(f"FAKE_{name.upper()}", "ok")
    stop = stop_event([signal.SIGTERM])  # Event.set() in a handler can deadlock the fake
    if behaviour == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if behaviour == "crash":
        print(f"{name}: boom, cannot load the model", flush=True)
        return 3
    if kind == "router":
        _serve_health(cfg, healthy=behaviour != "unhealthy")
        print(f"pdd router ready: http://x:{cfg['router']['port']}/v1", flush=True)
    else:
        print(f"pdd worker ready: id={name}", flush=True)
    if behaviour == "die" or (behaviour == "die_once" and _first_death(args, name)):
        time.sleep(0.5)
        return 4
    while not stop.wait(0.1):
        pass
    return 5 if behaviour == "bad_exit" else 0


def _first_death(args: list[str], name: str) -> bool:
    """True once per `pdd serve` run (a marker next to its effective config)."""
    marker = os.path.join(os.path.dirname(args[args.index("--config") + 1]), f"died-{name}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _serve_health(cfg: dict, healthy: bool) -> None:
    body = json.dumps(
        {"workers": [{"id": w["id"], "healthy": healthy} for w in cfg["workers"]]}
    ).encode()

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((cfg["router"]["host"], cfg["router"]["port"]), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
