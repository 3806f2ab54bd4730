"""The committed reference counts (tests/cases/token_counts.json) are what OpenAI's
tiktoken computes today for the same corpus; the Rust tests compare against that file."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reference_counts_are_reproducible():
    result = subprocess.run([sys.executable, str(ROOT / "tests/cases/make_token_counts.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
