"""Greedy decoding of a store by an expert-parallel group, one JSON report per rank.

Run it as MLX programs are run, one process per rank:

    mlx.launch --backend ring -n 2 -- python -m moestream.daemon.bench.expert_parallel STORE \\
        --capacity 25% --capacity 100% --prompt 1,2,3 --steps 16 --out DIR

or alone (a group of one: the ordinary single-process model). For each `--capacity` in
turn every rank loads the store, runs the same loop (the whole prompt in one forward,
then `--steps` greedy tokens) and closes it; it writes `DIR/rank<r>.json`, a list with one
report per capacity: the tokens, a SHA-256 of every step's logits (so runs of different
group sizes can be compared bit for bit), its share, its pool's bytes read and hit rate,
and what crossed the group. With `--led`, each capacity runs again the way the daemon's
group runs it (rank 0 decodes, the others follow its MoE layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ...shared.settings import Settings
from ..expert_worker import serve_share, share_row
from ..model.expert_parallel import STAT_FIELDS, ExpertShare, join_group
from ..model.streaming_model import StreamingModel, load_streaming_model
from .common import parse_capacity


class TimedShare(ExpertShare):
    """A share that measures the seconds inside each all_sum (`--time-collectives`:
    `ShareStats.collective_seconds`): each then runs alone between two syncs, which costs
    the overlap it would have."""

    def combine(self, y: mx.array, mine: mx.array) -> mx.array:
        part = self._after(mx.where(mine[..., None], y, mx.zeros_like(y)))
        self.stats.collectives += 1
        self.stats.collective_bytes += part.nbytes
        mx.eval(part)
        tic = time.perf_counter()
        out = self._chain(mx.distributed.all_sum(part, group=self.group))
        mx.eval(out)
        self.stats.collective_seconds += time.perf_counter() - tic
        return out


def greedy(model: nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[str], float]:
    """The tokens, each step's logits digest, and the decode seconds (after the prefill)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    tokens, digests = [], []
    start = 0.0
    for step in range(steps):
        token = mx.argmax(logits, axis=-1)
        mx.eval(token, logits)
        if step == 0:
            start = time.perf_counter()
        digests.append(hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest())
        tokens.append(int(token.item()))
        logits = model(token[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return tokens, digests, time.perf_counter() - start


def report(
    sm: StreamingModel, tokens: list[int], digests: list[str], decode_s: float, since: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One run's figures; `since`: the share's counters before it (a share serves several runs)."""
    stats = sm.pool_stats()
    share = sm.share
    group = None
    if share is not None:
        group = share.describe()
        for key, before in (since or {}).items():
            group[key] -= before
    return {
        "rank": 0 if share is None else share.rank,
        "size": 1 if share is None else share.size,
        "experts_per_layer": [p.layer.num_experts for p in sm.pools],
        "capacity": sm.capacity,
        "tokens": tokens,
        "logits_sha256": digests,
        "bytes_read": stats.bytes_read,
        "hit_rate": stats.hit_rate,
        "pool_bytes": sm.pool_bytes,
        "decode_tok_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
        "group": group,
        "prefetch": sm.prefetcher.stats() if sm.prefetcher is not None else None,
    }


def _led(
    replicated: ExpertShare, store: Path, capacity: str | None, prompt: list[int], steps: int, prefetch: str
) -> dict[str, Any]:
    """One capacity the daemon's way (daemon/expert_worker.py): rank 0 decodes, the other
    ranks serve their share of each of its MoE layers until it stops them. Rank 0 reports
    every rank's statistics (`ExpertShare.gather_stats`), the others only that they served."""
    mode = "leader" if replicated.rank == 0 else "follower"
    share = ExpertShare(replicated.group, mode=mode)
    settings = Settings(capacity=parse_capacity(capacity), model=store, prefetch=prefetch)
    if mode == "follower":
        code = serve_share(settings, share, logging.getLogger(__name__), keep_heat=False)
        return {"mode": mode, "asked_capacity": capacity, "exit": code}
    sm = load_streaming_model(store, settings, share=share)
    try:
        share.barrier()  # as the daemon's engine does: the followers have loaded
        tokens, digests, decode_s = greedy(sm.model, prompt, steps)
        ranks = [dict(zip(STAT_FIELDS, row)) for row in share.gather_stats(share_row(sm))]
        result = report(sm, tokens, digests, decode_s) | {"mode": mode, "asked_capacity": capacity, "ranks": ranks}
    finally:
        sm.close()
        share.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="the store; {rank} in it is replaced by this process's rank (a copy per rank)")
    parser.add_argument(
        "--capacity", action="append", help="slots per layer or a fraction of this rank's share (repeatable)"
    )
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--backend", default="any", help="mx.distributed backend (ring, nccl, jaccl, any)")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    parser.add_argument("--prefetch", default="off", choices=("on", "off", "auto"), help="of predicted experts")
    parser.add_argument(
        "--time-collectives",
        action="store_true",
        help="measure the seconds inside each all_sum (synced alone, so the decode is slower)",
    )
    parser.add_argument(
        "--led",
        action="store_true",
        help="then each capacity again as a daemon's group runs it: rank 0 runs the forward, the others follow",
    )
    args = parser.parse_args(argv)
    prompt = [int(t) for t in args.prompt.split(",")]
    share = join_group(args.backend)
    if share is not None and args.time_collectives:
        share = TimedShare(share.group)
    rank = 0 if share is None else share.rank
    store = Path(args.store.format(rank=rank))
    results = []
    for capacity in args.capacity or [None]:
        settings = Settings(capacity=parse_capacity(capacity), prefetch=args.prefetch)
        sm = load_streaming_model(store, settings, share=share)
        since = dataclasses.asdict(share.stats) if share is not None else None
        try:
            tokens, digests, decode_s = greedy(sm.model, prompt, args.steps)
            run = report(sm, tokens, digests, decode_s, since)
            results.append(run | {"mode": "replicated", "asked_capacity": capacity})
        finally:
            sm.close()
    if args.led and share is not None:
        results += [_led(share, store, c, prompt, args.steps, args.prefetch) for c in args.capacity or [None]]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.rename(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
