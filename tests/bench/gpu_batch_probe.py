"""Where a batched decode step's time goes as the batch grows: stock mlx-lm's
`BatchGenerator` on a random-weight model of the q30 shape (a few of its layers), B = 1,
2, 4, 8 requests decoding together, each way timed in turns:

- `shared`: one greedy sampler for the batch (one sampling call per step);
- `own`: a seeded sampler per request, as the daemon samples (B calls per step);
- `sorted`: as `own`, with SwitchGLU's sorted path at every batch size (mlx-lm sorts the
  routed pairs by expert only from 64 of them, B = 8 at top-8);
- `forward`: the model's forward alone on the same batch cache, evaluated each step.

Plus `generate_step` alone (B = 1, pipelined) for the single-stream reference. With
`--attention`, `own` again with the decode step's attention changed (timing only): its
left-padding mask dropped (`nomask`: MLX's fused vector kernel, which takes no array
mask, where stock's mask sends a batch to the unfused matmul-softmax-matmul), one
fused call per request on its own slice of the keys (`rows`), and a kernel of our own
that takes each row's left padding instead of a mask (`kernel`, on CUDA:
padded_decode_attention.py; its difference from the masked attention is `kernel_check`).
Measured: median ms per step over `--steps` steps after warm-up, in `--rounds` rounds.
With `--parts`, also one decoder layer's two halves alone at each B, evaluated call by
call over a 512-token batch cache: its attention and its MoE block (`parts_ms`), to
tell which of them grows with the batch.

    python tests/bench/gpu_batch_probe.py --layers 12 --out /tmp/out/batch_probe.json
    python tests/bench/gpu_batch_probe.py --tiny --out /tmp/batch_probe_cpu.json   # a smoke run

With `--store DIR` it runs instead on a converted store, as the daemon holds it: the
streaming model at 100% (`stream`) beside stock's model of the same weights (`stock`),
each with `generate_step`, `own` and the time the host spends building each step's
graph (`host_own`: the model's calls alone, which the device runs behind); and the
daemon's own request loop in-process (`loop`: `iter_generate` on a `BatchSession`, B
requests in the engine loop's round robin, a lone one outside the batch), so that what
the daemon adds to stock's batching, and whether a step waits on the host or on the
device, are measured on the same machine and weights as `bench serve`.

    python tests/bench/gpu_batch_probe.py --store /root/q30/store --out /tmp/out/batch_probe_store.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from make_random_moe import SHAPES
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import qwen3_moe, switch_layers
from mlx_lm.sample_utils import make_sampler
from padded_decode_attention import check, padded_decode_attention
from probe_setup import RoundRobin

from moestream.daemon.model.generation import SamplingParams, request_sampler
from moestream.daemon.planning.probe_models import config_with_layers, random_model

# The q30 shape as tests/bench/make_random_moe.py makes it (this script's folder is on sys.path).
Q30 = {**SHAPES["qwen3-30b-a3b"], "quantization": {"group_size": 64, "bits": 4}}
TINY = {**Q30, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32}
TINY.update({"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64, "vocab_size": 2048})
TINY["quantization"] = {"group_size": 32, "bits": 4}


def _always_sorted(self, x, indices):
    """SwitchGLU.__call__ with the sort at every size (mlx-lm's own code otherwise)."""
    x = mx.expand_dims(x, (-2, -3))
    x, idx, inv_order = switch_layers._gather_sort(x, indices)
    if self.training:
        idx = mx.stop_gradient(idx)
    x_up = self.up_proj(x, idx, sorted_indices=True)
    x_gate = self.gate_proj(x, idx, sorted_indices=True)
    x = self.down_proj(self.activation(x_up, x_gate), idx, sorted_indices=True)
    x = switch_layers._scatter_unsort(x, inv_order, indices.shape)
    return x.squeeze(-2)


def _nomask_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if queries.shape[2] != 1:
        return STOCK_SDPA(queries, keys, values, cache, scale, mask, sinks)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)


