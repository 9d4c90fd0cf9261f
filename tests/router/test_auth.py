"""API keys: the real router (uvicorn + fake worker) with ``router.api_keys_file``, the key
file's parsing and reloading, and ``pdd router`` as a process for SIGHUP and PDD_API_KEY."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdd.config import RouterConfig
from pdd.errors import ConfigError
from pdd.router.http.auth import ENV_VAR, ApiKeys, bearer_token, key_id, parse_keys
from pdd.router.text.tokenizer import TextCodec
from tests.helpers import REPO
from tests.router.conftest import wait_until
from tests.router.harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
KEY_A = "sk-pdd-test-alpha-0001"
KEY_B = "sk-pdd-test-bravo-0002"
KEY_C = "sk-pdd-test-charl-0003"  # same length as KEY_A: an in-place rewrite keeps the size
ENV_KEY = "sk-pdd-test-from-env"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(r: httpx.Response, *, missing: bool) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (
        "authentication_error", None, "invalid_api_key"
    )  # fmt: skip
    if missing:
        assert r.headers["www-authenticate"] == "Bearer"
        assert err["message"].startswith("You didn't provide an API key.")
    else:
        assert r.headers["www-authenticate"] == 'Bearer error="invalid_token"'
        assert err["message"] == "Incorrect API key provided."


# --- parsing and checking, no server ------------------------------------------------------


def test_key_file_lines_comments_and_errors(tmp_path):
    text = f"# operators\n\n{KEY_A}   # alice\n  {KEY_B}\n{KEY_A}\n"
    assert parse_keys(text, "f") == [KEY_A, KEY_B, KEY_A]
    with pytest.raises(ConfigError, match=r"^f:2: an API key cannot contain whitespace$"):
        parse_keys("ok\nsecret part two\n", "f")
    path = tmp_path / "keys"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="holds no API key"):
        ApiKeys(path)
    with pytest.raises(ConfigError, match="cannot read router.api_keys_file"):
        ApiKeys(tmp_path / "absent")


def test_check_names_the_matching_key_and_nothing_else(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n{KEY_B}\n")
    keys = ApiKeys(path, ENV_KEY)
    assert keys.key_ids == [key_id(ENV_KEY), key_id(KEY_A), key_id(KEY_B)]
    assert keys.check(KEY_B.encode()) == key_id(KEY_B) == key_id(KEY_B.encode())
    assert keys.check(ENV_KEY.encode()) == key_id(ENV_KEY)
    for wrong in (b"", KEY_A[:-1].encode(), (KEY_A + "x").encode(), KEY_A.upper().encode()):
        assert keys.check(wrong) is None
    assert len(key_id(KEY_A)) == 8


def test_authentication_is_on_only_with_a_file_or_the_env_var(tmp_path):
    assert ApiKeys.from_config(RouterConfig(), environ={}) is None
    assert ApiKeys.from_config(RouterConfig(), environ={ENV_VAR: "  "}) is None
    keys = ApiKeys.from_config(RouterConfig(), environ={ENV_VAR: ENV_KEY})
    assert keys is not None and keys.check(ENV_KEY.encode()) == key_id(ENV_KEY)
    path = tmp_path / "keys"
    path.write_text(KEY_A + "\n")
    keys = ApiKeys.from_config(RouterConfig(api_keys_file=path), environ={})
    assert keys is not None and keys.key_ids == [key_id(KEY_A)]


def test_reload_follows_the_file_and_keeps_keys_it_cannot_read(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEY_A + "\n")
    keys = ApiKeys(path)
    assert keys.reload_if_changed() is False  # same (mtime, size, inode): no read
    tmp = tmp_path / "keys.new"
    tmp.write_text(KEY_B + "\n")
    os.replace(tmp, path)  # how operators rotate atomically
    assert keys.reload_if_changed() is True
    assert (keys.check(KEY_A.encode()), keys.check(KEY_B.encode())) == (None, key_id(KEY_B))
    path.write_text("two words\n")
    assert keys.reload_if_changed() is False  # a broken file keeps the current keys
    path.unlink()
    assert keys.reload_if_changed() is False
    assert keys.check(KEY_B.encode()) == key_id(KEY_B)


@pytest.mark.parametrize(
    ("header", "token"),
    [(b"Bearer abc", b"abc"), (b"bearer  abc ", b"abc"), (b"Basic abc", None),
     (b"Bearer", None), (b"Bearer ", None), (b"abc", None)],
)  # fmt: skip
def test_bearer_token_parsing(header, token):
    assert bearer_token({"headers": [(b"authorization", header)]}) == token
    assert bearer_token({"headers": []}) is None


# --- the real router with a key file ------------------------------------------------------


class KeyedHarness(RouterHarness):
    """The harness's readiness polls read /debug/workers, which needs a key here."""

    key = KEY_A

    def workers(self):  # type: ignore[no-untyped-def]
        r = httpx.get(self.root + "/debug/workers", headers=bearer(self.key), timeout=2.0)
        return r.json()["workers"]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("auth") / "api_keys"


@pytest.fixture(scope="module")
def keyed(codec: TextCodec, keys_file: Path) -> Iterator[KeyedHarness]:
    keys_file.write_text(f"# test keys\n{KEY_A}  # alpha\n")
    h = KeyedHarness(codec, api_keys_file=str(keys_file))
    h.start()
    yield h
    h.stop()


