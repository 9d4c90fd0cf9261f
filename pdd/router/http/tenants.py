"""What an accepted API key may do: its tenant, whether it is an admin key, its limits.

Key file lines (``router.api_keys_file``; ``#`` starts a comment):

    sk-abc...                                   a key alone: admin of tenant ``default``
    sk-def...  tenant=acme                      a client key of tenant acme (not admin)
    sk-ghi...  tenant=acme rpm=60 tpm=40000     with limits per minute (pdd.router.http.rate_limit)
    sk-jkl...  tenant=ops admin                 an admin key
    sk-mno...  tenant=beta cache=docs           tenant beta, sharing the prefix cache "docs"

A key alone keeps the meaning it had before tenants (it could do everything): admin, tenant
``default``. So does ``$PDD_API_KEY`` (the operator's key). Admin keys alone reach ``/debug/*``
and the ``pdd`` routing overrides in request bodies; other keys get 403 in OpenAI's error
shape. With authentication off (no keys at all: local use) every request counts as admin.

Prefix caches are namespaced by tenant: every request carries its tenant's ``cache_salt`` to
P's, RLD's and MD's vLLM prefix caches (vLLM's own ``cache_salt``), MD's DRC block hashes and
the router's views of both, so one tenant's blocks are never a hit for another and
``md_cached_tokens`` / cached-token usage only ever count the caller's own. Tenants that share
a corpus opt in with the same ``cache=NAME``. Tenant ``default`` keeps the unsalted namespace
(single-tenant fleets and local use are unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Scope

from pdd.errors import ConfigError, PermissionDeniedError

DEFAULT_TENANT = "default"
ADMIN_PATH_PREFIXES = ("/debug",)


@dataclass(frozen=True)
class KeyGrant:
    """What one key may do. ``rpm``/``tpm``: requests / tokens per minute (None: unlimited)."""

    tenant: str = DEFAULT_TENANT
    admin: bool = True
    rpm: int | None = None
    tpm: int | None = None
    cache: str | None = None  # a shared prefix-cache namespace (None: the tenant's own)

    @property
    def cache_salt(self) -> str:
        """The prefix-cache namespace of this key's requests ("": the unsalted one)."""
        if self.cache is not None:
            return f"cache:{self.cache}"
        return "" if self.tenant == DEFAULT_TENANT else f"tenant:{self.tenant}"


OPEN = KeyGrant()  # authentication off: local use, everything allowed


def parse_grant(words: list[str], where: str) -> KeyGrant:
    """The grant of a key line's words after the key. Raises ConfigError naming ``where``."""
    if not words:
        return KeyGrant()
    fields: dict[str, object] = {"admin": False}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq and name == "admin":
            fields["admin"] = True
        elif not eq:
            raise ConfigError(f"{where}: an API key cannot contain whitespace")
        elif name in ("tenant", "cache") and _is_name(value):
            fields[name] = value
        elif name in ("rpm", "tpm") and value.isdigit() and int(value) > 0:
            fields[name] = int(value)
        else:
            raise ConfigError(
                f"{where}: bad key attribute {name!r} (tenant=NAME, admin, rpm=N, tpm=N, "
                "cache=NAME)"
            )
    return KeyGrant(**fields)  # type: ignore[arg-type]


def _is_name(value: str) -> bool:
    return bool(value) and value.replace("-", "").replace("_", "").isalnum()


def parse_key_entries(text: str, source: str) -> list[tuple[str, KeyGrant]]:
    """(key, grant) of every key line. Raises ConfigError (naming the line, never the key)."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if words:
            entries.append((words[0], parse_grant(words[1:], f"{source}:{number}")))
    return entries


def grant_of(scope: Scope) -> KeyGrant:
    """The grant of the request's key (set by ApiKeyMiddleware); OPEN without authentication."""
    return scope.get("state", {}).get("api_key_grant", OPEN)


def admin_only(path: str) -> bool:
    return path.startswith(ADMIN_PATH_PREFIXES)


def denied(what: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"{what} needs an admin API key; this key is not one.")


CLIENT_HINTS = frozenset({"one_off"})  # "pdd" fields any key may set: they only save work


def check_overrides(options: object | None, scope: Scope) -> None:
    """The ``pdd`` routing overrides of a request body need an admin key (PermissionDenied);
    its hints (``CLIENT_HINTS``) do not."""
    if options is None or grant_of(scope).admin:
        return
    if any(v is not None for k, v in vars(options).items() if k not in CLIENT_HINTS):
        raise denied('The "pdd" routing overrides')
