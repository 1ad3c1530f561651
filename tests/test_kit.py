"""The test kit's own rules: a test module imports no other, and cg.testing's map is complete.

A helper two test files share lives in tests/helpers/ (plumbing for cg's own tests), in
tests/conftest.py (fixtures) or in cg.testing (what a library user would want too): a test module
that imports another runs that module's import-time code and hides where its helpers are.
"""

import ast
import importlib
from pathlib import Path

import pytest

import cg.testing

TESTS = Path(__file__).parent
TEST_MODULES = {path.stem for path in TESTS.rglob("test_*.py")}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, at any depth (in functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: each name may be a module (from . import test_proxy)
                found += [(node.lineno, f"{node.module}.{alias.name}" if node.module else alias.name)
                          for alias in node.names]
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def test_no_test_module_imports_another():
    offences = [
        f"{path.relative_to(TESTS)}:{line}: imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imported_modules(path)
        if TEST_MODULES & set(module.split("."))
    ]
    assert offences == [], "move the shared helper to tests/helpers/, tests/conftest.py or cg.testing"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("def f():\n    from test_proxy import helper\n    import test_store as s\n")
    assert imported_modules(path) == [(2, "test_proxy"), (3, "test_store")]


def test_the_check_sees_relative_and_package_imports(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text("from . import test_proxy\nfrom tests.test_store import closing\n")
    found = imported_modules(path)
    assert found == [(1, "test_proxy"), (2, "tests.test_store")]
    assert all(TEST_MODULES & set(module.split(".")) for _, module in found)


@pytest.mark.parametrize("module", ["builders", "replies", "validators", "fake", "memory"])
def test_cg_testing_exports_every_public_name_of_its_modules(module):
    """``from cg.testing import X`` works for whatever the kit's modules define."""
    mod = importlib.import_module(f"cg.testing.{module}")
    tree = ast.parse(Path(mod.__file__).read_text())
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(target.id for target in node.targets if isinstance(target, ast.Name))
    public = {name for name in defined if not name.startswith("_")}
    assert public - set(cg.testing.__all__) == set()
    assert all(getattr(cg.testing, name) is getattr(mod, name) for name in public)
