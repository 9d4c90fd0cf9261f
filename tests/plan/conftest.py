from __future__ import annotations

from pathlib import Path

import pytest

from pdd.plan.profile import ChipProfile, load_profiles

ROOT = Path(__file__).resolve().parents[2]
PROFILES = [ROOT / "configs/profiles/chip-a.yaml", ROOT / "configs/profiles/chip-b.yaml"]


@pytest.fixture(scope="session")
def profiles() -> dict[str, ChipProfile]:
    return load_profiles(PROFILES)
