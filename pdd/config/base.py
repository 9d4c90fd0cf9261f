"""Base model for every config section: frozen, unknown keys rejected."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Typed, frozen config section. Unknown keys fail with their full key path."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
