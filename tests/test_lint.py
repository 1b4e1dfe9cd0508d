"""Lint and type checks run as part of the test suite, so CI and the README agree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(
    shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[test]')"
)
def test_ruff_clean() -> None:
    res = _run(["ruff", "check", "src", "tests", "benchmarks"])
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict_on_package() -> None:
    pytest.importorskip("mypy")
    res = _run([sys.executable, "-m", "mypy"])
    assert res.returncode == 0, res.stdout + res.stderr
