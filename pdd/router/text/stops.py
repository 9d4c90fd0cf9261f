"""Stop strings on streamed text, with hold-back of a possible partial match.

Text arrives in pieces. A piece may end with the first characters of a stop string ("ST" of
"STOP"); that suffix is held back until the next piece shows whether the stop string
completes. So the stream never shows text that later turns out to be part of a stop string:

    stops=["STOP"]   feed("abc ST") -> "abc "  (holds "ST")
                     feed("OP x")   -> ""      stopped; "STOP" and everything after is dropped

The match that wins is the one that completes first in the text (ties: the one that starts
first), so the result does not depend on how the text was cut into pieces. One instance per
request; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopStep:
    """Result of one ``feed``: text safe to emit, and whether a stop string matched."""

    text: str
    stopped: bool = False
    stop: str | None = None


class StopStringMatcher:
    """Finds the first stop string in streamed text. Empty stop strings are not allowed."""

    def __init__(self, stops: Sequence[str], *, include_in_output: bool = False):
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._include = include_in_output
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> StopStep:
        """Add text; return what may be emitted now. After a stop, feeding is an error."""
        if self._stopped:
            raise RuntimeError("feed() after a stop string matched")
        buf = self._held + text
        self._held = ""
        if not self._stops:
            return StopStep(buf)
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._stopped = True
            end = start + len(stop) if self._include else start
            return StopStep(buf[:end], stopped=True, stop=stop)
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return StopStep(buf[: len(buf) - keep])

    def flush(self) -> str:
        """Generation ended without a stop: release held text (it never completed a stop)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            cand = (start + len(stop), start, stop)
            if best is None or cand[:2] < best[:2]:
                best = cand
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
