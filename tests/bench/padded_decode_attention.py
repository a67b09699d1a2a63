"""A fused decode attention for a left-padded batch, as a CUDA kernel of our own
(`mx.fast.cuda_kernel`), for the batch probe to time against mlx-lm's masked attention.

Why: mlx-lm's `BatchKVCache` hands every decode step an array mask (its rows' left
padding), and MLX's CUDA backend has no fused kernel for one query with an array mask, so
a batch's decode attention runs unfused (matmul, mask, softmax, matmul) where a lone
request's runs one vector kernel. This kernel takes each row's first valid key instead of
a mask: one block per (row, query head), four warps splitting the keys, an online
softmax in float32, the warps' partial sums combined in shared memory.

Imported by gpu_batch_probe.py (a sibling module); `check()` compares it with mlx-lm's
masked attention on random inputs.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_SOURCE = """
    constexpr int WARPS = 4;
    constexpr int PER = D / 32;
    const float NEG_INF = __int_as_float(0xff800000);  // NVRTC has no <cmath> for INFINITY
    int block = blockIdx.x;
    int b = block / HQ;
    int h = block % HQ;
    int kh = h / (HQ / HKV);
    int warp = threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int keys = k_shape[2];
    int first = start[b];
    float s = scale[0];

    float qv[PER];
    for (int i = 0; i < PER; ++i) {
        int d = lane * PER + i;
        qv[i] = static_cast<float>(q[b * q_strides[0] + h * q_strides[1] + d * q_strides[3]]) * s;
    }
    float m = NEG_INF, l = 0.0f, acc[PER];
    for (int i = 0; i < PER; ++i) acc[i] = 0.0f;
    for (int t = first + warp; t < keys; t += WARPS) {
        const auto* kp = k + b * k_strides[0] + kh * k_strides[1] + t * k_strides[2];
        float dot = 0.0f;
        for (int i = 0; i < PER; ++i) dot += qv[i] * static_cast<float>(kp[(lane * PER + i) * k_strides[3]]);
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
        float nm = fmaxf(m, dot);
        float old = __expf(m - nm), w = __expf(dot - nm);
        const auto* vp = v + b * v_strides[0] + kh * v_strides[1] + t * v_strides[2];
        for (int i = 0; i < PER; ++i)
            acc[i] = acc[i] * old + w * static_cast<float>(vp[(lane * PER + i) * v_strides[3]]);
        l = l * old + w;
        m = nm;
    }
    __shared__ float wm[WARPS], wl[WARPS], wacc[WARPS][D];
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
    for (int i = 0; i < PER; ++i) wacc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    int d = threadIdx.x;
    if (d < D) {
        float top = NEG_INF;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, wm[w]);
        float num = 0.0f, den = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            float f = wm[w] == NEG_INF ? 0.0f : __expf(wm[w] - top);
            num += wacc[w][d] * f;
            den += wl[w] * f;
        }
        out[(b * HQ + h) * D + d] = static_cast<DT>(num / den);
    }
"""


@functools.cache
def _kernel():
    """Built once per process, on first use."""
    return mx.fast.cuda_kernel(
        name="padded_decode_attention",
        input_names=["q", "k", "v", "start", "scale"],
        output_names=["out"],
        source=_SOURCE,
        ensure_row_contiguous=False,
    )


def padded_decode_attention(q: mx.array, k: mx.array, v: mx.array, start: mx.array, scale: float) -> mx.array:
    """Attention of one query per row (q: B, Hq, 1, D) over keys [start[b], T) of row b
    (k, v: B, Hkv, T, D, any strides), as mlx-lm's masked attention over a left-padded batch."""
    b, hq, _, d = q.shape
    if d % 32 or d > 128:
        raise ValueError(f"head dim {d}: the kernel takes multiples of 32 up to 128")
    (out,) = _kernel()(
        inputs=[q, k, v, start.astype(mx.int32), mx.array([scale], mx.float32)],
        template=[("DT", q.dtype), ("D", d), ("HQ", hq), ("HKV", k.shape[1])],
        grid=(b * hq * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(b, hq, 1, d)],
        output_dtypes=[q.dtype],
    )
    return out


def check(b: int = 4, hq: int = 32, hkv: int = 4, d: int = 128, keys: int = 700) -> float:
    """Max abs difference against mlx-lm's masked attention (bf16), rows padded unequally."""
    from mlx_lm.models.base import create_causal_mask

    r = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((b, hq, 1, d), key=r[0]).astype(mx.bfloat16)
    k = mx.random.normal((b, hkv, keys + 64, d), key=r[1]).astype(mx.bfloat16)[..., :keys, :]
    v = mx.random.normal((b, hkv, keys + 64, d), key=r[2]).astype(mx.bfloat16)[..., :keys, :]
    pad = mx.array([(i * 37) % 200 for i in range(b)])
    mask = create_causal_mask(1, offset=keys - 1, left_padding=pad)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    got = padded_decode_attention(q, k, v, pad, d**-0.5)
    return float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max())
