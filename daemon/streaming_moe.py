"""The streaming replacement for mlx-lm's `SwitchGLU`/`SwitchMLP`.

The original module is kept and called as it is, with its stacked expert tensors swapped
for the pool's slot arrays and expert ids swapped for slot ids. So the same kernels
(`gather_qmm`/`gather_mm`) run on the same bytes, and each output row is what stock
mlx-lm computes: exactness comes from running their code, not from imitating it.
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
        for t in pool.layer.tensors:
            projection, param = t.name.rsplit(".", 1)
            getattr(inner, projection)[param] = pool.arrays[t.name]

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        pool = self.pool
        if pool.fully_resident:
            # Every expert has a slot: map ids to slots on the device, no host sync.
            return self.inner(x, pool.remap[indices])

        ids = np.array(indices)  # the one host sync of this layer
        pool.stats.host_syncs += 1
        k = ids.shape[-1]
        flat = ids.reshape(-1, k)
        # One token per sequence is a decode step (batched or not); more is prefill.
        decode = ids.ndim < 2 or ids.shape[-2] == 1
        chunks = pool.plan_chunks(flat)
        if len(chunks) == 1:
            pool.ensure(flat, decode=decode)
            return self.inner(x, mx.array(pool.slot_of[ids]))

        # The tokens' experts do not fit in the pool at once: serve them in consecutive
        # token ranges, each evaluated before the next one's admissions reuse slots.
        pool.stats.prefill_chunks += len(chunks)
        xf = x.reshape(-1, x.shape[-1])
        outs = []
        for start, end in chunks:
            part = flat[start:end]
            pool.ensure(part, decode=False)
            out = self.inner(xf[start:end][None], mx.array(pool.slot_of[part])[None])
            mx.eval(out)
            outs.append(out)
        out = mx.concatenate(outs, axis=1)
        return out.reshape(*ids.shape, out.shape[-1])
