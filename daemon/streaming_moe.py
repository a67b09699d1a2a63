"""The streaming replacement for mlx-lm's `SwitchGLU`/`SwitchMLP`.

The original module is kept and called as it is, with its stacked expert tensors swapped
for the pool's slot arrays and expert ids swapped for slot ids. So the same kernels
(`gather_qmm`/`gather_mm`) run on the same bytes, and each output row is what stock
mlx-lm computes: exactness comes from running their code, not from imitating it.

A forward is always one call of that code: when a prefill's experts do not fit in the
pool, the pool hands over a transient stack of exactly those experts instead of slots.
Splitting the tokens into several calls would be exact on the CPU but not on CUDA, whose
quantized gather kernels round differently for a different number of rows.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moestream.daemon.expert_pool import ExpertPool


class StreamingMoE(nn.Module):
    def __init__(self, inner: nn.Module, pool: ExpertPool) -> None:
        super().__init__()
        self.inner = inner
        self.pool = pool
        self._use(pool.arrays)

    def _use(self, arrays: dict[str, mx.array]) -> None:
        for t in self.pool.layer.tensors:
            projection, param = t.name.rsplit(".", 1)
            getattr(self.inner, projection)[param] = arrays[t.name]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        pool = self.pool
        if pool.fully_resident:
            # Every expert has a slot: map ids to slots on the device, no host sync.
            return self.inner(x, pool.remap[indices])

        ids = np.array(indices)  # the one host sync of this layer
        pool.stats.host_syncs += 1
        flat = ids.reshape(-1, ids.shape[-1])
        if pool.fits(flat):
            # One token per sequence is a decode step (batched or not); more is prefill.
            pool.ensure(flat, decode=ids.ndim < 2 or ids.shape[-2] == 1)
            return self.inner(x, mx.array(pool.slot_of[ids]))

        stacked, row_of = pool.gather_overflow(flat)
        self._use(stacked)
        try:
            # The lazy graph keeps its own references to `stacked`, so the pool's
            # arrays can be put back before it runs.
            return self.inner(x, mx.array(row_of[ids]))
        finally:
            self._use(pool.arrays)
