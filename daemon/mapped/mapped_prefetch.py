"""Prefetch for mapped pools: the next layer's likely experts, copied while this one computes.

A mapped pool's small forwards copy their routed experts into a stack in GPU memory
before the expert kernels run (daemon/mapped/row_gather.py). The experts not in GPU memory come
over the link then, and the GPU waits for them. With prefetch, layer L also applies layer
L+1's router to its own input (as the slot pool's predictor does, daemon/prefetch/predictor.py:
on the H200 that names 0.915 of the experts L+1 routes to among its top k) and copies
those experts into a stack while layer L computes; layer L+1 then takes each routed
expert from that stack where it is there, and from the pool (over the link) where not.
Nothing waits on the host: the prediction, the copy and the choice all stay on the
device.

Where the copy runs (`Settings.mapped_prefetch_stream`): on a second MLX stream
("second"), or on the layer's own stream ("same"). MLX's CUDA backend builds each
stream's work into CUDA graphs whose nodes depend on each other through the buffers they
share (mlx/backend/cuda/device.cpp), so on the same stream the copy, which shares no
buffer with layer L's expert kernels, may still run beside them within a graph, without
the fence a dependency between two streams costs. On the H200 the second stream made
decode slower (0.54x of gathering alone; the fences themselves cost only about 1.4 ms of
the 15 ms per token it lost, tests/bench/results/stream_edge_probe_h200.json), and the
layer's own stream measured 1.03x with the copy capped at 4 blocks per row and 0.76x
with 16 (bench_predict_q30_mapped_same_b4_h200.json, ..._b16_...), although alone, in
one small graph, 4 blocks overlapped about half of the copy with a layer's expert calls
(background_copy_probe_h200.json). Within a graph only: MLX commits a stream's graph
every MLX_MAX_OPS_PER_BUFFER nodes (20 by default) and launches them in turn, and a
decode layer is roughly 30 kernels, so the copy and the kernels it should run beside often
fall into different graphs. Larger graphs did not help (session 11, `gpu_run.sh
graph-ops`: 0.77x, 0.71x, 0.84x at 20, 120, 400 nodes): decode there is bound by the
host, which builds and launches each token's graph while the GPU waits
(tests/bench/gpu_full_residency_probe.py), so a copy made earlier on the GPU saves
nothing while the prefetch's own kernels add to the host's work.

Output is unchanged: a stack row holds the same expert's bytes as its pool row, and a
stale stack (a forward cut short) is as good as a fresh one, since a mapped pool's bytes
never change. `prefetch = auto` measures decode both ways and keeps the faster, as for
the slot pool (PrefetchGovernor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx

from moestream.daemon.prefetch.predictor import NextRouter, routers_of
from moestream.daemon.prefetch.prefetcher import PREFETCH_MODES, PrefetchGovernor
from moestream.shared.settings import MAPPED_PREFETCH_STREAMS

if TYPE_CHECKING:
    from moestream.daemon.model.streaming_moe import StreamingMoE


@dataclass
class MappedPrefetchStats:
    # Forwards of a layer that staged the next layer's predicted experts, and how many
    # experts they copied (stack rows).
    forwards: int = 0
    staged: int = 0


class MappedPrefetch:
    """The switch, the second stream and the counts of mapped-pool prefetch (shared by
    every layer of a model); the same face as the slot pool's Prefetcher to the code that
    drives and reports prefetch (`enabled`, `governor`, `stats`, `drain`)."""

    def __init__(self, top_k: int, mode: str, stream: str = "second", blocks: int = 64) -> None:
        if mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch mode {mode!r}: use one of {', '.join(PREFETCH_MODES)}")
        if stream not in MAPPED_PREFETCH_STREAMS:
            raise ValueError(f"mapped prefetch stream {stream!r}: use one of {', '.join(MAPPED_PREFETCH_STREAMS)}")
        self.top_k = top_k
        # Experts staged per token: the next router's top k.
        self.width = top_k
        self.mode = mode
        self.enabled = mode != "off"
        self.governor = PrefetchGovernor(self) if mode == "auto" else None
        # Where the copies run: a second stream beside the layer's own work, or None
        # for the layer's own stream.
        self.stream = mx.new_stream(mx.default_device()) if stream == "second" else None
        # The copy kernel's blocks per expert row (Settings.prefetch_copy_blocks).
        self.blocks = blocks
        self.s = MappedPrefetchStats()

    def drain(self) -> None:
        """Nothing of it runs on the host: the copies are device work, finished with
        the forwards that read them."""

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "mapped",
            "mode": self.mode,
            "enabled": self.enabled,
            "width": self.width,
            "stream": "same" if self.stream is None else "second",
            "blocks": self.blocks,
            "forwards": self.s.forwards,
            "staged": self.s.staged,
        }
        if self.governor is not None:
            out["auto"] = self.governor.to_dict()
        return out


@dataclass(eq=False)
class StageNext:
    """Layer L+1 as layer L stages it: its streaming layer, its router, the switch."""

    moe: "StreamingMoE"
    router: NextRouter
    prefetch: MappedPrefetch


def install(moes: Sequence["StreamingMoE"], blocks: Sequence[Any], *, top_k: int, mode: str,
            stream: str = "second", copy_blocks: int = 64) -> MappedPrefetch | None:
    """Wire mapped-pool prefetch into the streaming layers (in forward order), where
    every pool gathers (Settings.mapped_gather) and routers are known; else None."""
    if mode == "off" or len(moes) < 2 or any(m.pool.gather is None for m in moes):
        return None
    routers = routers_of(moes, blocks)
    if all(r is None for r in routers[1:]):
        return None
    prefetch = MappedPrefetch(top_k, mode, stream, copy_blocks)
    for m, nxt, router in zip(moes, moes[1:], routers[1:]):
        if router is not None:
            m.stage_next = StageNext(nxt, router, prefetch)
    return prefetch