@pytest.fixture
def authed(keyed: KeyedHarness) -> Iterator[KeyedHarness]:
    keyed.reset()
    yield keyed
    wait_until(lambda: not keyed.fake.running, "fake worker still has running requests")


def test_every_api_path_needs_a_valid_key(authed):
    url = authed.url
    assert_401(httpx.post(url + "/chat/completions", json=CHAT), missing=True)
    assert_401(httpx.get(url + "/models"), missing=True)
    assert_401(httpx.get(url + "/models", headers=bearer(KEY_B)), missing=False)
    assert_401(httpx.get(url + "/models", headers=bearer(KEY_A + "x")), missing=False)
    assert_401(httpx.get(url + "/models", headers={"Authorization": KEY_A}), missing=True)
    assert_401(httpx.get(url + "/models", headers={"Authorization": "Basic " + KEY_A}),
               missing=True)  # fmt: skip
    assert_401(httpx.get(authed.root + "/debug/config"), missing=True)
    assert_401(httpx.post(authed.root + "/tokenize", json={"prompt": "x"}), missing=True)
    assert_401(httpx.get(authed.root + "/no/such/path"), missing=True)  # deny by default
    big = b"x" * 100_000  # over max_body_bytes: still 401, the body is never read
    r = httpx.post(url + "/completions", content=big, headers={"content-type": "text/plain"})
    assert_401(r, missing=True)
    assert authed.fake.requests == []
    r = httpx.get(url + "/models", headers={"Authorization": f"bearer {KEY_A}"})
    assert r.status_code == 200


def test_open_paths_need_no_key(authed):
    assert httpx.get(authed.root + "/health").status_code == 200
    assert httpx.get(authed.root + "/openapi.json").json()["info"]["title"] == "pdd router"
    assert httpx.get(authed.root + "/metrics").status_code == 200  # metrics_require_key off


def test_openai_client_with_the_key_is_served_and_without_is_refused(authed):
    client = openai.OpenAI(base_url=authed.url, api_key=KEY_A, max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    assert out.choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == [MODEL]
    wrong = openai.OpenAI(base_url=authed.url, api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.code == "invalid_api_key"
    assert len(authed.fake.requests) == 1


def test_rotated_file_takes_effect_without_restart_and_keys_are_never_logged(
    authed, keys_file, caplog
):
    caplog.set_level(logging.INFO, logger="pdd.router.http.auth")

    def status(key: str) -> int:
        return httpx.get(authed.url + "/models", headers=bearer(key)).status_code

    tmp = keys_file.with_suffix(".new")
    tmp.write_text(f"{KEY_B}\n")
    os.replace(tmp, keys_file)
    authed.key = KEY_B
    try:
        wait_until(lambda: status(KEY_A) == 401 and status(KEY_B) == 200, "no reload", 10)
        keys_file.write_text("not a key\n")  # a broken edit: the current keys stay
        wait_until(lambda: "not reloaded" in caplog.text, "broken file not noticed", 10)
        assert (status(KEY_A), status(KEY_B)) == (401, 200)
    finally:
        keys_file.write_text(f"{KEY_A}\n")
        authed.key = KEY_A
        wait_until(lambda: status(KEY_A) == 200, "file not restored", 10)
    assert f"API keys loaded: {key_id(KEY_B)}" in caplog.text
    assert KEY_A not in caplog.text and KEY_B not in caplog.text


# --- `pdd router` as a process: SIGHUP, PDD_API_KEY, metrics_require_key -------------------


def test_sighup_reloads_keys_env_key_stays_and_metrics_can_require_a_key(tmp_path, codec):
    keys_file = tmp_path / "api_keys"
    keys_file.write_text(f"{KEY_A}\n")
    config = tmp_path / "router.yaml"
    config.write_text(
        f"router:\n  port: 0\n  health_interval_s: 0.1\n  api_keys_file: {keys_file}\n"
        "  metrics_require_key: true\nworkers: []\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", **{ENV_VAR: ENV_KEY})
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdd.router.main", "--config", str(config)], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("pdd router ready: "), proc.stderr.read()  # type: ignore[union-attr]
        url = line.strip().removeprefix("pdd router ready: ")
        root = url.removesuffix("/v1")

        def status(path: str, key: str | None = None) -> int:
            headers = bearer(key) if key else {}
            return httpx.get(root + path, headers=headers, timeout=5).status_code

        assert [status("/v1/models", k) for k in (None, KEY_A, ENV_KEY, KEY_C)] == [
            401, 200, 200, 401
        ]  # fmt: skip
        assert (status("/metrics"), status("/metrics", ENV_KEY)) == (401, 200)
        assert status("/health") == 503  # no workers, but open
        # Rewrite in place with the same size and mtime: only SIGHUP can notice.
        before = os.stat(keys_file)
        with open(keys_file, "r+") as f:
            f.write(f"{KEY_C}\n")
        os.utime(keys_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status("/v1/models", KEY_C) != 200:
            assert time.monotonic() < deadline, "SIGHUP did not reload the key file"
            time.sleep(0.02)
        assert (status("/v1/models", KEY_A), status("/v1/models", ENV_KEY)) == (401, 200)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    assert code == 0, stderr
    assert "SIGHUP: reloading API keys" in stderr
    assert f"API keys loaded: {key_id(ENV_KEY)}, {key_id(KEY_C)}" in stderr
    assert not any(k in stderr for k in (KEY_A, KEY_C, ENV_KEY))
