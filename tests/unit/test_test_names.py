"""The suite's modules are plain files (no packages): pytest imports each by its basename, so two
test files of one name in different folders stop the whole collection ("import file mismatch")."""
from __future__ import annotations

import collections
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_every_test_module_has_a_basename_of_its_own() -> None:
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, count in names.items() if count > 1], "rename one of each pair: pytest imports by basename"
