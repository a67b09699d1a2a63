"""The expert pool: slots, admission, the host tier, the read engine's Python side, sizing and autopin."""
