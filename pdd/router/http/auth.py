"""API-key authentication: which requests the router serves at all.

Keys come from ``router.api_keys_file`` (one key per line, optionally with its tenant, admin
flag and limits: ``pdd.router.http.tenants``; ``#`` starts a comment) and from the
``PDD_API_KEY`` environment variable; with neither, authentication is off (local use). When on,
every request needs ``Authorization: Bearer KEY`` except the open paths (/health for probes,
/openapi.json, and /metrics unless ``router.metrics_require_key``); anything else, unknown
paths included, answers 401 in OpenAI's error shape with ``WWW-Authenticate: Bearer``. An
accepted key that is not an admin key gets 403 on ``/debug/*``.

Only sha256 digests of the keys are kept. A presented key is hashed and compared with every
digest by ``hmac.compare_digest`` without stopping at a match: fixed-length inputs, one pass
over all keys, so timing tells neither a key nor which key matched. Logs name a key by its
``key_id`` (the first 8 hex digits of its sha256), never by the key itself.

Lifecycle: ``ApiKeys.from_config`` loads at build time (a missing, unreadable or keyless file
fails the start with ConfigError). ``KeyReloader`` (started and stopped by the app lifespan)
re-reads the file when its (mtime, size, inode) changes, checked every ``CHECK_INTERVAL_S`` in a
thread, and at once on SIGHUP when the router runs in the main thread. A file that cannot be
read at reload keeps the previous keys; a file with no keys revokes every file key.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from pdd.config import RouterConfig
from pdd.errors import AuthenticationError, ConfigError
from pdd.router.http.errors import error_response
from pdd.router.http.tenants import KeyGrant, admin_only, denied, parse_key_entries

log = logging.getLogger(__name__)

ENV_VAR = "PDD_API_KEY"
CHECK_INTERVAL_S = 1.0
OPEN_PATHS = frozenset({"/health", "/openapi.json"})

_Entry = tuple[bytes, str, KeyGrant]  # (sha256 digest of the key, key_id, what it may do)
_Stamp = tuple[int, int, int]  # (mtime_ns, size, inode)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def key_id(key: str | bytes) -> str:
    """A short, loggable name for a key: the first 8 hex digits of its sha256."""
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()[:8]


def parse_keys(text: str, source: str) -> list[str]:
    """Keys from a key file's text. Raises ConfigError (naming the line, never the key)."""
    return [key for key, _ in parse_key_entries(text, source)]


class ApiKeys:
    """The accepted keys. ``check`` runs on the event loop; ``reload*`` in a thread (file I/O).

    A reload swaps one tuple, so a concurrent ``check`` sees the old or the new keys, never a mix.
    """

    def __init__(self, path: Path | None, env_key: str | None = None):
        self.path = path
        self._env: tuple[_Entry, ...] = ()
        if env_key:
            self._env = ((_digest(env_key.encode()), key_id(env_key), KeyGrant()),)
        self._file: tuple[_Entry, ...] = ()
        self._stamp: _Stamp | None = None
        if path is not None:
            self._load(path)
            if not self._file and not self._env:
                raise ConfigError(f"router.api_keys_file {path} holds no API key")

    @classmethod
    def from_config(
        cls, router: RouterConfig, environ: Mapping[str, str] | None = None
    ) -> ApiKeys | None:
        """The keys the config and environment name; None when authentication is off."""
        env_key = (os.environ if environ is None else environ).get(ENV_VAR, "").strip() or None
        if router.api_keys_file is None and env_key is None:
            return None
        return cls(router.api_keys_file, env_key)

    @property
    def key_ids(self) -> list[str]:
        return [kid for _, kid, _ in self._env + self._file]

    def check(self, presented: bytes) -> str | None:
        """The key_id of the accepted key equal to ``presented``, else None (constant time)."""
        found = self.lookup(presented)
        return None if found is None else found[0]

    def lookup(self, presented: bytes) -> tuple[str, KeyGrant] | None:
        """(key_id, grant) of the accepted key equal to ``presented`` (constant time)."""
        digest = _digest(presented)
        found = None
        for entry_digest, kid, grant in self._env + self._file:
            if hmac.compare_digest(digest, entry_digest):
                found = (kid, grant)
        return found

    def reload_if_changed(self) -> bool:
        """Re-read the file if its stamp changed. Blocking (file I/O): call from a thread."""
        if self.path is None:
            return False
        try:
            changed = _stamp(self.path) != self._stamp
        except OSError as exc:
            log.warning("API key file %s: %s; keeping the current keys", self.path, exc)
            return False
        return self.reload() if changed else False

    def reload(self) -> bool:
        """Re-read the file now; on failure keep the current keys. Blocking: call from a thread."""
        if self.path is None:
            return False
        try:
            self._load(self.path)
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            message = exc.message if isinstance(exc, ConfigError) else str(exc)
            log.warning("API key file %s not reloaded: %s", self.path, message)
            return False
        if not self._file:
            accepted = f"only {ENV_VAR} is accepted" if self._env else "every request gets 401"
            log.warning("API key file %s holds no key: %s", self.path, accepted)
        return True

    def _load(self, path: Path) -> None:
        try:
            stamp = _stamp(path)
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read router.api_keys_file {path}: {exc}") from exc
        entries = dict(parse_key_entries(text, str(path)))  # a repeated key: its last line
        self._file = tuple((_digest(k.encode()), key_id(k), g) for k, g in entries.items())
        self._stamp = stamp
        log.info("API keys loaded: %s", ", ".join(self.key_ids) or "none")


