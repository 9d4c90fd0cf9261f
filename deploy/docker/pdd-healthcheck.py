#!/usr/bin/env python3
"""Exit 0 when the pdd worker at HOST:PORT answers its Health RPC with ready=true.

A Kubernetes exec probe (and a manual check): the worker serves pdd's own
``pdd.worker.v1.Worker/Health``, not the standard grpc.health.v1 service, so the kubelet's
native gRPC probe cannot ask it. HOST defaults to $POD_IP (a worker binds its pod's address,
not loopback), then 127.0.0.1. Prints one line; exit 1 when not ready or unreachable, 2 on
bad arguments.

    pdd-healthcheck --port 50051 [--host 10.0.0.7] [--timeout 5]
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from pdd.proto import worker_pb2, worker_pb2_grpc


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdd-healthcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default=os.environ.get("POD_IP") or "127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="the worker's gRPC port")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    args = ap.parse_args(argv)
    target = _target(args.host, args.port)
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            health = stub.Health(worker_pb2.HealthRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"pdd-healthcheck: {target}: {err.code().name}: {err.details()}")
            return 1
    state = "ready" if health.ready else "not ready"
    print(f"pdd-healthcheck: {target}: worker {health.worker_id} ({health.role}) {state}")
    return 0 if health.ready else 1


if __name__ == "__main__":
    sys.exit(main())
