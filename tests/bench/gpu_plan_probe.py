"""Why `moestreamctl plan`'s compute probe forecasts a q30 decode slower than it runs on
the H200: the probe's own timings (daemon/plan.py `probe_compute`: random-weight models of
2 and 8 layers, warmed with an 8-token prompt and 2 steps, then timed on 48-token
prompts and 12 steps) beside the same models timed again once those shapes were seen,
over a longer decode, and a random model of half the layers (what the extrapolation
stands for; a random model of all 48 is made in float32 first, past the GPU's memory).
Each figure is ms per decode token, the median of `--repeats` runs. `synced_ms` is the
same decode waiting for every layer's output before the next layer is built, as a
partial slot pool's read-back of each layer's routing makes it wait (`plan`'s sync term
is its difference from the plain decode).

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

from moestream.daemon.plan import PROBE_MAX_LAYERS, _config_with_layers, _random_model, _time_model, _time_synced


def _synced_ms(model, vocab: int, repeats: int) -> float:
    _time_synced(model, vocab, 4)
    return 1000 * statistics.median(_time_synced(model, vocab, 12) for _ in range(repeats))


def _ms(model, vocab: int, prompt: int, steps: int, repeats: int) -> float:
    return 1000 * statistics.median(_time_model(model, vocab, prompt, steps, 1)[0] for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny dims (a CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mx.set_memory_limit(96 * 2**30)
    base = TINY if args.tiny else Q30
    vocab = base["vocab_size"]
    far = int(base["num_hidden_layers"]) // 2
    rows: dict[int, dict[str, float]] = {}

    def extrapolated(key: str) -> float:
        a, b = rows[2][key], rows[PROBE_MAX_LAYERS][key]
        return a + (far - 2) * max((b - a) / (PROBE_MAX_LAYERS - 2), 0.0)

    def report() -> dict:
        done = PROBE_MAX_LAYERS in rows
        return {
            "device": str(mx.default_device()),
            "shape": "tiny" if args.tiny else "qwen3-30b-a3b",
            "repeats": args.repeats,
            "layers": rows,
            "extrapolated_ms": {k: extrapolated(k) for k in rows[2]} if done else None,
        }

    # Written after each model, so that a run cut short keeps what it measured.
    for n in (2, PROBE_MAX_LAYERS, far):
        model = _random_model(_config_with_layers(base, n), "bfloat16")
        _time_model(model, vocab, 8, 2, 1)  # the probe's warm-up
        as_probe = _ms(model, vocab, 48, 12, args.repeats)
        seen = _ms(model, vocab, 48, 12, args.repeats)  # the same shapes, seen now
        longer = _ms(model, vocab, 48, 64, args.repeats)
        synced = _synced_ms(model, vocab, args.repeats)
        rows[n] = {"as_probe_ms": as_probe, "shapes_seen_ms": seen, "decode_64_ms": longer, "synced_ms": synced}
        print(f"{n:>3} layers: as the probe {as_probe:.2f} ms, shapes seen {seen:.2f}, 64 steps {longer:.2f}, "
              f"synced {synced:.2f}",
              file=sys.stderr, flush=True)  # fmt: skip
        del model
        mx.clear_cache()
        Path(args.out).write_text(json.dumps(report(), indent=1))
    for key, value in report()["extrapolated_ms"].items():
        print(f"{key}: extrapolated {value:.2f} ms against {rows[far][key]:.2f} ms measured at {far} layers")


if __name__ == "__main__":
    main()
