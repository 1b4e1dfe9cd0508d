"""The pure parts stay pure: an AST scan of their imports.

DESIGN.md: core/, the engine's model and the wire formats take time, randomness and
I/O as arguments; only the shells (gateway, engine server, CLI) import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvgate"
FORBIDDEN = {
    "asyncio",
    "aiohttp",
    "socket",
    "time",
    "random",
    "logging",
    "redis",
    "zmq",
    "threading",
    "subprocess",
}
# (package dir, files exempt because they are I/O shells)
PURE_PACKAGES = [("core", set()), ("engine", {"server.py"}), ("protocol", set()), ("sim", set())]


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def _pure_files() -> list[Path]:
    files = []
    for pkg, exempt in PURE_PACKAGES:
        d = SRC / pkg
        if d.is_dir():
            files.extend(p for p in sorted(d.rglob("*.py")) if p.name not in exempt)
    return files


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_pure_module_imports_no_io_clock_or_randomness(path: Path) -> None:
    bad = _imported_roots(path) & FORBIDDEN
    assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"


def test_scan_finds_the_core() -> None:
    assert any(p.parent.name == "core" for p in _pure_files())


def test_scan_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\nfrom . import x\n")
    assert _imported_roots(bad) & FORBIDDEN == {"time", "asyncio"}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize(
    "path", sorted((SRC / "engine").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_the_engine_does_not_import_the_gateway(path: Path) -> None:
    """The simulated engine stands in for vLLM: it shares the HTTP edge (kvgate.edge) and
    the wire formats with the gateway, never the gateway itself."""
    mods = _imported_modules(path)
    bad = {m for m in mods if m == "kvgate.gateway" or m.startswith("kvgate.gateway.")}
    assert not bad, f"{path.relative_to(SRC)} imports {sorted(bad)}"
