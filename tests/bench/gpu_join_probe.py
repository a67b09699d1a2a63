"""What a request joining a decoding batch costs, event by event: the daemon's
`BatchSession` on a store's streaming model, in-process, driven as the engine loop
drives it (each request's `iter_generate` advanced in turn).

One request decodes throughout (`resident`). Each event then starts K requests at once
(random prompts of `--prompt-tokens`, 4 tokens each, seeded at temperature 1) and times
the wall from their start until every one of them has its first token, with the batch's
own counters over the event (decode steps, joint prefill, join and alone seconds); the
K requests then finish and the next event starts. Every K is run twice in a row, so a
first occurrence (which may compile kernels for shapes not seen yet) stands beside a
repeat; a second sequence at another prompt length shows whether a new length pays
again; a third runs the first sequence with `mx.clear_cache` (which stock's prompt
processing calls after each chunk) made a no-op, to tell whether the allocator's cache
being emptied costs a join. With `--new-lengths`, only single joiners at prompt lengths
not seen yet run instead, each length twice: a short one (prefilled jointly by the batch,
on its left-padded cache) and one past `JOINT_PREFILL_TOKENS` (prefilled alone, on a
cache of its own), to tell which path pays for a length met for the first time.
Between events the resident's steps alone in the batch are timed (`resident_step_ms`),
the unit to compare an event with.

    python tests/bench/gpu_join_probe.py --store /root/q30/store --out /tmp/out/join_probe.json
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
from probe_setup import RoundRobin

from moestream.daemon.model.batching import JOINT_PREFILL_TOKENS, BatchSession

SIZES = (1, 2, 3, 5)


def _counts(session: BatchSession) -> dict[str, float]:
    return {k: v for k, v in session.stats.to_dict().items() if isinstance(v, (int, float)) and v is not None}


def _event(loop: RoundRobin, k: int, prompt_tokens: int) -> dict:
    before = _counts(loop.session)
    tic = time.perf_counter()
    joiners = [loop.start(4, prompt_tokens) for _ in range(k)]
    loop.run_until(lambda: all(e[1] >= 1 for e in joiners))
    seconds = time.perf_counter() - tic
    after = _counts(loop.session)
    loop.run_until(lambda: not any(e in loop.gens for e in joiners))
    delta = {key: round(after[key] - before.get(key, 0), 4) for key in after if key.endswith("_s") or key == "steps"}
    return {"k": k, "prompt_tokens": prompt_tokens, "seconds": round(seconds, 4), **delta}


def _resident_step_ms(loop: RoundRobin, steps: int) -> float:
    """Median ms per step of the resident alone in the batch."""
    resident = loop.gens[0]
    times = []
    for _ in range(steps):
        made = resident[1]
        tic = time.perf_counter()
        loop.run_until(lambda: resident[1] > made)
        times.append(1000 * (time.perf_counter() - tic))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--other-prompt-tokens", type=int, default=40)
    parser.add_argument("--new-lengths", help="comma-separated short prompt lengths not seen yet (see above)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    mx.set_memory_limit(64 * 2**30)
    sm = load_streaming_model(args.store, Settings(prefetch="off"))
    vocab = sm.manifest.config["vocab_size"]
    session = BatchSession(sm, 8)
    loop = RoundRobin(sm, session, vocab, args.prompt_tokens, random.Random(0))
    loop.start(100_000)
    # The resident's prompt, then a first joiner (the resident hands over to the batch).
    loop.run_until(lambda: loop.gens[0][1] >= 8)
    warm = _event(loop, 1, args.prompt_tokens)
    print(f"the first joiner: {json.dumps(warm)}", file=sys.stderr, flush=True)
    report: dict = {"device": str(mx.default_device()), "store": args.store, "first_joiner": warm, "events": []}
    report["resident_step_ms_before"] = _resident_step_ms(loop, 20)
    alone = report["resident_step_ms_before"]
    print(f"resident alone in the batch: {alone:.2f} ms a step", file=sys.stderr, flush=True)
    if args.new_lengths:
        for short in (int(x) for x in args.new_lengths.split(",")):
            for name, length in (("joint", short), ("alone", short + JOINT_PREFILL_TOKENS)):
                for occurrence in (1, 2):
                    e = {"sequence": name, "occurrence": occurrence, **_event(loop, 1, length)}
                    report["events"].append(e)
                    print(json.dumps(e), file=sys.stderr, flush=True)
        sequences = []
    else:
        sequences = [("first", args.prompt_tokens, False), ("other_length", args.other_prompt_tokens, False)]
        sequences.append(("no_clear_cache", args.prompt_tokens, True))
    clear_cache = mx.clear_cache
    for name, length, keep_cache in sequences:
        if keep_cache:
            mx.clear_cache = lambda: None
        try:
            for k in SIZES:
                for occurrence in (1, 2):
                    e = {"sequence": name, "occurrence": occurrence, **_event(loop, k, length)}
                    report["events"].append(e)
                    print(json.dumps(e), file=sys.stderr, flush=True)
        finally:
            mx.clear_cache = clear_cache
    report["resident_step_ms_after"] = _resident_step_ms(loop, 20)
    report["batch"] = session.to_dict()
    session.close()
    sm.close()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"resident alone in the batch: {report['resident_step_ms_after']:.2f} ms a step (after)")
    print(
        f"{'sequence':<16}{'K':>3}{'L':>5}{'occ':>4}{'seconds':>9}{'steps':>6}{'decode':>8}{'joint':>8}{'join':>8}{'alone':>8}"
    )
    for e in report["events"]:
        print(
            f"{e['sequence']:<16}{e['k']:>3}{e['prompt_tokens']:>5}{e['occurrence']:>4}{e['seconds']:>9.3f}{e['steps']:>6}"
            f"{e['decode_s']:>8.3f}{e['joint_prefill_s']:>8.3f}{e['join_s']:>8.3f}{e['prefill_alone_s']:>8.3f}"
        )


if __name__ == "__main__":
    main()
