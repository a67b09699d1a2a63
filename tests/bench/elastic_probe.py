"""The elastic pool's costs (issue 57): how long a shrink to the floor and a grow back take,
and decode tokens/s before, while and after the pool is at its floor.

In-process (`StreamingModel` and `ElasticPool`, the pressure set by hand between steps, as
the engine's loop resizes between them), for a store at a capacity:

- shrink / grow: from the reading of the pressure to the pool (and host tier) at its new
  size, `ResizeEvent.seconds`: each round decodes warm at the made size, shrinks to the
  floor (critical), decodes at the floor, grows back (normal);
- tok/s: one greedy decode in phases of `--tokens` tokens, made size / floor / made size
  again, each phase timed without its resize (that is the row above), `--rounds` times;
  then `--paired` groups of blocks of `--block` tokens in the order made, floor, floor,
  made (A B B A), whose ratio floor / made cancels a drift of the machine's speed (a shared
  machine's load) that the phases' medians keep.

With `--daemon`, also a real daemon on the store (`memory_pressure = file:`): from the
write of the level to `status` showing the new size, which adds the engine's poll (every
0.25 s) and, for a grow, the second the rule waits for the pressure to stay away.

With `--check`, first whether resizes change a token where the probe runs (the GPU, whose
CUDA copier and page-locked host tier the CPU tests do not reach): `CHECK_TOKENS` greedy
tokens through shrinks and grows (`CHECK_SCHEDULE`) against the same decode with none, and
against stock mlx-lm, every step's log-probabilities compared bit for bit.

    python tests/bench/elastic_probe.py --store daemon/demo/store --capacity 0.5 --json out.json
    python tests/bench/elastic_probe.py --tiny --capacity 0.5
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: tiny_models, pool_store

from pool_store import ManualPressure  # noqa: E402

from moestream.daemon.model.generation import encode_prompt, plain_steps  # noqa: E402
from moestream.daemon.model.streaming_model import load_streaming_model  # noqa: E402
from moestream.daemon.pool.elastic import ElasticPool  # noqa: E402
from moestream.shared.settings import Settings, demo_store_path  # noqa: E402

# Greedy, the demo loops on it and never ends: every phase decodes its whole count.
PROMPT = "def fibonacci(n):"
GREEDY = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731


class Ticks:
    """The rule's clock: a second on at each call of `step`, past its poll and settle times."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += 1.0


CHECK_TOKENS = 256
# The pressure set when the decode reaches each token: the floor, back, halved down, the floor, back.
CHECK_SCHEDULE = {32: "critical", 96: "normal", 128: "warn", 192: "critical", 224: "normal"}


def _steps(sm: Any, schedule: dict[int, str]) -> tuple[list[int], list[Any], list[int]]:
    """Greedy tokens, their log-probabilities and the slots per layer after each, the
    pressure set by `schedule` between steps."""
    import numpy as np

    source, clock = ManualPressure(), Ticks()
    elastic = ElasticPool(source, logging.getLogger("elastic_probe"), clock=clock)
    elastic.attach(sm)
    tokens, rows, slots = [], [], []
    for token, logprobs in plain_steps(sm, encode_prompt(sm, PROMPT, None), GREEDY, CHECK_TOKENS):
        tokens.append(int(token))
        rows.append(np.array(logprobs.astype(mx.float32)))
        if len(tokens) in schedule:
            source.set(schedule[len(tokens)], "set by the probe")
        clock.step()
        elastic.tick()
        slots.append(elastic.slots())
    return tokens, rows, slots


