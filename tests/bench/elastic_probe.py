"""The elastic pool's costs (issue 57): how long a shrink to the floor and a grow back take,
and decode tokens/s before, while and after the pool is at its floor.

In-process (`StreamingModel` and `ElasticPool`, the pressure set by hand between steps, as
the engine's loop resizes between them), for a store at a capacity:

- shrink / grow: from the reading of the pressure to the pool (and host tier) at its new
  size, `ResizeEvent.seconds`: each round decodes warm at the made size, shrinks to the
  floor (critical), decodes at the floor, grows back (normal);
- tok/s: one greedy decode in phases of `--tokens` tokens, made size / floor / made size
  again, each phase timed without its resize (that is the row above), `--rounds` times.

With `--daemon`, also a real daemon on the store (`memory_pressure = file:`): from the
write of the level to `status` showing the new size, which adds the engine's poll (every
0.25 s) and, for a grow, the second the rule waits for the pressure to stay away.

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
sys.path.insert(0, str(HERE.parent))  # tests/: tiny_models

from moestream.daemon.model.generation import encode_prompt, plain_steps  # noqa: E402
from moestream.daemon.model.streaming_model import load_streaming_model  # noqa: E402
from moestream.daemon.pool.elastic import ElasticPool  # noqa: E402
from moestream.daemon.pool.pressure import ManualPressure  # noqa: E402
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


def _memory() -> dict[str, int]:
    return {"rss_bytes": psutil.Process().memory_info().rss, "mlx_active_bytes": mx.get_active_memory()}


def in_process(store: Path, capacity: str, host_cache: str, tokens: int, rounds: int) -> dict[str, Any]:
    sm = load_streaming_model(store, Settings().replace(capacity=capacity, host_cache=host_cache))
    try:
        source, clock = ManualPressure(), Ticks()
        elastic = ElasticPool(source, logging.getLogger("elastic_probe"), clock=clock)
        elastic.attach(sm)
        made = elastic.status()
        ids = encode_prompt(sm, PROMPT, None)
        steps = plain_steps(sm, ids, GREEDY, max_tokens=3 * tokens * rounds + tokens + 1)
        for _ in range(tokens):  # warm: the pool filled at its made size, kernels compiled
            next(steps)
        phases: dict[str, list[float]] = {"before": [], "while": [], "after": []}
        shrinks, grows, memory = [], [], {}

        def decode(phase: str) -> None:
            tic = time.perf_counter()
            for _ in range(tokens):
                next(steps)
            phases[phase].append(tokens / (time.perf_counter() - tic))

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
            "tok_s_median": {k: statistics.median(v) for k, v in phases.items()},
            "memory": memory,
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
            made, floor = c.status()["elastic"]["configured_slots"], c.status()["elastic"]["floor_slots"]
            for _ in range(rounds):
                for what, word, target in (("shrink", "critical", floor), ("grow", "normal", made)):
                    tic = time.perf_counter()
                    level.write_text(word + " set by the probe\n")
                    while (el := c.status()["elastic"])["slots"] != target:
                        if time.perf_counter() - tic > 30:
                            raise RuntimeError(f"no {what} within 30 s")
                        time.sleep(0.005)
                    out[what].append(time.perf_counter() - tic)
                    out[what + "_resize"].append(el["events"][-1]["seconds"])
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
    parser.add_argument("--daemon", action="store_true", help="also time the resizes through a real daemon")
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
    result = in_process(store, args.capacity, args.host_cache, args.tokens, args.rounds)
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
