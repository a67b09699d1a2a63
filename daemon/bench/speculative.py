"""`moestreamctl bench decode --speculative MODE`: speculative against plain decode.

At each pool capacity one streaming model is loaded and decodes the same prompt
greedily, in turns (`rounds` times, medians reported): plain decode (mlx-lm's
`generate_step`, as the daemon runs it), then for each K speculation forced on
(`fallback=False`) and speculation with the automatic fallback (what a request gets).
Reported per K: acceptance rate, experts read per emitted token (union per layer of
each verify, summed over MoE layers) against plain decode's, tokens/s and the ratio to
plain decode, and whether the output is token-identical to plain decode (if not, the
first position that differs; plain decode's near ties are listed beside it).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.generate import generate_step

from ...shared.settings import Settings
from ..model.speculative import SpeculativeParams, SpeculativeStats, speculative_steps
from ..model.streaming_model import StreamingModel, load_streaming_model
from .common import default_of
from .decode import format_or_dash

DEFAULT_PROMPT = 'import os\nimport sys\n\n\ndef read_lines(path):\n    """Return the lines of the file at path."""\n'


@dataclass(frozen=True)
class BenchSpeculativeSettings:
    store: Path
    mode: str = "mtp"
    draft_tokens: tuple[int, ...] = (2,)
    draft_model: str | None = None
    capacities: tuple[float, ...] = (1.0, 0.25)
    prompt: str = DEFAULT_PROMPT
    decode_tokens: int = 128
    rounds: int = 3
    policy: str = default_of("policy")
    io_threads: int = default_of("io_threads")
    mlx_memory_limit: int | None = None


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def _pool_moves(sm: StreamingModel) -> tuple[int, int, int]:
    s = sm.pool_stats()
    return s.hits_prefill + s.hits_decode, s.misses_prefill + s.misses_decode, s.bytes_read


def _timed(sm: StreamingModel, steps: Any, n: int) -> dict[str, Any]:
    """Time tokens 2..n+1 of `steps` (the first comes with the prompt)."""
    first, lp = next(steps)
    hits0, misses0, bytes0 = _pool_moves(sm)
    tic = time.perf_counter()
    tokens = [int(first)]
    logprobs = [lp]
    for token, lp in steps:
        tokens.append(int(token))
        logprobs.append(lp)
        if len(tokens) == n + 1:
            break
    seconds = time.perf_counter() - tic
    hits, misses, nbytes = (a - b for a, b in zip(_pool_moves(sm), (hits0, misses0, bytes0)))
    steps.close()
    out = {
        "tokens_per_s": n / seconds,
        "tokens": tokens,
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "disk_bytes_per_token": nbytes / n,
    }
    if all(lp is not None for lp in logprobs):
        out["near_ties"] = _near_ties(logprobs)
    return out


def _near_ties(logprobs: list[mx.array], max_gap: float = 0.125) -> list[tuple[int, float]]:
    """(position, gap) where plain decode's two best tokens are at most `max_gap` apart:
    the positions whose greedy token may change with the kernels that computed them
    (a forward of K+1 tokens does not round as K+1 forwards of one on every backend)."""
    top2 = mx.stack([mx.topk(lp.astype(mx.float32).reshape(-1), 2) for lp in logprobs])
    gaps = mx.abs(top2[:, 1] - top2[:, 0]).tolist()
    return [(i, g) for i, g in enumerate(gaps) if g <= max_gap]


def _plain_run(sm: StreamingModel, prompt: list[int], n: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        steps = generate_step(mx.array(prompt), sm.model, max_tokens=n + 1, sampler=_greedy)
        return _timed(sm, steps, n)

    return run


def _spec_run(sm: StreamingModel, prompt: list[int], n: int, spec: SpeculativeParams) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        stats = SpeculativeStats(mode=spec.mode, draft_tokens_requested=spec.draft_tokens)
        steps = speculative_steps(sm, prompt, sampler=_greedy, max_tokens=n + 1, spec=spec, stats=stats)
        out = _timed(sm, steps, n)
        out["speculative"] = stats.to_dict()
        return out

    return run


def run_bench_speculative(settings: BenchSpeculativeSettings) -> dict[str, Any]:
    """Measure plain vs speculative decode at each capacity; return the report."""
    if settings.mlx_memory_limit:
        mx.set_memory_limit(settings.mlx_memory_limit)
    rows: list[dict[str, Any]] = []
    model_type = None
    for capacity in settings.capacities:
        sm = load_streaming_model(
            # The slot pool (what auto would choose on CPU and Apple Silicon), on every machine.
            settings.store,
            Settings(capacity=capacity, policy=settings.policy, io_threads=settings.io_threads, mapped=False),
        )
        try:
            model_type = sm.manifest.model_type
            prompt = sm.tokenizer.encode(settings.prompt)
            n = settings.decode_tokens
            configs: list[tuple[str, int | None, bool | None, Callable[[], dict[str, Any]]]] = [
                ("plain", None, None, _plain_run(sm, prompt, n))
            ]
            for k in settings.draft_tokens:
                for fallback in (False, True):
                    spec = SpeculativeParams(
                        settings.mode, draft_tokens=k, draft_model=settings.draft_model, fallback=fallback
                    )
                    name = f"{settings.mode}-k{k}" + ("-auto" if fallback else "")
                    configs.append((name, k, fallback, _spec_run(sm, prompt, n, spec)))
            samples: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in configs}
            for _, _, _, run in configs:  # warm-up: kernels, the MTP head or draft model, first reads
                run()
            for _ in range(settings.rounds):
                for name, _, _, run in configs:
                    gc.collect()
                    samples[name].append(run())
        finally:
            sm.close()
        # One token routes top_k distinct experts per MoE layer.
        plain_experts = sm.pools[0].top_k * len(sm.pools) if sm.pools else None
        plain_tokens = samples["plain"][0]["tokens"]
        plain_tps = statistics.median(s["tokens_per_s"] for s in samples["plain"])
        for name, k, fallback, _ in configs:
            runs = samples[name]
            tps = statistics.median(s["tokens_per_s"] for s in runs)
            row: dict[str, Any] = {
                "capacity": capacity,
                "name": name,
                "draft_tokens_requested": k,
                "fallback_enabled": fallback,
                "tokens_per_s": tps,
                "tokens_per_s_runs": [s["tokens_per_s"] for s in runs],
                "speed_vs_plain": tps / plain_tps,
                "plain_experts_read_per_token": plain_experts,
                "hit_rate": statistics.median(s.hit_rate for s in runs),
                "disk_bytes_per_token": statistics.median(s["disk_bytes_per_token"] for s in runs),
                "same_tokens_as_plain": all(s["tokens"] == plain_tokens for s in runs),
                # The first position where a run's tokens differ from plain decode's.
                "first_diff": min(
                    (
                        next((i for i, (a, b) in enumerate(zip(s["tokens"], plain_tokens)) if a != b), None)
                        for s in runs
                        if s["tokens"] != plain_tokens
                    ),
                    default=None,
                ),
            }
            if "near_ties" in runs[0]:
                row["near_ties"] = runs[0]["near_ties"]
            if "speculative" in runs[-1]:
                row["speculative"] = runs[-1]["speculative"]
                row["fell_back_runs"] = sum(bool(s["speculative"]["fell_back"]) for s in runs)
                after = [s["speculative"]["tokens_per_s_after_decision"] for s in runs]
                if all(a is not None for a in after):
                    # What the request ran at once the probe had decided, against plain decode.
                    row["after_decision_vs_plain"] = statistics.median(after) / plain_tps
            rows.append(row)
    return {
        "store": str(settings.store),
        "model_type": model_type,
        "mode": settings.mode,
        "draft_model": settings.draft_model,
        "prompt": settings.prompt,
        "decode_tokens": settings.decode_tokens,
        "rounds": settings.rounds,
        "policy": settings.policy,
        "device": str(mx.default_device()),
        "results": rows,
    }


def format_speculative_report(report: dict[str, Any]) -> str:
    num = format_or_dash
    header = [
        "capacity",
        "config",
        "K",
        "tok/s",
        "x plain",
        "accept",
        "exp/tok",
        "plain exp/tok",
        "same",
        "after",
        "note",
    ]
    rows = []
    for r in report["results"]:
        s = r.get("speculative") or {}
        rows.append(
            [
                f"{r['capacity']:g}",
                r["name"],
                num(s.get("draft_tokens"), ""),
                f"{r['tokens_per_s']:.1f}",
                f"{r['speed_vs_plain']:.3f}",
                num(s.get("acceptance_rate"), ".2f"),
                num(s.get("experts_read_per_accepted_token"), ".1f"),
                num(r.get("plain_experts_read_per_token"), ""),
                "True" if r["same_tokens_as_plain"] else f"@{r['first_diff']}",
                num(r.get("after_decision_vs_plain"), ".3f"),
                s.get("reason") or "",  # why it fell back to plain decode, or shrank K
            ]
        )
    title = (
        f"{report['model_type']} ({report['device']}): speculative {report['mode']} vs plain, "
        f"{report['decode_tokens']} greedy tokens, median of {report['rounds']}"
    )
    return "\n".join([title, *aligned_table(header, rows, left=("config", "note"))])


def aligned_table(header: list[str], rows: list[list[str]], left: tuple[str, ...] = ()) -> list[str]:
    """The lines of a table whose columns are as wide as their widest cell, header
    included: numbers right-aligned, the columns named in `left` left-aligned; no
    trailing spaces."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = []
    for cells in (header, *rows):
        padded = [cell.ljust(w) if name in left else cell.rjust(w) for name, cell, w in zip(header, cells, widths)]
        lines.append(" ".join(padded).rstrip())
    return lines
