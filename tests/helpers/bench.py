"""A bench/ script loaded as a module, for the tests of its pure parts (bench/ is not a package)."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent.parent


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py, loaded under NAME."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