def check(store: Path, capacity: str, host_cache: str, mapped: bool | None) -> dict[str, Any]:
    """Resizes against none, and against stock mlx-lm: the first step that differs, if any."""
    import numpy as np
    from mlx_lm.generate import generate_step

    from moestream.daemon.model.streaming_model import load_stock_model

    def first_difference(a: tuple[list[int], list[Any]], b: tuple[list[int], list[Any]]) -> int | None:
        for i, (ta, ra, tb, rb) in enumerate(zip(a[0], a[1], b[0], b[1])):
            if ta != tb or not np.array_equal(ra, rb):
                return i
        return None

    runs = {}
    ids: list[int] = []
    for name, schedule in (("unresized", {}), ("resized", CHECK_SCHEDULE)):
        settings = Settings().replace(capacity=capacity, host_cache=host_cache, mapped=mapped)
        sm = load_streaming_model(store, settings)
        try:
            ids = encode_prompt(sm, PROMPT, None)
            runs[name] = _steps(sm, schedule)
            admission = sm.admitter.stats()
        finally:
            sm.close()
    stock = load_stock_model(store)
    stock_steps = [
        (int(t), np.array(lp.astype(mx.float32)))
        for t, lp in generate_step(mx.array(ids), stock, max_tokens=CHECK_TOKENS, sampler=GREEDY)
    ]
    stock_run = ([t for t, _ in stock_steps], [r for _, r in stock_steps])
    slots = runs["resized"][2]
    return {
        "tokens": CHECK_TOKENS,
        "schedule": CHECK_SCHEDULE,
        "slots_seen": sorted(set(slots)),
        "slots_trace": slots,
        "admission": {k: admission.get(k) for k in ("mode", "device_copy", "pinned", "tier_bytes")},
        "resized_vs_unresized_first_difference": first_difference(runs["resized"], runs["unresized"]),
        "resized_vs_stock_first_difference": first_difference(runs["resized"], stock_run),
        "unresized_vs_stock_first_difference": first_difference(runs["unresized"], stock_run),
    }


def _memory() -> dict[str, int]:
    return {"rss_bytes": psutil.Process().memory_info().rss, "mlx_active_bytes": mx.get_active_memory()}


def in_process(
    store: Path,
    capacity: str,
    host_cache: str,
    tokens: int,
    rounds: int,
    no_mapped: bool = False,
    paired: int = 0,
    block: int = 16,
) -> dict[str, Any]:
    settings = Settings().replace(capacity=capacity, host_cache=host_cache, mapped=False if no_mapped else None)
    sm = load_streaming_model(store, settings)
    try:
        source, clock = ManualPressure(), Ticks()
        elastic = ElasticPool(source, logging.getLogger("elastic_probe"), clock=clock)
        elastic.attach(sm)
        made = elastic.status()
        ids = encode_prompt(sm, PROMPT, None)
        steps = plain_steps(sm, ids, GREEDY, max_tokens=3 * tokens * rounds + tokens + 4 * block * paired + 1)
        for _ in range(tokens):  # warm: the pool filled at its made size, kernels compiled
            next(steps)
        phases: dict[str, list[float]] = {"before": [], "while": [], "after": []}
        shrinks, grows, memory = [], [], {}

        def decode(phase: str, n: int = tokens) -> float:
            tic = time.perf_counter()
            for _ in range(n):
                next(steps)
            rate = n / (time.perf_counter() - tic)
            phases.setdefault(phase, []).append(rate)
            return rate

        def resize(level: str) -> dict[str, Any]:
            source.set(level, "set by the probe")
            clock.step()
            event = elastic.tick()
            assert event is not None, f"no resize at {level}"
            return event.to_dict()

        for r in range(rounds):
            decode("before")
            if r == 0:
                memory["made"] = _memory()
            shrinks.append(resize("critical"))
            decode("while")
            if r == 0:
                memory["floor"] = _memory()
            clock.step()  # the pressure away for the rule's settle time
            grows.append(resize("normal"))
            decode("after")
            if r == 0:
                memory["after"] = _memory()
        ratios = []
        for _ in range(paired):
            a1 = decode("paired_made", block)
            resize("critical")
            b1, b2 = decode("paired_floor", block), decode("paired_floor", block)
            clock.step()
            resize("normal")
            a2 = decode("paired_made", block)
            ratios.append((b1 + b2) / (a1 + a2))
        steps.close()
        return {
            "store": str(store),
            "capacity": capacity,
            "host_cache": host_cache,
            "slots": {"made": made.slots, "floor": made.floor_slots},
            "pool_bytes": {"made": shrinks[0]["pool_bytes_from"], "floor": shrinks[0]["pool_bytes_to"]},
            "tier_bytes": {"made": shrinks[0]["tier_bytes_from"], "floor": shrinks[0]["tier_bytes_to"]},
            "shrink_seconds": [e["seconds"] for e in shrinks],
            "grow_seconds": [e["seconds"] for e in grows],
            "shrink_seconds_median": statistics.median(e["seconds"] for e in shrinks),
            "grow_seconds_median": statistics.median(e["seconds"] for e in grows),
            "experts_given_back": shrinks[0]["experts_moved"],
            "experts_read_back": [e["experts_moved"] for e in grows],
            "tokens_per_phase": tokens,
            "tok_s": phases,
            "tok_s_median": {k: statistics.median(v) for k, v in phases.items() if v},
            "memory": memory,
            "paired_blocks": {"groups": paired, "block_tokens": block, "floor_over_made": ratios}
            | (
                {"median": statistics.median(ratios), "quartiles": statistics.quantiles(ratios, n=4)}
                if paired > 1
                else {}
            ),
            "device": str(mx.default_device()),
        }
    finally:
        sm.close()


