"""The repository's scripts (benchmarks, examples) loaded as modules, for tests of their logic."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, importable_dir: bool = False):
    """The module of `REPO/relative` (a script, not a package module); `importable_dir`: its
    folder goes on `sys.path` first, for a script that imports its neighbours."""
    path = REPO / relative
    if importable_dir:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
