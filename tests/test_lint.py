"""The code base stays ruff-clean, ruff-formatted and mypy-clean (the team's style guide: lint, format and a
type checker run in CI, inside the test command)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["pdinfer", "tests", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_ruff_is_clean():
    result = _ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `ruff format pdinfer tests benchmarks`:\n" + result.stdout + result.stderr


def test_mypy_is_clean():
    """mypy with the settings of pyproject.toml's [tool.mypy] (the package, default strictness)."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
