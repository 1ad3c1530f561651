"""Fixtures for the end-to-end tests: Claude Code and Codex CLI (tests/conftest.py gives ``fake``
and ``make_cg``)."""

import os
import shutil
import time

import codex_harness
import pytest
from claude_harness import InstallError, install_claude, npm_dir


def _need_npm(what: str) -> None:
    """Skip unless CG_E2E is set (``tox -e e2e`` sets it) and npm is on PATH, so the default tox
    envs, which collect tests/ too, skip these tests at once."""
    if not os.environ.get("CG_E2E"):
        pytest.skip(f"end-to-end test: set CG_E2E=1 (tox -e e2e) to run {what} through cg")
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not on PATH: cannot install {what}")


@pytest.fixture(scope="session")
def claude_bin():
    """The Claude Code CLI, installed once into a cache kept between runs (see claude_harness)."""
    _need_npm("Claude Code")
    started = time.monotonic()
    try:
        binary, version, installed_now = install_claude()
    except InstallError as e:
        pytest.fail(f"installing Claude Code into {npm_dir()} failed: {e}", pytrace=False)
    how = "installed" if installed_now else "cached"
    print(f"\nClaude Code {version} ({how} at {binary}, {time.monotonic() - started:.1f}s)")
    return binary


@pytest.fixture(scope="session")
def codex_bin():
    """The Codex CLI at the pinned version, installed once into a cache kept between runs (see
    codex_harness)."""
    _need_npm("Codex CLI")
    started = time.monotonic()
    try:
        binary, version, installed_now = codex_harness.install_codex()
    except InstallError as e:
        pytest.fail(f"installing Codex CLI into {codex_harness.npm_dir()} failed: {e}", pytrace=False)
    how = "installed" if installed_now else "cached"
    print(f"\nCodex CLI {version} ({how} at {binary}, {time.monotonic() - started:.1f}s)")
    return binary


@pytest.fixture
def claude_home(tmp_path):
    """A fresh HOME for one run (settings, sessions and caches land here, not in the real HOME)."""
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture
def codex_home(tmp_path):
    """A fresh HOME for one Codex run; its CODEX_HOME (config.toml, sessions) is ``home/.codex``."""
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    return home


@pytest.fixture
def workdir(tmp_path):
    """An empty project directory for the CLI to run in (its shell tool's cwd)."""
    work = tmp_path / "project"
    work.mkdir()
    return work
