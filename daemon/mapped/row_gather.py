"""Copy the routed experts of a mapped pool into a compact stack before the matmul.

A mapped pool (daemon/mapped/mapped_pool.py) keeps most experts in host memory, where the expert
kernels read them over the link as they compute. Those kernels keep too few reads in
flight to fill the link: on the H200, decode with every row in host memory moved about
32 GB/s against 55 GB/s for pinned DMA (tests/bench/results/probes/residency_q30_h200.json).
A copy kernel that does nothing but wide loads from every block keeps many more reads in
flight. So for small forwards (decode, a speculative verify) the layer first copies the
rows of its routed experts, wherever they live, into a stack of `n` rows in GPU memory,
and then runs mlx-lm's own call on that stack with ids 0..n-1.

Output is unchanged: each output row of the quantized gather kernels is computed from
its own expert's bytes and the token's input alone, and the bytes are the same; only the
row the kernel finds them at differs. Kept below 64 routed ids, where SwitchGLU sorts
the ids first and would take another path.

Requests batched together often route the same expert; a step copies each routed
expert once (`routed`), into the row of its first occurrence, and points the others at
that row, so the link carries each expert's bytes once per step.

On CUDA the copy is one custom kernel per layer (every tensor of the routed experts, 16
bytes per load); elsewhere `mx.take` does the same copy, which is what the tests here
run. On unified memory there is nothing to gain, and the setting stays off.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

# Largest number of routed ids gathered (SwitchGLU sorts at 64 and above).
MAX_GATHERED = 48
# Threads per block (each copies 16 bytes per pass), and at most this many blocks per
# expert row.
_THREADS = 256
_MAX_BLOCKS_PER_ROW = 64


def _take_rows(arrays: Sequence[mx.array], ids: mx.array) -> list[mx.array]:
    return [mx.take(a, ids, axis=0) for a in arrays]


def _kernel_source(count: int, each_once: bool) -> str:
    """Body of the copy kernel for `count` tensors: block (x, y) copies part of row
    ids[y] of every tensor into row y of its output, unless ids[y] came earlier at y'
    (then nothing: `where[y]` is y', as it is y for a first occurrence); 16-byte words
    when both pointers allow it (they do for MLX's allocations), else bytes."""
    # Each expert once: a row whose id came earlier only points at that row.
    scan = "for (unsigned int j = 0; j < blockIdx.y; ++j) { if (ids[j] == ids[blockIdx.y]) { seen_at = j; break; } }"
    parts = [
        "unsigned int seen_at = blockIdx.y;",
        *([scan] if each_once else []),
        "if (blockIdx.x == 0 && threadIdx.x == 0) where[blockIdx.y] = seen_at;",
        "if (seen_at != blockIdx.y) return;",
        "const unsigned long long row = (unsigned long long)ids[blockIdx.y];",
        "const unsigned long long slot = blockIdx.y;",
        "const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;",
        "const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;",
    ]
    for j in range(count):
        parts.append(
            f"""{{
  const char* src = reinterpret_cast<const char*>(t{j}) + row * B{j};
  char* dst = reinterpret_cast<char*>(o{j}) + slot * B{j};
  if (((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15) == 0
      && B{j} % 16 == 0) {{
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (unsigned long long w = first; w < B{j} / 16; w += step) d[w] = s[w];
  }} else {{
    for (unsigned long long w = first; w < B{j}; w += step) dst[w] = src[w];
  }}
}}"""
        )
    return "\n".join(parts)


class RowGather:
    """Gathers rows `ids` of a layer's expert tensors (all of one pool, fixed shapes)."""

    def __init__(self, use_kernel: bool, each_once: bool = True) -> None:
        self._use_kernel = use_kernel
        # False: `routed` copies a repeated expert again for each pair that routes it
        # (what tests/bench/gpu_mapped_batch_probe.py compares with).
        self._each_once = each_once
        # Kernels by tensor count and whether they skip repeats: a few per model.
        self._kernels: dict[tuple[int, bool], Callable] = {}

    @staticmethod
    def kernel_available() -> bool:
        """Whether the CUDA copy kernel can run here (MLX's CUDA build on its GPU)."""
        return mx.default_device() == mx.gpu and mx.cuda.is_available()

    def __call__(
        self, arrays: Sequence[mx.array], ids: mx.array, max_blocks: int = _MAX_BLOCKS_PER_ROW
    ) -> list[mx.array]:
        """Rows `ids` of `arrays`, every one copied (a whole layer, a stage). `max_blocks`
        caps the copy kernel's blocks per row: fewer leave more of the GPU to kernels
        running beside the copy (what tests/bench/gpu_background_copy_probe.py measures)."""
        flat = ids.reshape(-1).astype(mx.uint32)
        if not self._use_kernel:
            return _take_rows(arrays, flat)
        return self._run(arrays, flat, max_blocks, each_once=False)[:-1]

    def routed(
        self, arrays: Sequence[mx.array], ids: mx.array, max_blocks: int = _MAX_BLOCKS_PER_ROW
    ) -> tuple[list[mx.array], mx.array]:
        """A stack of the routed experts `ids` (any shape, repeats allowed) and, in `ids`'
        shape, the row of the stack that holds each pair's expert: its first occurrence.
        The copy kernel copies each expert once (the rows of later occurrences are left
        unwritten and never read); `mx.take` copies every row, and the positions are the
        same."""
        flat = ids.reshape(-1).astype(mx.uint32)
        if not self._use_kernel:
            n = flat.shape[0]
            order = mx.arange(n, dtype=mx.uint32)
            where = order
            if self._each_once:
                where = mx.min(mx.where(flat[:, None] == flat[None, :], order[None, :], n), axis=1)
            return _take_rows(arrays, flat), where.astype(ids.dtype).reshape(ids.shape)
        *rows, where = self._run(arrays, flat, max_blocks, each_once=self._each_once)
        return rows, where.astype(ids.dtype).reshape(ids.shape)

    def _run(self, arrays: Sequence[mx.array], ids: mx.array, max_blocks: int, each_once: bool) -> list[mx.array]:
        """The copy kernel's outputs: a stack per tensor, then `where`."""
        count = len(arrays)
        kernel = self._kernels.get((count, each_once))
        if kernel is None:
            kernel = mx.fast.cuda_kernel(
                name=f"moestream_gather_rows_{count}{'_once' if each_once else ''}",
                input_names=["ids", *[f"t{j}" for j in range(count)]],
                output_names=[*[f"o{j}" for j in range(count)], "where"],
                source=_kernel_source(count, each_once),
            )
            self._kernels[(count, each_once)] = kernel
        n = ids.shape[0]
        row_bytes = [a.nbytes // a.shape[0] for a in arrays]
        # Enough blocks per row to keep the link busy, no more than a row has words.
        blocks = max(1, min(max_blocks, -(-max(row_bytes) // (16 * _THREADS))))
        return kernel(
            inputs=[ids, *arrays],
            template=[(f"B{j}", b) for j, b in enumerate(row_bytes)],
            grid=(blocks * _THREADS, n, 1),
            threadgroup=(_THREADS, 1, 1),
            output_shapes=[*[(n, *a.shape[1:]) for a in arrays], (n,)],
            output_dtypes=[*[a.dtype for a in arrays], mx.uint32],
        )
