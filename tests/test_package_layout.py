"""The design card's boundary: `client/` and `shared/` never import MLX, not even
inside a function (commands that need a model import `moestream.daemon` there)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mlx_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("mlx", "mlx_lm")]
    return found


@pytest.mark.parametrize("folder", ["client", "shared"])
def test_no_mlx_import_in(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    bad = [hit for f in files for hit in _mlx_imports(f)]
    assert bad == [], f"{folder}/ imports MLX: {bad}"


def test_nothing_reads_a_folder_beside_the_checkout():
    """A user's clone is the whole project: no code or test reaches for `../shared` or
    another folder outside the repository (the traces the tests need are in tests/data)."""
    outside = ("../shared", "/work/shared", 'parents[2] / "shared"')
    files = [
        f
        for top in ("client", "daemon", "shared", "native", "tests")
        for f in (ROOT / top).rglob("*")
        if f.suffix in (".py", ".cpp", ".h") and f.is_file()
    ]
    assert files
    this = Path(__file__).resolve()
    bad = [f"{f.relative_to(ROOT)}: {s}" for f in files if f.resolve() != this for s in outside if s in f.read_text()]
    assert bad == [], bad


def _code_files(*tops: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    return sorted(
        f for top in tops for f in (ROOT / top).rglob("*") if f.suffix in suffixes and "__pycache__" not in f.parts
    )


def test_the_maintainers_map_names_every_module():
    """daemon/README.md maps the code: every module of the package is named there, by its
    path or by a folder row that covers it."""
    text = (ROOT / "daemon" / "README.md").read_text()
    missing = []
    for f in _code_files("daemon", "client", "shared", "native", suffixes=(".py", ".cpp", ".h")):
        rel = f.relative_to(ROOT)
        if f.name == "__init__.py" or "demo" in rel.parts and "store" in rel.parts:
            continue
        folders = [str(p) + "/" for p in rel.parents if str(p) != "."]
        named = f"`{rel}`" in text or f.stem in text or any(f"`{d}`" in text for d in folders[:-1])
        if not named:
            missing.append(str(rel))
    assert missing == [], f"daemon/README.md does not name {missing}"


def test_no_benchmark_soak_or_command_module_beside_engine_code():
    """Benchmarks live under daemon/bench/ and commands under client/cli/, not beside the
    engine's modules under names like bench_*.py, soak_*.py or cmd_*.py."""
    bad = [
        str(f.relative_to(ROOT))
        for f in _code_files("daemon", "client", "shared")
        if f.name.startswith(("bench_", "soak_", "cmd_"))
    ]
    assert bad == []


def test_code_says_why_and_leaves_the_history_to_the_results():
    """Measurements and the runs that made them belong in tests/bench/RESULTS.md, not in
    code: no comment or docstring names a session of work."""
    pattern = re.compile(r"\bsessions? \d+", re.IGNORECASE)
    files = _code_files("daemon", "client", "shared", "native", "tests", suffixes=(".py", ".cpp", ".h", ".sh"))
    bad = [
        f"{f.relative_to(ROOT)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert bad == [], bad
