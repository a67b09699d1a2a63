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
from mlx_lm.models.switch_layers import SwitchGLU, _gather_sort, _scatter_unsort

from moestream.daemon.expert_pool import ExpertPool


def _switch_forward(inner: nn.Module, x: mx.array, idx: mx.array, do_sort: bool) -> mx.array:
    """`SwitchGLU.__call__`/`SwitchMLP.__call__` of mlx-lm with the sort decision given.

    A chunk of a prefill must take the kernel path that the whole prefill takes in stock
    mlx-lm (the sorted `gather_qmm` once the prefill has 64 or more routed pairs), even
    though the chunk alone is smaller; the rest is their code, step for step."""
    x = mx.expand_dims(x, (-2, -3))
    idx = mx.stop_gradient(idx)
    indices, inv_order = idx, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, indices)
    if isinstance(inner, SwitchGLU):
        x_up = inner.up_proj(x, idx, sorted_indices=do_sort)
        x_gate = inner.gate_proj(x, idx, sorted_indices=do_sort)
        x = inner.down_proj(inner.activation(x_up, x_gate), idx, sorted_indices=do_sort)
    else:
        x = inner.fc2(inner.activation(inner.fc1(x, idx, sorted_indices=do_sort)), idx, sorted_indices=do_sort)
    if do_sort:
        x = _scatter_unsort(x, inv_order, indices.shape)
    return x.squeeze(-2)


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
        do_sort = ids.size >= 64  # what stock mlx-lm decides for the whole forward
        outs = []
        for start, end in chunks:
            part = flat[start:end]
            pool.ensure(part, decode=False)
            out = _switch_forward(self.inner, xf[start:end][None], mx.array(pool.slot_of[part])[None], do_sort)
            mx.eval(out)
            outs.append(out)
        out = mx.concatenate(outs, axis=1)
        return out.reshape(*ids.shape, out.shape[-1])
