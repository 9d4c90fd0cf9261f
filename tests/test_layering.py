"""The layering of docs/architecture.md, enforced: the import-linter contracts in
pyproject.toml (`[tool.importlinter]`) must all be kept. `lint-imports` from the repository
root prints the same report."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
from importlinter import cli as lint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def loggers_left_enabled():
    """import-linter configures logging with dictConfig, which disables every logger that
    exists at that moment: put them back, so later tests still see their log records."""
    existing = logging.root.manager.loggerDict
    before = {n: lg.disabled for n, lg in existing.items() if isinstance(lg, logging.Logger)}
    yield
    for name, disabled in before.items():
        existing[name].disabled = disabled


def test_every_layering_contract_is_kept(capsys: pytest.CaptureFixture[str]) -> None:
    code = lint.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    report = capsys.readouterr().out
    assert code == 0, report
    assert "0 broken" in report


def test_a_broken_contract_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The check is live: a contract the code breaks (the router imports pdd.protocol) fails."""
    config = tmp_path / "broken.toml"
    config.write_text(
        textwrap.dedent(
            """
            [tool.importlinter]
            root_package = "pdd"

            [[tool.importlinter.contracts]]
            name = "router without protocol"
            type = "forbidden"
            source_modules = ["pdd.router"]
            forbidden_modules = ["pdd.protocol"]
            """
        )
    )
    code = lint.lint_imports(config_filename=str(config), no_cache=True)
    report = capsys.readouterr().out
    assert code == 1
    assert "BROKEN" in report
