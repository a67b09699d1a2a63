"""The built-in demo model: a small qwen3_moe trained on the Python standard library.

The trained 4-bit expert store ships in `store/` beside this file, so `moestreamctl
generate` has a model without any download; the recipe that made it (corpus, training,
export) lives outside the package, in tests/bench/demo_recipe.
"""

from __future__ import annotations

from pathlib import Path


def store_path() -> Path:
    """Where the shipped demo expert store lives (it may be absent in a source checkout
    until the recipe has been run)."""
    return Path(__file__).resolve().parent / "store"
