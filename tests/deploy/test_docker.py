"""The image recipe (deploy/docker) and the worker liveness probe it ships, pdd-healthcheck,
run against a real gRPC server speaking pdd's Worker service."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from pdd.proto import worker_pb2, worker_pb2_grpc
from tests.deploy.support import DEPLOY, REPO, by_kind, container, pod_spec, rendered

DOCKER = DEPLOY / "docker"
HEALTHCHECK = DOCKER / "pdd-healthcheck.py"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines()]
    return [tuple(ln.split(None, 1)) for ln in lines if ln and not ln.startswith("#")]


def test_image_installs_pdd_gpu_on_python_311_and_runs_the_cli():
    ins = _instructions()
    args = {k: v for k, v in ins if k == "ARG"}
    assert args["ARG"] == "PYTHON_IMAGE=python:3.11-slim-bookworm"
    runs = " ".join(v for k, v in ins if k == "RUN")
    assert '/wheels/pdd-*.whl)[gpu]"' in runs
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["tini", "--", "pdd"]
    assert "tini" in runs


def test_image_copies_only_files_the_build_context_keeps():
    keep = [
        ln[1:].rstrip("/")
        for ln in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
        if ln.startswith("!")
    ]
    for key, value in _instructions():
        if key != "COPY" or value.startswith("--from"):
            continue
        *sources, _dest = value.split()
        for src in sources:
            assert (REPO / src).exists(), src
            assert src.rstrip("/") in keep, src


def test_image_user_and_ports_match_the_manifests():
    ins = _instructions()
    assert dict(ins)["USER"] == "10001:10001"
    exposed = {int(p) for p in dict(ins)["EXPOSE"].split()}
    for dc in ("dc-a", "dc-b"):
        for obj in rendered(dc):
            if obj["kind"] in ("Deployment", "StatefulSet"):
                assert pod_spec(obj)["securityContext"]["runAsUser"] == 10001
                assert {p["containerPort"] for p in container(obj)["ports"]} <= exposed
    router = container(by_kind(rendered("dc-a"), "Deployment")["pdd-router"])
    assert router["args"][0] == "router"


class _Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.ready = True

    def Health(self, request, context):  # noqa: N802 (gRPC method name)
        return worker_pb2.HealthResponse(
            ready=self.ready, worker_id="pdd-prefill-0", role="prefill", model="m"
        )


@pytest.fixture
def worker():
    servicer = _Worker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None).wait(5)


def _healthcheck():
    spec = importlib.util.spec_from_file_location("pdd_healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_healthcheck_passes_only_when_the_worker_is_ready(worker, capsys):
    servicer, port = worker
    main = _healthcheck()
    target = f"127.0.0.1:{port}"
    assert main(["--host", "127.0.0.1", "--port", str(port)]) == 0
    assert (
        capsys.readouterr().out
        == f"pdd-healthcheck: {target}: worker pdd-prefill-0 (prefill) ready\n"
    )
    servicer.ready = False
    assert main(["--host", "127.0.0.1", "--port", str(port)]) == 1
    assert capsys.readouterr().out.endswith("(prefill) not ready\n")


def test_healthcheck_fails_when_nothing_answers(capsys):
    main = _healthcheck()
    # Port 1 (tcpmux): nothing listens there, the connection is refused at once.
    assert main(["--host", "127.0.0.1", "--port", "1", "--timeout", "2"]) == 1
    assert capsys.readouterr().out.startswith("pdd-healthcheck: 127.0.0.1:1: UNAVAILABLE")


def test_healthcheck_runs_as_the_kubelet_execs_it_with_pod_ip(worker):
    _, port = worker
    env = dict(os.environ, POD_IP="127.0.0.1", PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert (result.returncode, result.stdout) == (
        0,
        f"pdd-healthcheck: 127.0.0.1:{port}: worker pdd-prefill-0 (prefill) ready\n",
    )
