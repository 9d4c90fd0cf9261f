"""The router's replica of every MainDecode's DRC contents (one PrefixIndexView each).

``DrcViews`` owns the views. The pool's health loop calls ``refresh(md_id, client)`` after
each good poll of a MainDecode worker: DrcEvents(since=seq) applies the events after the
view's sequence number; a view that is stale (never synced, a gap, another epoch) asks for a
snapshot (since=-1) instead, at once. A worker that cannot answer (an error, a body that does
not parse) leaves the view as it was and is retried on the next poll; it never affects the
worker's health.

``cached_tokens(prompt)`` answers, per MD, the prompt tokens its DRC holds (whole blocks of
the prefix). Block names are pdd.cache.hashing chains salted with
``model_salt(model.name, model.dtype, block_size, cache_salt)`` (the MD side must salt the same
way; ``cache_salt`` is the request's tenant namespace, pdd.router.http.tenants).
Hashing a prompt costs ~1 us per block (pdd.cache.hashing), done once per request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError

from pdd.cache.hashing import BlockHash, block_hashes, model_salt
from pdd.cache.messages import DrcEventBatch, DrcSnapshot
from pdd.cache.view import PrefixIndexView
from pdd.config import ModelConfig
from pdd.errors import PddError
from pdd.router.fleet.workers import WorkerClient

log = logging.getLogger(__name__)


class DrcViews:
    """One PrefixIndexView per MainDecode id. Used from the router's event loop only."""

    def __init__(self, md_ids: Sequence[str], model: ModelConfig):
        self._views = {md: PrefixIndexView() for md in md_ids}
        self._model = model
        self._failing: set[str] = set()

    def view(self, md_id: str) -> PrefixIndexView:
        return self._views[md_id]

    def add(self, md_id: str) -> None:
        """A MainDecode joined the fleet (registration, discovery): an empty, stale view."""
        self._views.setdefault(md_id, PrefixIndexView())

    def remove(self, md_id: str) -> None:
        """A MainDecode left the fleet: forget its view."""
        self._views.pop(md_id, None)
        self._failing.discard(md_id)

    async def refresh(self, md_id: str, client: WorkerClient) -> None:
        """Bring one view up to date (events, or a snapshot when stale or on a gap)."""
        view = self._views.get(md_id)
        if view is None:  # removed while its poll was in flight
            return
        try:
            if not view.stale and await self._apply_events(view, client):
                self._ok(md_id)
                return
            resp = await client.drc_events(-1)
            view.apply_snapshot(DrcSnapshot.model_validate_json(resp.json))
        except (PddError, ValidationError, ValueError) as exc:
            self._failed(md_id, exc)
            return
        self._ok(md_id)

    async def _apply_events(self, view: PrefixIndexView, client: WorkerClient) -> bool:
        """Apply the events after the view's seq; False: the view needs a snapshot."""
        resp = await client.drc_events(view.seq)
        if resp.snapshot:
            view.apply_snapshot(DrcSnapshot.model_validate_json(resp.json))
            return True
        return view.apply_events(DrcEventBatch.model_validate_json(resp.json))

    def cached_tokens(
        self, prompt_token_ids: Sequence[int], cache_salt: str = ""
    ) -> dict[str, int]:
        """Per MD, prompt tokens its DRC holds under ``cache_salt`` (0 for a view never
        synced)."""
        hashes: dict[int, list[BlockHash]] = {}
        out: dict[str, int] = {}
        for md_id, view in self._views.items():
            size = view.block_size
            if size <= 0 or len(view) == 0:
                out[md_id] = 0
                continue
            if size not in hashes:
                salt = model_salt(self._model.name, self._model.dtype, size, cache_salt)
                hashes[size] = block_hashes(prompt_token_ids, size, salt)
            out[md_id] = view.cached_tokens(hashes[size])
        return out

    def describe(self, md_id: str) -> dict[str, object]:
        view = self._views[md_id]
        return {"blocks": len(view), "seq": view.seq, "stale": view.stale}

    def _ok(self, md_id: str) -> None:
        if md_id in self._failing:
            self._failing.discard(md_id)
            log.info("DRC view of %s is in sync again", md_id)

    def _failed(self, md_id: str, exc: Exception) -> None:
        if md_id not in self._failing:
            self._failing.add(md_id)
            log.warning("DRC view of %s not refreshed: %s", md_id, exc)
