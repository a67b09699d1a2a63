"""`moestreamctl plan`'s compute probe on the q30 shape against longer runs, deeper
models and the store's own model. The probe (daemon/plan.py `probe_compute`) times
random-weight models of `probe_layer_counts` layers (4 and 16 for 48; 2 and 8 before),
with at most PROBE_MAX_EXPERTS experts a layer, warmed with an 8-token prompt and 2 steps,
then timed on 48-token prompts and 12 steps. Here models of 2, 4, 8, 16 and 24 layers
(made as the probe makes them) are each timed that way, again once those shapes were
seen, and over a longer decode; each lever (2 and 8, 4 and 16) is extrapolated to 24
layers and to the model's 48. Each figure is ms per decode token, the median of
`--repeats` runs. `synced_ms` is the same decode waiting for every layer's output
before the next layer is built, as a partial slot pool's read-back of each layer's
routing makes it wait (`plan`'s sync term is its difference from the plain decode).
`bench_loop_ms` is `bench decode`'s own loop (`timed_decode`, sampled at temperature 1,
as `plan-q30` measures stock).

With `--embed-scale S` (make-q30 makes its store with 64), each random model is made and
timed again with its token embeddings scaled by S (`varied`), so that its routing varies
from token to token as the store's does: whether routing the same experts every token
makes the probe's random models faster than the store's.

With `--store`, the store's full model loaded as `bench decode` loads stock mlx-lm, timed
the same ways (`stock`), then the 8-layer model made and timed again after it
(`8_after_stock`): whether the forecast's compute term misses the real model or the
process it runs in (plan-q30 measured stock at 22 ms a token where the probe forecast 16).

    python tests/bench/gpu_plan_probe.py --out /tmp/out/plan_probe_h200.json
    python tests/bench/gpu_plan_probe.py --tiny --out /tmp/plan_probe_cpu.json   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from gpu_batch_probe import Q30, TINY

from moestream.daemon.bench.decode import timed_decode
from moestream.daemon.planning.plan import _time_model, _time_synced, probe_layer_counts
from moestream.daemon.planning.probe_models import probe_config, random_model


def _synced_ms(model, vocab: int, repeats: int) -> float:
    _time_synced(model, vocab, 4)
    return 1000 * statistics.median(_time_synced(model, vocab, 12) for _ in range(repeats))


def _ms(model, vocab: int, prompt: int, steps: int, repeats: int) -> float:
    return 1000 * statistics.median(_time_model(model, vocab, prompt, steps, 1)[0] for _ in range(repeats))


def _bench_loop_ms(model, vocab: int, repeats: int) -> float:
    prompt = [(i * 7919) % vocab for i in range(4)]
    timed_decode(model, prompt, 4, 1.0, 0)
    return 1000 * statistics.median(timed_decode(model, prompt, 32, 1.0, r)[0] / 32 for r in range(repeats))


def _timings(model, vocab: int, repeats: int) -> dict[str, float]:
    _time_model(model, vocab, 8, 2, 1)  # the probe's warm-up
    return {
        "as_probe_ms": _ms(model, vocab, 48, 12, repeats),
        "shapes_seen_ms": _ms(model, vocab, 48, 12, repeats),  # the same shapes, seen now
        "decode_64_ms": _ms(model, vocab, 48, 64, repeats),
        "synced_ms": _synced_ms(model, vocab, repeats),
        "bench_loop_ms": _bench_loop_ms(model, vocab, repeats),
    }


def _say(name: str, t: dict[str, float]) -> None:
    print(f"{name:>14}: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in t.items()), file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny dims (a CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--embed-scale", type=float, help="also time each random model with varied routing (see above)")
    parser.add_argument("--store", help="also time this store's full model, loaded as bench decode loads stock")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mx.set_memory_limit(96 * 2**30)
    base = TINY if args.tiny else Q30
    vocab = base["vocab_size"]
    total = int(base["num_hidden_layers"])
    far = total // 2
    levers = {"2-8": (2, 8), "probe": probe_layer_counts(total)}
    rows: dict[int, dict[str, float]] = {}
    stock: dict[str, dict[str, float]] = {}

    def at(lever: tuple[int, int], key: str, n: int) -> float:
        lo, hi = lever
        a, b = rows[lo][key], rows[hi][key]
        return a + (n - lo) * max((b - a) / (hi - lo), 0.0)

    def extrapolations(n: int) -> dict[str, dict[str, float]]:
        return {
            name: {k: at(lever, k, n) for k in rows[lever[0]]}
            for name, lever in levers.items()
            if lever[0] in rows and lever[1] in rows
        }

    def report() -> dict:
        return {
            "device": str(mx.default_device()),
            "shape": "tiny" if args.tiny else "qwen3-30b-a3b",
            "repeats": args.repeats,
            "levers": levers,
            "layers": rows,
            "extrapolated_ms": extrapolations(far),
            "stock": stock,
            "extrapolated_to_all_ms": extrapolations(total),
        }

    # Written after each model, so that a run cut short keeps what it measured.
    for n in sorted({2, 8, *levers["probe"], far}):
        model = random_model(probe_config(base, n), "bfloat16")
        rows[n] = _timings(model, vocab, args.repeats)
        _say(f"{n} layers", rows[n])
        del model
        if args.embed_scale:
            mx.clear_cache()
            model = random_model(probe_config(base, n), "bfloat16", args.embed_scale)
            rows[n].update({f"varied_{k}": v for k, v in _timings(model, vocab, args.repeats).items()})
            _say(f"{n} varied", {k[7:]: v for k, v in rows[n].items() if k.startswith("varied_")})
            del model
        mx.clear_cache()
        Path(args.out).write_text(json.dumps(report(), indent=1))
    for name, values in report()["extrapolated_ms"].items():
        for key, value in values.items():
            print(f"{name} {key}: extrapolated {value:.2f} ms against {rows[far][key]:.2f} ms measured at {far} layers")
    if args.store:
        from moestream.daemon.model.streaming_model import load_stock_model
        from moestream.shared.store_format import load_manifest

        config = load_manifest(Path(args.store)).config
        model = load_stock_model(args.store)
        stock["stock"] = _timings(model, int(config.get("text_config", config)["vocab_size"]), args.repeats)
        _say("stock", stock["stock"])
        del model
        mx.clear_cache()
        model = random_model(probe_config(base, 8), "bfloat16")
        stock["8_after_stock"] = _timings(model, vocab, args.repeats)
        _say("8 after stock", stock["8_after_stock"])
        Path(args.out).write_text(json.dumps(report(), indent=1))
        for name, values in report()["extrapolated_to_all_ms"].items():
            for key, value in values.items():
                print(f"{name} {key}: extrapolated {value:.2f} ms against {stock['stock'][key]:.2f} ms for the store's")


if __name__ == "__main__":
    main()
