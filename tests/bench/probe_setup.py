"""Setup shared by the GPU probes that time one layer of a mapped pool (imported as a
sibling module, like probe_timing)."""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx

from moestream.daemon.model.streaming_model import StreamingModel, load_streaming_model
from moestream.shared.settings import Settings


def store_probe_args() -> argparse.Namespace:
    """--store (a Q30-shaped store), --out (the JSON), --reps (timed runs per figure)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    return parser.parse_args()


def mapped_quarter(store: str) -> tuple[StreamingModel, list[Any]]:
    """The store as a mapped pool with 25% of each layer in GPU memory, placed once and
    never moved (so the probe knows where each expert is), and its streaming layers."""
    mx.set_memory_limit(64 * 2**30)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=0), mapped=True)
    return sm, [m for _, m in sm.model.named_modules() if type(m).__name__ == "StreamingMoE"]
