import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from stack import Stack  # noqa: E402


@pytest.fixture
def stack(tmp_path):
    """Processes started through this fixture are stopped by PID after the test."""
    s = Stack(tmp_path / "stack")
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.stop_all()
