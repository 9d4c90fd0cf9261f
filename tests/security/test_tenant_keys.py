"""API keys with tenants, admin flags and limits: the key file's grammar, the per-key limiter
on a fake clock, and the real router (uvicorn + fake worker): a non-admin key gets 403 on
/debug/* and on the `pdd` routing overrides, a key over its limit gets 429 with Retry-After
while another key is served."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdd.errors import ConfigError, RateLimitedError
from pdd.router.http.auth import ApiKeys, parse_keys
from pdd.router.http.rate_limit import KeyLimiter
from pdd.router.http.tenants import KeyGrant, parse_key_entries
from tests.router.conftest import codec  # noqa: F401  (the session fixture)
from tests.router.harness import RouterHarness

pytestmark = pytest.mark.timeout(60)
MODEL = "SmolLM2-135M-Instruct"
ADMIN = "sk-pdd-test-admin-0001"
CLIENT = "sk-pdd-test-acme-0002"
OTHER = "sk-pdd-test-beta-0003"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_key_lines_carry_tenant_admin_and_limits():
    text = f"{ADMIN}\n{CLIENT} tenant=acme rpm=2 # acme's app\n{OTHER} tenant=beta tpm=900 admin\n"
    assert parse_key_entries(text, "f") == [
        (ADMIN, KeyGrant("default", True)),  # a key alone: as before tenants, admin
        (CLIENT, KeyGrant("acme", False, rpm=2)),
        (OTHER, KeyGrant("beta", True, tpm=900)),
    ]
    assert parse_keys(text, "f") == [ADMIN, CLIENT, OTHER]
    for bad, why in [("k tenant=", "tenant"), ("k rpm=0", "rpm"), ("k color=red", "color"),
                     ("k tenant=a/b", "tenant")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"^f:1: bad key attribute '{why}'"):
            parse_key_entries(bad, "f")


def test_lookup_gives_the_grant_and_env_keys_are_admin(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{CLIENT} tenant=acme\n")
    keys = ApiKeys(path, env_key=ADMIN)
    assert keys.lookup(CLIENT.encode())[1] == KeyGrant("acme", False)
    assert keys.lookup(ADMIN.encode())[1].admin
    assert keys.lookup(b"sk-nobody") is None


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scope(kid: str, **grant) -> dict:
    return {"state": {"api_key_id": kid, "api_key_grant": KeyGrant("t", False, **grant)}}


def test_requests_per_minute_per_key():
    clock = Clock()
    limiter = KeyLimiter(clock=clock)
    a, b = _scope("a", rpm=2), _scope("b", rpm=2)
    limiter.admit(a, 10)
    clock.now += 20
    limiter.admit(a, 10)
    clock.now += 10
    with pytest.raises(RateLimitedError) as err:
        limiter.admit(a, 10)
    assert err.value.status_code == 429 and err.value.retry_after_s == pytest.approx(30)
    limiter.admit(b, 10)  # another key: unaffected
    clock.now += 30.01  # the first request left the window
    limiter.admit(a, 10)
    limiter.admit({"state": {}}, 10**9)  # no grant (authentication off): never limited


def test_tokens_per_minute_per_key():
    clock = Clock()
    limiter = KeyLimiter(clock=clock)
    a = _scope("a", tpm=100)
    limiter.admit(a, 60)
    clock.now += 15
    limiter.admit(a, 30)
    with pytest.raises(RateLimitedError) as err:
        limiter.admit(a, 20)  # 110 > 100: room once the first 60 expire, in 45 s
    assert err.value.retry_after_s == pytest.approx(45)
    limiter.admit(a, 10)  # 100 fits
    with pytest.raises(RateLimitedError, match="more than this API key's 100 tokens"):
        limiter.admit(a, 101)


class AdminHarness(RouterHarness):
    """The harness's readiness polls read /debug/workers: an admin key's."""

    def workers(self):  # type: ignore[no-untyped-def]
        r = httpx.get(self.root + "/debug/workers", headers=bearer(ADMIN), timeout=2.0)
        return r.json()["workers"]


@pytest.fixture(scope="module")
def served(codec, tmp_path_factory) -> Iterator[AdminHarness]:  # noqa: F811
    keys = tmp_path_factory.mktemp("tenants") / "api_keys"
    keys.write_text(f"{ADMIN}\n{CLIENT} tenant=acme rpm=3\n{OTHER} tenant=beta\n")
    h = AdminHarness(codec, api_keys_file=str(keys))
    h.start()
    yield h
    h.stop()


def _assert_error(r: httpx.Response, status: int, error_type: str, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (error_type, code)
    return err


def test_debug_needs_an_admin_key(served):
    for path in ("/debug/workers", "/debug/config", "/debug/requests", "/debug/requests/x"):
        r = httpx.get(served.root + path, headers=bearer(OTHER), timeout=5)
        err = _assert_error(r, 403, "permission_error", "permission_denied")
        assert "admin API key" in err["message"]
    assert httpx.get(served.root + "/debug/config", headers=bearer(ADMIN), timeout=5).is_success


def test_routing_overrides_need_an_admin_key(served):
    body = {**BODY, "pdd": {"pipeline": "p_md"}}
    r = httpx.post(served.url + "/completions", json=body, headers=bearer(OTHER), timeout=30)
    _assert_error(r, 403, "permission_error", "permission_denied")
    plain = httpx.post(served.url + "/completions", json=BODY, headers=bearer(OTHER), timeout=30)
    assert plain.status_code == 200, plain.text
    hint = {**BODY, "pdd": {"one_off": True}}  # a hint that only saves work: any key's
    r = httpx.post(served.url + "/completions", json=hint, headers=bearer(OTHER), timeout=30)
    assert r.status_code == 200, r.text
    both = {**BODY, "pdd": {"one_off": True, "pipeline": "p_md"}}
    r = httpx.post(served.url + "/completions", json=both, headers=bearer(OTHER), timeout=30)
    _assert_error(r, 403, "permission_error", "permission_denied")
    admin = httpx.post(served.url + "/completions", json={**BODY, "pdd": {}}, headers=bearer(ADMIN),
                       timeout=30)  # fmt: skip
    assert admin.status_code == 200, admin.text


def test_a_key_over_its_limit_gets_429_and_others_are_served(served):
    for _ in range(3):
        r = httpx.post(served.url + "/completions", json=BODY, headers=bearer(CLIENT), timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(served.url + "/completions", json=BODY, headers=bearer(CLIENT), timeout=30)
    err = _assert_error(r, 429, "rate_limit_error", "rate_limit_exceeded")
    assert "3 requests per minute" in err["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 60
    other = httpx.post(served.url + "/completions", json=BODY, headers=bearer(OTHER), timeout=30)
    assert other.status_code == 200, other.text


def test_each_tenant_has_its_own_prefix_cache_namespace_unless_it_shares_one():
    text = f"{ADMIN}\n{CLIENT} tenant=acme\n{OTHER} tenant=beta cache=docs\nk tenant=g cache=docs"
    salts = [grant.cache_salt for _, grant in parse_key_entries(text, "f")]
    assert salts == ["", "tenant:acme", "cache:docs", "cache:docs"]  # default: unsalted
    with pytest.raises(ConfigError, match="^f:1: bad key attribute 'cache'"):
        parse_key_entries("k cache=a/b", "f")


def test_every_worker_call_carries_the_callers_cache_salt(served):
    for key, salt in ((OTHER, "tenant:beta"), (ADMIN, "")):
        served.fake.requests.clear()
        r = httpx.post(served.url + "/completions", json=BODY, headers=bearer(key), timeout=10)
        assert r.status_code == 200, r.text
        assert [g.cache_salt for g in served.fake.requests] == [salt]
