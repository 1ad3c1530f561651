"""The installed package, as a user gets it: `twistd cg --help` from outside the checkout."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from twisted.python import usage

from cg.web.tap import Options

TWISTD = str(Path(sys.executable).with_name("twistd"))


def test_twistd_lists_and_documents_cg(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = subprocess.run([TWISTD, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert any(line.split()[:1] == ["cg"] for line in listed.stdout.splitlines()), listed.stdout
    helped = subprocess.run([TWISTD, "cg", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    for option in (
        "--listen",
        "--anthropic-upstream",
        "--openai-upstream",
        "--max-body",
        "--upstream-ca",
        "--connect-timeout",
        "--header-timeout",
        "--drain-timeout",
    ):
        assert option in helped.stdout


def test_bad_options_are_usage_errors():
    for argv in (["--max-expand-rounds", "-1"], ["--max-held", "lots"], ["--max-body", "2X"],
                 ["--tenant", "everyone"], ["--expand", "maybe"], ["--cold-policy", "maybe"], ["--disable", "nothing"],
                 ["--anthropic-upstream", "api.anthropic.com"], ["--openai-upstream", "https://api.openai.com?x"]):
        with pytest.raises(usage.UsageError):
            Options().parseOptions(argv)
    assert Options().parseOptions([]) is None


def test_nothing_reads_a_path_outside_the_checkout():
    """A user's clone has nothing beside it: fixtures live in tests/fixtures/, not in a folder beside it."""
    root = Path(__file__).resolve().parents[1]
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for top in ("cg", "tests", "bench", "twisted")
        for path in sorted((root / top).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ('../' + 'shared') in line or ('parents[' + '2]') in line
    ]
    assert not offenders, offenders


def test_every_package_of_cg_is_shipped():
    """setup.cfg lists cg's packages by hand (find: would drop twisted.plugins): none may be missing."""
    import configparser

    root = Path(__file__).resolve().parents[1]
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    on_disk = {".".join(init.parent.relative_to(root).parts) for init in (root / "cg").rglob("__init__.py")}
    assert on_disk <= listed, sorted(on_disk - listed)


def test_tests_readme_names_every_test_file():
    """tests/README.md says which layer each test file covers: a new file must be placed there."""
    tests = Path(__file__).resolve().parent
    readme = (tests / "README.md").read_text()
    names = [path.relative_to(tests).as_posix() for path in sorted(tests.rglob("test_*.py"))]
    unnamed = [name for name in names if f"| {name} |" not in readme]
    assert not unnamed, unnamed
