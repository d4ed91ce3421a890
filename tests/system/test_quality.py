"""Lint, format and type checks run with the tests, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..conftest import REPO


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        [sys.executable, "-m", "mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
@pytest.mark.timeout(300)
def test_clean(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
