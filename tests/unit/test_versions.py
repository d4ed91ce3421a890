"""Each distribution's version is written once: in its package's ``__version__``."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import requires, version

from packaging.requirements import Requirement

import watchdogd
import watchdogd_client

from ..conftest import REPO


def test_the_daemon_requires_a_client_of_the_version_beside_it() -> None:
    pin = next(
        Requirement(line)
        for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
        if line.startswith("watchdogd-client")
    )
    assert pin.specifier.contains(watchdogd_client.__version__), (pin, watchdogd_client.__version__)


def test_no_version_is_written_twice() -> None:
    for pyproject in (REPO / "pyproject.toml", REPO / "client" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        assert "version" not in project and "version" in project["dynamic"], pyproject
    for written in (watchdogd.__version__, watchdogd_client.__version__):
        assert re.fullmatch(r"\d+\.\d+\.\d+", written)


def test_the_installed_metadata_is_the_packages_version() -> None:
    assert version("watchdogd") == watchdogd.__version__
    assert version("watchdogd-client") == watchdogd_client.__version__
    assert any(r.startswith("watchdogd-client") for r in requires("watchdogd") or [])
