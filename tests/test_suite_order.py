"""The suite's own scheduling (tests/conftest.py): the long e2e files go out first."""

import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def suite_conftest():
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_heavy_first_file_exists():
    # a renamed file would silently fall back to its collected place, perhaps the last
    missing = [path for path in suite_conftest().HEAVY_FIRST
               if not (TESTS.parent / path).is_file()]
    assert not missing, f"tests/conftest.py HEAVY_FIRST names files that are gone: {missing}"


def test_the_heavy_files_go_first_and_the_rest_keep_their_order():
    conftest = suite_conftest()
    first, second = conftest.HEAVY_FIRST[:2]
    nodeids = ["tests/a_test.py::x", f"{second}::y", "tests/b_test.py::z", f"{first}::u",
               f"{second}::v", f"{first}::w", "tests/a_test.py::t"]
    assert conftest.heavy_first(nodeids) == [
        f"{first}::u", f"{first}::w", f"{second}::y", f"{second}::v",
        "tests/a_test.py::x", "tests/b_test.py::z", "tests/a_test.py::t"]