def _rows_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if queries.shape[2] != 1:
        return STOCK_SDPA(queries, keys, values, cache, scale, mask, sinks)
    # Row i from key i on: slices that start apart, as rows of unequal left padding would.
    rows = [
        mx.fast.scaled_dot_product_attention(
            queries[i : i + 1], keys[i : i + 1, :, i:], values[i : i + 1, :, i:], scale=scale
        )
        for i in range(queries.shape[0])
    ]
    return mx.concatenate(rows, axis=0)


def _kernel_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if queries.shape[2] != 1 or not hasattr(cache, "left_padding"):
        return STOCK_SDPA(queries, keys, values, cache, scale, mask, sinks)
    return padded_decode_attention(queries, keys, values, cache.left_padding, scale)


STOCK_SDPA = qwen3_moe.scaled_dot_product_attention


def _prompts(vocab: int, b: int) -> list[list[int]]:
    """B distinct 32-token prompts, the same in every measurement."""
    return [[(i * 131 + j * 7) % vocab for j in range(32)] for i in range(b)]


def _own_samplers(b: int) -> list:
    """A seeded sampler per request at temperature 1, as the daemon samples."""
    return [request_sampler(SamplingParams(temp=1.0, seed=i)) for i in range(b)]


def _print_table(ms_per_step: dict[str, dict[int, float]]) -> None:
    print("ms per step     " + "".join(f"{'B=' + str(b):>9}" for b in (1, 2, 4, 8)))
    for name, by_b in ms_per_step.items():
        print(f"{name:<16}" + "".join(f"{by_b[b]:>9.2f}" for b in (1, 2, 4, 8)))


class _Timed:
    """A model whose calls (building the graph; the device runs it later) are timed."""

    def __init__(self, model) -> None:
        self.model = model
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        tic = time.perf_counter()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - tic

    def __getattr__(self, key: str):
        return getattr(self.model, key)


def _loop_ms(sm, vocab: int, b: int, steps: int) -> float:
    """Median ms per round of the daemon's loop: B requests' `iter_generate` on one
    `BatchSession`, each advanced in turn as the engine loop does (seeded, temperature 1)."""
    from moestream.daemon.model.batching import BatchSession

    session = BatchSession(sm, 8)
    loop = RoundRobin(sm, session, vocab, 32, random.Random(0))
    entries = [loop.start(steps + 8, prompt=prompt) for prompt in _prompts(vocab, b)]
    first = entries[0]
    # The prompts and the first steps are not timed.
    loop.run_until(lambda: all(e[1] >= 4 for e in entries))
    rounds: list[float] = []
    for _ in range(steps):
        made = first[1]
        tic = time.perf_counter()
        loop.run_until(lambda: first[1] > made or first not in loop.gens)
        if first not in loop.gens:
            break
        rounds.append(time.perf_counter() - tic)
    for e in loop.gens:
        e[0].close()
    session.close()
    return 1000 * statistics.median(rounds)


def _batch_step_ms(model, vocab: int, b: int, samplers, steps: int, warmup: int, host: list | None = None) -> float:
    """ms per step of stock's `BatchGenerator` with B requests; with `host`, the ms per
    step the host spent in the model's calls (building the graph) is appended to it."""
    timed = _Timed(model)
    gen = BatchGenerator(timed, stop_tokens=[], completion_batch_size=8, prefill_batch_size=8)
    gen.insert(_prompts(vocab, b), max_tokens=[10_000] * b, samplers=samplers)
    for _ in range(warmup + 2):  # the first steps prefill and start the batch
        gen.next()
    timed.seconds = 0.0
    tic = time.perf_counter()
    for _ in range(steps):
        gen.next()
    mx.synchronize()
    ms = 1000 * (time.perf_counter() - tic) / steps
    gen.close()
    if host is not None:
        host.append(1000 * timed.seconds / steps)
    return ms


