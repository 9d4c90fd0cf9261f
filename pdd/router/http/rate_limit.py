"""Limits per API key: requests and tokens per minute (``rpm=`` / ``tpm=`` in the key file,
``pdd.router.http.tenants``). Over a limit: 429 in OpenAI's shape with ``Retry-After`` (the seconds
until the window has room); other keys are unaffected.

A request is charged at admission, before routing: one request, and its prompt tokens plus
its ``max_tokens`` (the most it can use: OpenAI's rate limiter counts the same). The window
slides over the last ``WINDOW_S`` seconds. Only keys with a limit are tracked; each key's
history holds at most what it was admitted in one window. Runs on the event loop only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from starlette.types import Scope

from pdd.errors import RateLimitedError
from pdd.router.http.tenants import grant_of

WINDOW_S = 60.0


class KeyLimiter:
    """Sliding one-minute windows of (admitted at, tokens) per API key id."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._seen: dict[str, deque[tuple[float, int]]] = {}

    def admit(self, scope: Scope, tokens: int) -> None:
        """Charge one request of ``tokens`` to the request's key, or raise RateLimitedError."""
        grant = grant_of(scope)
        if grant.rpm is None and grant.tpm is None:
            return
        key = scope.get("state", {}).get("api_key_id", "")
        now = self._clock()
        seen = self._seen.setdefault(key, deque())
        while seen and seen[0][0] <= now - self.window_s:
            seen.popleft()
        if grant.rpm is not None and len(seen) >= grant.rpm:
            wait = seen[len(seen) - grant.rpm][0] + self.window_s - now
            raise RateLimitedError(
                f"Rate limit reached for this API key: {grant.rpm} requests per minute. "
                f"Try again in {wait:.1f} s.",
                wait,
            )
        if grant.tpm is not None:
            self._check_tokens(seen, grant.tpm, tokens, now)
        seen.append((now, tokens))

    def _check_tokens(
        self, seen: deque[tuple[float, int]], tpm: int, tokens: int, now: float
    ) -> None:
        if tokens > tpm:
            raise RateLimitedError(
                f"This request needs {tokens} tokens (prompt + max_tokens), more than this "
                f"API key's {tpm} tokens per minute; lower max_tokens.",
                self.window_s,
            )
        used = sum(n for _, n in seen)
        if used + tokens <= tpm:
            return
        freed, wait = 0, self.window_s
        for at, n in seen:  # the window has room once enough of the oldest charges expire
            freed += n
            if used - freed + tokens <= tpm:
                wait = at + self.window_s - now
                break
        raise RateLimitedError(
            f"Rate limit reached for this API key: {tpm} tokens per minute (prompt + "
            f"max_tokens), {used} used. Try again in {wait:.1f} s.",
            wait,
        )
