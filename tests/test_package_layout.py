"""The design card's boundary: `client/` and `shared/` never import MLX, not even
inside a function (commands that need a model import `moestream.daemon` there)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mlx_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
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
    files = [f for top in ("client", "daemon", "shared", "native", "tests") for f in (ROOT / top).rglob("*")
             if f.suffix in (".py", ".cpp", ".h") and f.is_file()]
    assert files
    this = Path(__file__).resolve()
    bad = [f"{f.relative_to(ROOT)}: {s}" for f in files if f.resolve() != this for s in outside if s in f.read_text()]
    assert bad == [], bad
