"""moestream: run Mixture-of-Experts models larger than memory.

The package is laid out by the design card: `moestream.shared` (protocol, settings,
store format; no MLX), `moestream.client` (thin clients and the CLI; no MLX),
`moestream.daemon` (model, expert pool, policies; imports MLX) and the compiled
`moestream._native` read engine.
"""

__version__ = "0.1.0"
