"""Lint, format and type checks run with the tests, so CI enforces them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


# The sizes people do not regret (docs/architecture.md): a module does one job, a
# class is not the house.
MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 30
_SOURCES = [REPO / "watchdogd", REPO / "client" / "watchdogd_client"]


def _modules() -> list[Path]:
    return sorted(path for root in _SOURCES for path in root.rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for path in _modules()
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_class_has_over_30_methods() -> None:
    large = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(
                    isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in node.body
                )
                if methods > MAX_CLASS_METHODS:
                    large[f"{path.relative_to(REPO)}:{node.name}"] = methods
    assert large == {}
