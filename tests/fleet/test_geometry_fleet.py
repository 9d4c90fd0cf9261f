"""KV geometry through the real router (fake gRPC workers that report a geometry in Health):
a configured MD of another model is not admitted (NOT ADMITTED in /debug/workers and `pdd
status`, never routed to); an admitted MD whose KV P cannot land (other KV heads, a tensor-
parallel shard: MD converts dtype, layout and block size on landing, not heads) is never paired with P: the request is refused (503) naming P, MD and the
field, and no worker saw a Generate."""

from __future__ import annotations

import httpx
import pytest

from pdd.kv_geometry import folder_geometry
from pdd.router.status import format_status
from tests.helpers import wait_until
from tests.router.harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def harness(codec):
    h = RouterHarness.pdd(codec)
    yield h
    h.stop()


def start(h: RouterHarness, md_change: dict) -> dict:
    """Start with P and RLD at the router model's geometry and MD changed by ``md_change``."""
    from pdd.config import ModelConfig

    own = folder_geometry(ModelConfig().resolved_path(), block_size=32, kv_dtype="float32")
    for f in h.fakes:
        f.geometry = own.model_copy(update=md_change) if f.worker_id == "md0" else own
    h._thread.start()
    assert h._ready.wait(30) and h._error is None
    h.wait_health(200)
    return own


def rows(h: RouterHarness) -> dict[str, dict]:
    data = httpx.get(h.root + "/debug/workers", timeout=2).json()
    return {w["id"]: w for w in data["workers"]}, data


def test_an_md_of_another_model_is_not_admitted(harness):
    start(harness, {"fingerprint": "0" * 32})
    wait_until(lambda: not rows(harness)[0]["md0"]["admitted"], 10, "md0 refused")
    wait_until(lambda: rows(harness)[0]["p0"]["healthy"], 10, "p0 healthy")
    workers, data = rows(harness)
    assert workers["md0"]["healthy"] is False
    assert "not admitted: workers md0 and router model" in workers["md0"]["last_error"]
    assert "fingerprint differs (md0: 0000" in workers["md0"]["last_error"]
    lines = format_status(data)
    assert any("md0" in ln and "NOT ADMITTED" in ln for ln in lines)
    assert any(ln.split()[0] == "p0" and "kv_geometry=" in ln and "healthy" in ln for ln in lines)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    r = httpx.post(harness.url + "/completions", json=body, timeout=10)
    assert r.status_code == 503
    assert all(not f.requests for f in harness.fakes)  # never routed to or from it


def test_an_md_whose_kv_p_cannot_land_is_never_paired(harness):
    start(harness, {"kv_head_end": 2})
    wait_until(lambda: all(w["healthy"] for w in rows(harness)[0].values()), 10, "all healthy")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    r = httpx.post(harness.url + "/completions", json=body, timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == (
        "no main_decode worker can take KV from p0: workers p0 and md0 cannot exchange KV: "
        "kv_head_end differs (p0: 3, md0: 2)"
    )
    assert all(not f.requests for f in harness.fakes)
