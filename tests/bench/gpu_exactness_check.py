"""Exactness of streaming against stock mlx-lm on the GPU machine, on random models large
enough for MLX's CUDA kernels (the CPU suite's tiny shapes hit kernels CUDA lacks).

    python tests/bench/gpu_exactness_check.py --out $OUT/exactness_gpu.json

For a 4-bit and a bf16 random qwen3_moe ("mini" shape of make_random_moe.py), each prompt
length and each capacity from top-k to all experts (slot pools with and without a host
tier, with prefetch on, so the tier's predicted experts are copied into the next layer's
slots while the GPU computes; both also with the copier's copy kernel, copy_kernel; and
mapped pools moving experts between host and GPU memory
as they decode, with and without the copy of routed experts into a stack, mapped_gather),
compares the logits of every step of greedy decoding, bit for bit, and reports the
largest difference where they differ. Prompts of 100 and 3000 tokens also go through
mlx-lm's `generate_step` against moestream's `plain_steps` (log-probabilities compared):
3000 tokens take two chunks at the default prefill step, which partial and mapped pools
prefill layer by layer (daemon/model/prefill.py). Three prompts decoded together by
moestream's `BatchSession` against stock's `BatchGenerator` compare greedy tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from make_random_moe import make_random_moe  # noqa: E402
from stock_runs import stepped, stock_batched  # noqa: E402

from moestream.daemon.model.streaming_model import load_streaming_model  # noqa: E402
from moestream.daemon.store.convert import convert_model  # noqa: E402
from moestream.shared.settings import Settings  # noqa: E402

try:  # trees older than the layer-major prefill have no plain_steps: their check skips it
    from moestream.daemon.model.generation import plain_steps  # noqa: E402
except ImportError:
    plain_steps = None
try:  # nor batching
    from moestream.daemon.model.batching import BatchSession  # noqa: E402
except ImportError:
    BatchSession = None

GREEDY = make_sampler(temp=0.0)
PREFILL_PROMPTS = (100, 3000)


def greedy(model, prompt, steps, tick=None):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, rows = [], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        rows.append(np.array(logits.astype(mx.float32)))
        tokens.append(int(token.item()))
        if tick is not None:
            tick()  # a mapped pool moves experts between host and GPU memory meanwhile
        logits = model(token[None], cache=cache)[:, -1, :]
    return tokens, rows


def compared(tokens, rows, want) -> dict:
    """How a run's tokens and per-step logits (or log-probs) compare with stock's."""
    diffs = [float(np.nanmax(np.abs(a - b))) if not np.array_equal(a, b) else 0.0 for a, b in zip(rows, want[1])]
    return {
        "tokens_equal": tokens == want[0],
        "logits_equal_steps": sum(d == 0.0 for d in diffs),
        "steps": len(diffs),
        "max_abs_diff": max(diffs),
        "first_diff_step": next((i for i, d in enumerate(diffs) if d), None),
    }


def ours_batched(sm, prompts, steps) -> list[list[int]]:
    """The same through a `BatchSession`, each request's generator stepped in turn as
    the engine loop steps its requests."""
    session = BatchSession(sm, max_batch=8)
    gens = [session.steps(p, GREEDY, steps) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in list(live):
            try:
                token = next(gens[i])[0]
            except StopIteration:
                live.remove(i)
                continue
            if token is not None:  # None: a piece of its prompt, the others' turn next
                out[i].append(int(token))
    session.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--bits", default="4,0", help="weights to test: 4 = 4-bit, 0 = bf16 (GPU only)")
    parser.add_argument(
        "--only",
        default="",
        help="run only the cases whose label (e.g. 32-slots, 4-tier, 8-mapped+gather) matches this regex",
    )
    parser.add_argument(
        "--collect",
        action="store_true",
        help="after each streaming model: collect garbage, synchronize, clear MLX's cache",
    )
    parser.add_argument(
        "--between",
        default="",
        help="after each streaming model, some of: release (drop it and collect "
        "garbage before the next loads), sync (mx.synchronize), clear (mx.clear_cache), comma-separated; "
        "--collect is all three (to tell which of them keeps the slot-pool crash away)",
    )
    args = parser.parse_args()
    between = {"release", "sync", "clear"} if args.collect else {s for s in args.between.split(",") if s}
    if between - {"release", "sync", "clear"}:
        parser.error(f"--between: unknown {sorted(between - {'release', 'sync', 'clear'})}")
    mx.set_memory_limit(32 * 2**30)
    results = []
    root = Path(tempfile.mkdtemp(prefix="gpuexact"))
    for bits in [int(b) for b in args.bits.split(",")]:
        src = make_random_moe(root / f"m{bits}", "mini", bits=bits, seed=1)
        store = root / f"s{bits}"
        convert_model(src, store)
        model, tokenizer = stock_load(str(src))
        rng = np.random.default_rng(0)
        # Three requests decoded together (BatchSession against stock's BatchGenerator).
        batch_prompts = [rng.integers(0, 4096, n).tolist() for n in (5, 23, 12)]
        want_batch = (
            stock_batched(model, batch_prompts, [args.steps] * 3, sorted(tokenizer.eos_token_ids))
            if BatchSession
            else None
        )
        prompts = {n: rng.integers(0, 4096, n).tolist() for n in (1, 7, 100)}
        want = {n: greedy(model, p, args.steps) for n, p in prompts.items()}
        # Through mlx-lm's generate_step (default prefill step): 3000 tokens take two
        # chunks, which moestream's plain_steps prefills layer by layer where a pool is
        # partial or mapped; 100 tokens are one chunk, which a mapped pool stages.
        long_prompts = {n: rng.integers(0, 4096, n).tolist() for n in PREFILL_PROMPTS} if plain_steps else {}
        want_long = {
            n: stepped(generate_step(mx.array(p), model, max_tokens=args.steps, sampler=GREEDY))
            for n, p in long_prompts.items()
        }
        # (slots, host tier bytes, mode): slot pools, a host tier, mapped pools reading
        # host memory in the kernels, and gathering the routed experts first.
        cases = [
            (4, 0, "slots"),
            (8, 0, "slots"),
            (16, 0, "slots"),
            (32, 0, "slots"),
            (4, 1 << 26, "tier"),
            (8, 1 << 26, "tier"),
            (4, 0, "slots+kernel"),
            (4, 1 << 26, "tier+kernel"),
            (8, 1 << 26, "tier+kernel"),
            (4, 0, "mapped"),
            (8, 0, "mapped"),
            (4, 0, "mapped+gather"),
            (8, 0, "mapped+gather"),
            (4, 1 << 26, "tier+kernel+b4"),
        ]
        for slots, host_cache, mode in cases:
            label = f"{slots}-{mode}"
            if not re.search(args.only, label):
                continue
            mapped, gather, kernel = mode.startswith("mapped"), "gather" in mode, "+kernel" in mode
            # "+bN": copies made ahead of use with at most N blocks per span.
            blocks = int(mode.rsplit("+b", 1)[1]) if "+b" in mode else None
            if (kernel and "copy_kernel" not in Settings.__dataclass_fields__) or (
                blocks and "prefetch_copy_blocks" not in Settings.__dataclass_fields__
            ):
                continue  # a tree older than the setting
            # Prefetch on for the slot pools: with a host tier, predicted experts are
            # copied into the next layer's slots on the copier's streams while the GPU
            # computes (prestage). Mapped pools have no prefetch (off, for older trees that had one).
            # mapped_gather given (its auto gathers on CUDA) only on trees that know it,
            # so that the script runs on older ones.
            prefetch = "off" if mapped else "on"
            sm = load_streaming_model(
                store,
                Settings(
                    capacity=slots,
                    host_cache=host_cache,
                    mapped=mapped,
                    prefetch=prefetch,
                    **({"mapped_gather": gather} if "mapped_gather" in Settings.__dataclass_fields__ else {}),
                    # The kernel is the default: the other
                    # cases say off, so that both ways stay checked.
                    **({"copy_kernel": kernel} if "copy_kernel" in Settings.__dataclass_fields__ else {}),
                    **({"prefetch_copy_blocks": blocks} if blocks else {}),
                ),
            )
            if not mapped:
                mode = (
                    sm.pool_stats().admission["mode"]
                    + ("+kernel" if kernel else "")
                    + (f"+b{blocks}" if blocks else "")
                )
            tick = sm.mapped_pool.tick if sm.mapped_pool is not None else None
            for n, p in prompts.items():
                toks, rows = greedy(sm.model, p, args.steps, tick)
                r = {
                    "weights": "4bit" if bits else "bf16",
                    "capacity": slots,
                    "admission": mode,
                    "prompt": n,
                    **compared(toks, rows, want[n]),
                    "stock_has_nan": bool(any(np.isnan(w).any() for w in want[n][1])),
                    "prestaged_so_far": sm.pool_stats().prestaged,
                }
                results.append(r)
                print(json.dumps(r), flush=True)
            for n, p in long_prompts.items():
                toks, rows = stepped(plain_steps(sm, p, GREEDY, args.steps))
                r = {
                    "weights": "4bit" if bits else "bf16",
                    "capacity": slots,
                    "admission": mode,
                    "prompt": n,
                    "loop": "generate_step",
                    **compared(toks, rows, want_long[n]),
                    "stacked_layers_so_far": sm.pool_stats().stacked_layers,
                }
                results.append(r)
                print(json.dumps(r), flush=True)
            if want_batch is not None:
                got = ours_batched(sm, batch_prompts, args.steps)
                r = {
                    "weights": "4bit" if bits else "bf16",
                    "capacity": slots,
                    "admission": mode,
                    "prompt": "batch of 5, 23, 12",
                    "loop": "batch",
                    "tokens_equal": got == want_batch,
                    "logits_equal_steps": 0,
                    "steps": 0,
                    "max_abs_diff": None,
                }
                results.append(r)
                print(json.dumps(r), flush=True)
            sm.close()
            if "release" in between:
                del sm
                gc.collect()
            if "sync" in between:
                mx.synchronize()
            if "clear" in between:
                mx.clear_cache()
    Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "results": results}, indent=1))
    bad = [r for r in results if not r["tokens_equal"] or r["logits_equal_steps"] != r["steps"]]
    print(f"{len(results) - len(bad)} of {len(results)} cases bit-identical")


if __name__ == "__main__":
    main()