def _stamp(path: Path) -> _Stamp:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class KeyReloader:
    """Owns the task that re-reads the key file (on change and on SIGHUP). start/stop once."""

    def __init__(self, keys: ApiKeys, interval_s: float = CHECK_INTERVAL_S):
        self._keys = keys
        self._interval = interval_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sighup = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="api-key-reloader")
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._wake.set)
            self._sighup = True
        except (ValueError, RuntimeError, NotImplementedError):
            log.info("SIGHUP key reload unavailable (not the main thread); file checks only")

    async def stop(self) -> None:
        if self._sighup:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval)
            except TimeoutError:
                await asyncio.to_thread(self._keys.reload_if_changed)
                continue
            self._wake.clear()
            log.info("SIGHUP: reloading API keys from %s", self._keys.path)
            await asyncio.to_thread(self._keys.reload)


class ApiKeyMiddleware:
    """Pure ASGI: refuses a request without an accepted key before anything reads its body.

    Sets ``scope["state"]["api_key_id"]`` (for request logs) and ``["api_key_grant"]`` (tenant,
    admin, limits: ``pdd.router.http.tenants``) for accepted requests.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics_require_key: bool = False):
        self.app = app
        self.keys = keys
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        found = None if token is None else self.keys.lookup(token)
        if found is None:
            await _refuse(scope, receive, send, missing=token is None)
            return
        kid, grant = found
        if admin_only(scope["path"]) and not grant.admin:
            log.debug("403 %s %s: key %s is not an admin key", scope.get("method"),
                      scope["path"], kid)  # fmt: skip
            await error_response(denied(scope["path"]))(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["api_key_id"], state["api_key_grant"] = kid, grant
        await self.app(scope, receive, send)


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the first ``Authorization: Bearer TOKEN`` header (scheme case-insensitive)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


async def _refuse(scope: Scope, receive: Receive, send: Send, *, missing: bool) -> None:
    if missing:
        err = AuthenticationError(
            "You didn't provide an API key. Send it in an Authorization header using Bearer "
            "auth (Authorization: Bearer YOUR_KEY)."
        )
        challenge = "Bearer"
    else:
        err = AuthenticationError("Incorrect API key provided.")
        challenge = 'Bearer error="invalid_token"'
    log.debug("401 %s %s: %s key", scope.get("method"), scope["path"], "no" if missing else "bad")
    response = error_response(err)
    response.headers["WWW-Authenticate"] = challenge
    await response(scope, receive, send)
