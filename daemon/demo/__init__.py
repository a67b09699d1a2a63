"""The built-in demo model: a small qwen3_moe trained on the Python standard library.

The trained 4-bit expert store ships in `store/` beside this file, so `moestreamctl
generate` has a model without any download; the recipe that made it (corpus, training,
export) lives outside the package, in tests/bench/demo_recipe.
"""