def _forward_ms(model, vocab: int, b: int, steps: int) -> float:
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0] * b) for _ in model.layers]
    x = mx.array(_prompts(vocab, b))
    mx.eval(model(x, cache=cache))
    y = mx.array([[i] for i in range(b)])
    for _ in range(3):
        mx.eval(model(y, cache=cache))
    tic = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(y, cache=cache))
    return 1000 * (time.perf_counter() - tic) / steps


def _parts_ms(model, b: int, steps: int) -> dict[str, float]:
    """Median ms of one decoder layer's attention and MoE block on B decode tokens."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    layer = model.layers[0]
    hidden = model.args.hidden_size
    cache = BatchKVCache([0] * b)
    ctx = mx.random.normal((b, 512, hidden)).astype(mx.bfloat16)
    mx.eval(layer.self_attn(layer.input_layernorm(ctx), create_attention_mask(ctx, cache), cache))
    x = mx.random.normal((b, 1, hidden)).astype(mx.bfloat16)
    mx.eval(x)

    def timed(call) -> float:
        for _ in range(5):
            mx.eval(call())
        runs = []
        for _ in range(steps):
            tic = time.perf_counter()
            mx.eval(call())
            runs.append(1000 * (time.perf_counter() - tic))
        return statistics.median(runs)

    def attention():
        out = layer.self_attn(x, None, cache)
        cache.trim(1)  # back to 512 tokens, so each call sees the same key length
        return out

    return {"attention": timed(attention), "moe": timed(lambda: layer.mlp(x))}


def _single_ms(model, vocab: int, steps: int) -> float:
    prompt = mx.array([(j * 7) % vocab for j in range(32)])
    gen = generate_step(prompt, model, max_tokens=steps + 5, sampler=make_sampler(temp=0.0))
    for _ in range(5):
        next(gen)
    tic = time.perf_counter()
    for _ in range(steps):
        next(gen)
    return 1000 * (time.perf_counter() - tic) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny dims (a CPU smoke run)")
    parser.add_argument("--parts", action="store_true", help="also time one layer's attention and MoE block alone")
    parser.add_argument("--attention", action="store_true", help="also time the decode attention changed (see above)")
    parser.add_argument("--store", help="a converted store: its streaming and stock models (see above)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mx.set_memory_limit(64 * 2**30)
    if args.store:
        _store_main(args)
        return
    base = TINY if args.tiny else Q30
    config = config_with_layers(base, args.layers)
    model = random_model(config, "bfloat16")
    vocab = config["vocab_size"]
    stock_call = switch_layers.SwitchGLU.__call__
    rows: dict[str, dict[int, list[float]]] = {}
    variants = [("nomask", _nomask_sdpa), ("rows", _rows_sdpa)] if args.attention else []
    kernel_check = None
    if args.attention and mx.cuda.is_available():
        try:
            kernel_check = check()
        except (RuntimeError, ValueError) as e:  # a kernel that does not build: say so, time the rest
            kernel_check = f"failed: {e}"
        else:
            variants.append(("kernel", _kernel_sdpa))
        print(f"kernel against the masked attention: {kernel_check}", file=sys.stderr)
    single: list[float] = []
    for r in range(args.rounds):
        single.append(_single_ms(model, vocab, args.steps))
        for b in (1, 2, 4, 8):
            own = _own_samplers(b)
            timings = {
                "shared": lambda: _batch_step_ms(model, vocab, b, None, args.steps, 3),
                "own": lambda: _batch_step_ms(model, vocab, b, own, args.steps, 3),
                "forward": lambda: _forward_ms(model, vocab, b, args.steps),
            }
            for name, run in timings.items():
                rows.setdefault(name, {}).setdefault(b, []).append(run())
            switch_layers.SwitchGLU.__call__ = _always_sorted
            try:
                own = _own_samplers(b)
                rows.setdefault("sorted", {}).setdefault(b, []).append(
                    _batch_step_ms(model, vocab, b, own, args.steps, 3)
                )
            finally:
                switch_layers.SwitchGLU.__call__ = stock_call
            for name, sdpa in variants:
                qwen3_moe.scaled_dot_product_attention = sdpa
                try:
                    own = _own_samplers(b)
                    rows.setdefault(name, {}).setdefault(b, []).append(
                        _batch_step_ms(model, vocab, b, own, args.steps, 3)
                    )
                finally:
                    qwen3_moe.scaled_dot_product_attention = STOCK_SDPA
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    parts = {b: _parts_ms(model, b, 10 * args.steps) for b in (1, 2, 4, 8)} if args.parts else None
    report = {
        "device": str(mx.default_device()),
        "layers": args.layers,
        "shape": "tiny" if args.tiny else "qwen3-30b-a3b",
        "steps": args.steps,
        "rounds": args.rounds,
        "generate_step_ms": statistics.median(single),
        "ms_per_step": {name: {b: statistics.median(v) for b, v in by_b.items()} for name, by_b in rows.items()},
        "runs": {name: {b: v for b, v in by_b.items()} for name, by_b in rows.items()},
        "parts_ms": parts,
        "kernel_check": kernel_check,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"generate_step B=1: {report['generate_step_ms']:.2f} ms/token")
    _print_table(report["ms_per_step"])
    for part in ("attention", "moe") if parts else ():
        print(f"layer {part:<10}" + "".join(f"{parts[b][part]:>9.3f}" for b in (1, 2, 4, 8)))


def _store_main(args: argparse.Namespace) -> None:
    from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
    from moestream.shared.settings import Settings

    sm = load_streaming_model(args.store, Settings(prefetch="off"))
    print(f"loaded the streaming model at {sm.capacity}", file=sys.stderr, flush=True)
    models = {"stream": sm.model, "stock": load_stock_model(args.store)}
    print("loaded the stock model", file=sys.stderr, flush=True)
    vocab = sm.manifest.config["vocab_size"]
    kernel = mx.cuda.is_available()
    rows: dict[str, dict[int, list[float]]] = {}
    single: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name, model in models.items():
            single.setdefault(name, []).append(_single_ms(model, vocab, args.steps))
            print(f"round {r + 1} {name} generate_step {single[name][-1]:.2f} ms", file=sys.stderr, flush=True)
            for b in (1, 2, 4, 8):
                tic = time.perf_counter()
                rows.setdefault(f"{name}_own", {}).setdefault(b, []).append(
                    _batch_step_ms(
                        model,
                        vocab,
                        b,
                        _own_samplers(b),
                        args.steps,
                        3,
                        rows.setdefault(f"{name}_host_own", {}).setdefault(b, []),
                    )
                )
                if name == "stream":
                    rows.setdefault("stream_loop", {}).setdefault(b, []).append(_loop_ms(sm, vocab, b, args.steps))
                    if kernel:
                        qwen3_moe.scaled_dot_product_attention = _kernel_sdpa
                        try:
                            rows.setdefault("stream_kernel", {}).setdefault(b, []).append(
                                _batch_step_ms(model, vocab, b, _own_samplers(b), args.steps, 3)
                            )
                        finally:
                            qwen3_moe.scaled_dot_product_attention = STOCK_SDPA
                done = {k: round(v[b][-1], 2) for k, v in rows.items() if k.startswith(name) and b in v}
                print(
                    f"round {r + 1} {name} B={b} in {time.perf_counter() - tic:.1f} s: {done}",
                    file=sys.stderr,
                    flush=True,
                )
    sm.close()
    report = {
        "device": str(mx.default_device()),
        "store": args.store,
        "steps": args.steps,
        "rounds": args.rounds,
        "generate_step_ms": {name: statistics.median(v) for name, v in single.items()},
        "ms_per_step": {name: {b: statistics.median(v) for b, v in by_b.items()} for name, by_b in rows.items()},
        "runs": {"generate_step": single, **rows},
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, ms in report["generate_step_ms"].items():
        print(f"generate_step {name}: {ms:.2f} ms/token")
    _print_table(report["ms_per_step"])


if __name__ == "__main__":
    main()
