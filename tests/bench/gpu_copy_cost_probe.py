"""What one cudaMemcpyAsync costs the host, by destination memory kind (GPU machine).

Session 7 measured the slot pool's admission queuing at about 7 us per copy into pool
arrays, which are managed memory once exported through the buffer protocol (MLX moves a
device buffer to managed memory when its host pointer is taken); about 2,700 copies per
token make that 17 to 19 ms (tests/bench/results/bench_predict_q30_h200.json). This
probe asks whether device memory would be cheaper to queue into, with the CUDA runtime
called through ctypes (the same library MLX loaded):

1. host microseconds per cudaMemcpyAsync of one layer's admission of 8 experts (the Q30
   tensor sizes, 72 copies) from pinned memory into cudaMalloc'd memory, into
   cudaMallocManaged memory, and into managed memory advised and prefetched to the GPU;
   also the bare cost of a ctypes call, to subtract;
2. the memory kind of an MLX array's buffer, read without exporting it: a one-line
   custom kernel writes the device pointer it was given into an output array.

    python tests/bench/gpu_copy_cost_probe.py --out $OUT/copy_cost_probe_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import mlx.core as mx

# Q30 expert tensors: gate/up/down weight, scales, biases (bytes).
TENSOR_BYTES = [786432, 49152, 49152] * 3
EXPERTS = 8
H2D, MANAGED_ATTACH_GLOBAL, NON_BLOCKING = 1, 1, 1
ADVISE_PREFERRED_LOCATION = 3
# cudaPointerAttributes.type: 0 unregistered, 1 host, 2 device, 3 managed.
KINDS = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}


class MemLocation(ctypes.Structure):  # CUDA 13's cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 8)]


def load_runtime() -> tuple[ctypes.CDLL, str]:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW), name
        except OSError:
            continue
    raise SystemExit("no CUDA runtime loaded in this process (run with MLX's CUDA build on the GPU)")


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: error {rc}")


def pointer_kind(rt: ctypes.CDLL, ptr: int) -> str:
    attrs = PointerAttributes()
    rc = rt.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
    return KINDS.get(attrs.type, str(attrs.type)) if rc == 0 else f"error {rc}"


def mlx_device_pointer(a: mx.array) -> int:
    """The address MLX hands kernels for `a`, without taking its host pointer."""
    kernel = mx.fast.cuda_kernel(
        name="moestream_probe_pointer", input_names=["inp"], output_names=["out"],
        source="out[0] = reinterpret_cast<unsigned long long>(inp);",
    )
    (out,) = kernel(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.uint64])
    return int(out.item())


def queue_us(rt: ctypes.CDLL, stream: ctypes.c_void_p, dst: int, src: int, reps: int) -> float:
    """Median host microseconds per cudaMemcpyAsync over one layer's 72 copies."""
    copies = []
    at_dst, at_src = 0, 0
    for _ in range(EXPERTS):
        for n in TENSOR_BYTES:
            copies.append((dst + at_dst, src + at_src, n))
            at_dst += n
            at_src += n
    per_call = []
    memcpy = rt.cudaMemcpyAsync
    for _ in range(reps):
        tic = time.perf_counter()
        for d, s, n in copies:
            memcpy(ctypes.c_void_p(d), ctypes.c_void_p(s), ctypes.c_size_t(n), H2D, stream)
        per_call.append((time.perf_counter() - tic) / len(copies))
        check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
    return 1e6 * statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    mx.zeros(1).item()  # MLX's CUDA runtime is loaded and its context made
    rt, name = load_runtime()
    total = EXPERTS * sum(TENSOR_BYTES)
    stream = ctypes.c_void_p()
    check(rt.cudaStreamCreateWithFlags(ctypes.byref(stream), NON_BLOCKING), "cudaStreamCreateWithFlags")
    src = ctypes.c_void_p()
    check(rt.cudaHostAlloc(ctypes.byref(src), ctypes.c_size_t(total), 0), "cudaHostAlloc")
    device, managed, managed_gpu = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(rt.cudaMalloc(ctypes.byref(device), ctypes.c_size_t(total)), "cudaMalloc")
    check(rt.cudaMallocManaged(ctypes.byref(managed), ctypes.c_size_t(total), MANAGED_ATTACH_GLOBAL), "cudaMallocManaged")
    check(rt.cudaMallocManaged(ctypes.byref(managed_gpu), ctypes.c_size_t(total), MANAGED_ATTACH_GLOBAL), "cudaMallocManaged")
    # The advice the copier's placement gives GPU-resident pool memory (CUDA 13 takes a
    # location, earlier runtimes a device ordinal).
    version = ctypes.c_int()
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    where = MemLocation(1, 0) if version.value >= 13000 else ctypes.c_int(0)
    advised = rt.cudaMemAdvise(managed_gpu, ctypes.c_size_t(total), ADVISE_PREFERRED_LOCATION, where) == 0

    noop = []
    for _ in range(1000):
        tic = time.perf_counter()
        rt.cudaRuntimeGetVersion(ctypes.byref(version))
        noop.append(time.perf_counter() - tic)
    report = {
        "library": name,
        "runtime_version": version.value,
        "ctypes_call_us": 1e6 * statistics.median(noop),
        "copies_per_layer": EXPERTS * len(TENSOR_BYTES),
        "queue_us_per_copy": {},
        "managed_advised_to_gpu": advised,
    }
    for label, dst in (("device", device), ("managed", managed), ("managed_on_gpu", managed_gpu)):
        queue_us(rt, stream, dst.value, src.value, 2)  # first touch and mapping out of the timing
        report["queue_us_per_copy"][label] = queue_us(rt, stream, dst.value, src.value, args.reps)
        report[f"{label}_kind"] = pointer_kind(rt, dst.value)
    pool = mx.zeros((EXPERTS, 1 << 20), dtype=mx.uint32)
    mx.eval(pool)
    address = mlx_device_pointer(pool)
    report["mlx_array_kind_unexported"] = pointer_kind(rt, address)
    report["queue_us_per_copy"]["mlx_array_unexported"] = queue_us(rt, stream, address, src.value, args.reps)
    memoryview(pool)  # the buffer protocol, as the copier takes it
    report["mlx_array_kind_after_export"] = pointer_kind(rt, mlx_device_pointer(pool))
    for p in (device, managed, managed_gpu):
        rt.cudaFree(p)
    rt.cudaFreeHost(src)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
