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
