"""The expert pool: slots, admission (with the host tier), the read engine's Python side, sizing and autopin."""
