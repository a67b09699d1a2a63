"""How the built-in demo model was made: corpus, training, evaluation, export (not shipped in the wheel)."""
