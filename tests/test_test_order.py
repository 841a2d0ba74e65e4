"""The order make test hands files to its workers (tests/conftest.py, tests/durations.json)."""

import importlib.util
import json
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("test_durations_tool", ROOT / "tools" / "test_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recorded_durations_name_files_that_exist():
    recorded = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert recorded and all((ROOT / name).is_file() for name in recorded), \
        [n for n in recorded if not (ROOT / n).is_file()]
    assert all(isinstance(s, (int, float)) and s > 0 for s in recorded.values())


def test_the_tool_sums_each_files_durations():
    lines = ["12.50s call     tests/test_a.py::test_one[x]", "0.50s setup    tests/test_a.py::test_one[x]",
             "3.00s call     solutions/01_x.ipynb::Cell 4", "1.00s call     tests/test_b.py::test_two",
             "=== 3 passed in 20s ==="]
    assert _tool().per_file(lines) == {"tests/test_a.py": 13, "solutions/01_x.ipynb": 3}


def test_longest_recorded_files_come_first():
    class Item:
        def __init__(self, path):
            self.fspath = ROOT / path

        def get_closest_marker(self, name):
            return None

    longest = max(conftest._DURATIONS, key=conftest._DURATIONS.get)
    assert conftest._expected_seconds(Item(longest)) == conftest._DURATIONS[longest]
    assert conftest._expected_seconds(Item("tests/test_not_recorded_yet.py")) == 2
    assert conftest._expected_seconds(Item("solutions/99_new.ipynb")) == 10
