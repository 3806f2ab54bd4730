"""The Python tests' own imports: no module under tests/ imports a test module (one pytest
collects, `test_*.py`). What tests share lives in helper modules, which pytest does not
collect: tests/conftest.py and tests/helpers.py for several folders, a helper module of
its folder for one (docs/testing.md). Run over the real tests (so `make test` fails on a
new such import) and over a small tree it must judge right."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def is_test_module(name: str) -> bool:
    """pytest's default `python_files`: test_*.py and *_test.py."""
    return name.startswith("test_") or name.endswith("_test")


def imports_of_test_modules(tests: Path) -> list[str]:
    """Every import of a test module by a module under `tests` (at its top or inside a
    function), as 'path:line: imports name'."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if is_test_module(name.split(".")[0]):
                    found.append(f"{path.relative_to(tests)}:{node.lineno}: imports {name}, a test module")
    return found


def test_no_module_of_the_tests_imports_a_test_module():
    assert imports_of_test_modules(TESTS) == [], "move what is shared into a helper module (tests/helpers.py)"


def test_the_checker_sees_a_test_module_imported_at_the_top_or_in_a_function(tmp_path):
    (tmp_path / "lua").mkdir()
    (tmp_path / "e2e").mkdir()
    (tmp_path / "helpers.py").write_text("import json\n")
    (tmp_path / "lua/limits_script.py").write_text("from helpers import json\n")
    (tmp_path / "lua/test_a.py").write_text("from limits_script import json\nimport helpers\n")
    (tmp_path / "e2e/test_b.py").write_text("from stack import chat\n\n\ndef test_x():\n    pass\n")
    assert imports_of_test_modules(tmp_path) == []
    (tmp_path / "lua/test_a.py").write_text("from test_limits import CASES  # noqa\nimport helpers\n")
    (tmp_path / "e2e/test_b.py").write_text("def test_x():\n    from test_oversized import body_of\n")
    (tmp_path / "helpers.py").write_text("import json, test_pools\n")
    assert imports_of_test_modules(tmp_path) == [
        "e2e/test_b.py:2: imports test_oversized, a test module",
        "helpers.py:1: imports test_pools, a test module",
        "lua/test_a.py:1: imports test_limits, a test module",
    ]