def through_daemon(store: Path, capacity: str, host_cache: str, rounds: int) -> dict[str, Any]:
    """From the write of the level to `status` showing the new size, on a real daemon."""
    from moestream.client.client import Client
    from moestream.daemon.bench.soak.driver import DaemonProcess

    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mep"))
    level = root / "pressure"
    flags = {"host_cache": host_cache} if host_cache != "0" else {}
    daemon = DaemonProcess.start(
        store, root / "rt", capacity=capacity, flags=flags, knobs={"memory_pressure": f"file:{level}"}
    )
    out: dict[str, list[float]] = {"shrink": [], "grow": [], "shrink_resize": [], "grow_resize": []}
    try:
        with Client(daemon.paths, timeout=60) as c:
            c.complete(PROMPT, max_tokens=32)
            made, floor = c.status().elastic.configured_slots, c.status().elastic.floor_slots
            for _ in range(rounds):
                for what, word, target in (("shrink", "critical", floor), ("grow", "normal", made)):
                    tic = time.perf_counter()
                    level.write_text(word + " set by the probe\n")
                    while (el := c.status().elastic).slots != target:
                        if time.perf_counter() - tic > 30:
                            raise RuntimeError(f"no {what} within 30 s")
                        time.sleep(0.005)
                    out[what].append(time.perf_counter() - tic)
                    out[what + "_resize"].append(el.events[-1].seconds)
                    c.complete(PROMPT, max_tokens=16)
    finally:
        daemon.stop(15.0)
    return {k + "_median": statistics.median(v) for k, v in out.items()} | {"seconds": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--store", type=Path, default=None, help="an expert store (default: the demo's)")
    where.add_argument("--tiny", action="store_true", help="a tiny qwen3_moe (16 experts, top-4) made here")
    parser.add_argument("--capacity", default="0.5")
    parser.add_argument("--host-cache", default="0")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paired", type=int, default=0, help="groups of A B B A blocks (made, floor, floor, made)")
    parser.add_argument("--block", type=int, default=16, help="tokens per paired block")
    parser.add_argument("--daemon", action="store_true", help="also time the resizes through a real daemon")
    parser.add_argument("--check", action="store_true", help="first: do resizes change a token here?")
    parser.add_argument("--no-mapped", action="store_true", help="the slot pool where a mapped pool would be made")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    tmp = None
    if args.tiny:
        from tiny_models import make_tiny_model

        from moestream.daemon.store.convert import convert_model

        tmp = Path(tempfile.mkdtemp(prefix="elastic-tiny"))
        convert_model(make_tiny_model(tmp / "model", "qwen3_moe", quant="4bit", seed=5), tmp / "store")
        store = tmp / "store"
    else:
        store = args.store or demo_store_path()
    result: dict[str, Any] = {}
    if args.check:
        result["check"] = check(store, args.capacity, args.host_cache, False if args.no_mapped else None)
        print(json.dumps({k: v for k, v in result["check"].items() if k != "slots_trace"}), flush=True)
    result.update(
        in_process(
            store, args.capacity, args.host_cache, args.tokens, args.rounds, args.no_mapped, args.paired, args.block
        )
    )
    if args.daemon:
        result["daemon"] = through_daemon(store, args.capacity, args.host_cache, args.rounds)
    result["commands"] = ["python tests/bench/elastic_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)]
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
