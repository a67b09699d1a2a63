"""`moestreamctl bench prefill`: time to the first token of long prompts, for stock
mlx-lm, moestream with every expert resident, and each partial pool, side by side in one
run.

Each configuration prefills the same random prompts (one per length) through mlx-lm's
`generate_step` (moestream's `plain_steps`, which goes layer by layer where that spares
reads) up to the first token, after a short untimed prompt of its own. Reported per
prompt: the time to the first token, prompt tokens/s, peak memory, the bytes read from
the store, moved over the link and staged, and the minimum bytes a pool must bring in:
the distinct experts the prompt routes (read off the fully resident run) that the pool
did not hold when the prompt started, each once. The bound is stock's time plus that
minimum over the bandwidth it moves at (the store's read rate for a pool without a host
tier, the pinned host-to-GPU rate for one whose host memory holds every expert), both
measured in the same run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from ...shared.settings import Settings, format_size
from ...shared.store_format import load_manifest
from ..model.generation import plain_steps
from ..model.prefill import PREFILL_STEP, PrefillStats
from ..model.streaming_model import StreamingModel, load_stock_model, load_streaming_model
from ..planning.bandwidth import measure_link_bandwidth, measure_read_bandwidth
from ..planning.plan import Bandwidths, ComputeProbe
from .common import default_of
from .decode import bench_plans, page_cache_reason

GREEDY = make_sampler(temp=0.0)


@dataclass(frozen=True)
class BenchPrefillSettings:
    store: Path
    prompt_tokens: tuple[int, ...] = (512, 2048, 8192)
    # Partial pools, as fractions of each layer's experts (1.0 always runs).
    capacities: tuple[float, ...] = (0.25,)
    # > 0 adds, per partial capacity, the pool with a host-RAM tier of this size, made as
    # the daemon makes it (a mapped pool where the tier holds every expert on NVIDIA).
    host_cache: int = 0
    # Also each partial pool without a host tier in stock's chunk order (prefill = chunk).
    chunked: bool = False
    stock: bool = True
    io_threads: int = default_of("io_threads")
    warmup_tokens: int = 64
    # Timed runs per prompt (the same prompt each time); the last is reported, all kept:
    # the first run of a shape may still compile kernels on a GPU.
    runs: int = 1
    # mlx-lm's prefill_step_size, for stock and moestream alike (its default is 2048;
    # smaller makes a short prompt take several chunks).
    prefill_step: int = PREFILL_STEP
    seed: int = 0
    mlx_memory_limit: int | None = None


def _first_token_seconds(run: Callable[[], Any]) -> float:
    """Seconds until `run`'s generator has the first token evaluated (`max_tokens=0`:
    the prompt and its first token, and nothing queued beyond)."""
    mx.synchronize()
    tic = time.perf_counter()
    for _ in run():
        pass
    mx.synchronize()
    return time.perf_counter() - tic


def _stock_run(model, prompt: list[int], step: int) -> Callable[[], Any]:
    return lambda: generate_step(mx.array(prompt), model, max_tokens=0, sampler=GREEDY, prefill_step_size=step)


def _streamed_run(
    sm: StreamingModel, prompt: list[int], step: int, stats: PrefillStats | None = None
) -> Callable[[], Any]:
    return lambda: plain_steps(sm, prompt, GREEDY, 0, prefill_stats=stats, prefill_step=step)


def _routed_sets(sm: StreamingModel, prompt: list[int], step: int) -> list[set[int]]:
    """The experts each MoE layer routes for `prompt` (prefill and first token), read
    from a fully resident model's route log."""
    for p in sm.pools:
        p.start_route_log()
    try:
        for _ in _streamed_run(sm, prompt, step)():
            pass
        return [
            set(np.unique(np.concatenate([np.array(a).reshape(-1) for a in p.take_route_log()])).tolist())
            for p in sm.pools
        ]
    finally:
        for p in sm.pools:
            p.stop_route_log()


def _union(logged: list[mx.array]) -> set[int]:
    return set(np.unique(np.concatenate([np.array(a).reshape(-1) for a in logged])).tolist()) if logged else set()


def _held(sm: StreamingModel) -> list[set[int]]:
    """What each layer holds in GPU memory: its slot pool's residents, or its mapped pool's GPU share."""
    if sm.mapped_pool is not None:
        return [set(int(e) for e in sm.mapped_pool.on_gpu[i]) for i in range(len(sm.pools))]
    return [set(np.flatnonzero(p.slot_of >= 0).tolist()) for p in sm.pools]


def _counts(sm: StreamingModel) -> dict[str, float]:
    admission = sm.admitter.stats()
    return {
        "read": sum(p.stats.bytes_read for p in sm.pools),
        "staged": sum(p.stats.staged_bytes for p in sm.pools),
        # Everything the read engine delivered: the admitter's reads and the layer-major
        # prefill's reads a layer ahead, which land in the prefetch buffer.
        "disk": sm.reader.stats()["bytes"],
        "to_pool": admission.get("bytes_to_pool", 0),
        "stacked": [p.stats.stacked_layers for p in sm.pools],
    }


def _measure_streamed(
    sm: StreamingModel, prompt: list[int], step: int, routed: list[set[int]] | None
) -> dict[str, Any]:
    held = _held(sm)
    before = _counts(sm)
    mx.reset_peak_memory()
    stats = PrefillStats()
    seconds = _first_token_seconds(_streamed_run(sm, prompt, step, stats))
    after = _counts(sm)
    out: dict[str, Any] = {
        "ttft_s": seconds,
        "prompt_tokens_per_s": len(prompt) / seconds,
        "peak_memory_bytes": mx.get_peak_memory(),
        "read_bytes": after["read"] - before["read"],
        "staged_bytes": after["staged"] - before["staged"],
        "disk_bytes": after["disk"] - before["disk"],
        # The layer-major prefill's own account (its phases' seconds), where it ran.
        "prefill": stats.to_dict() if stats.chunks else {"mode": "chunked"},
    }
    if sm.mapped_pool is not None:
        # A stacked layer brings its experts not in GPU memory over the link; a layer
        # whose kernels read host memory directly is counted by its routing.
        link = 0
        for i, p in enumerate(sm.pools):
            stacked = after["stacked"][i] - before["stacked"][i]
            link += stacked * (p.layer.num_experts - len(held[i])) * p.layer.expert_bytes
        out["link_bytes"] = link
    else:
        out["link_bytes"] = after["to_pool"] - before["to_pool"]
    if routed is not None:
        out["min_bytes"] = sum(len(r - h) * p.layer.expert_bytes for r, h, p in zip(routed, held, sm.pools))
    return out


def _prompts(settings: BenchPrefillSettings, vocab: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(settings.seed)
    return {n: rng.integers(0, vocab, size=n).tolist() for n in settings.prompt_tokens}


def _configurations(settings: BenchPrefillSettings, total_expert_bytes: int) -> list[tuple[str, float, Settings, str]]:
    """(name, capacity, settings, the bandwidth its bound moves at: "", "disk" or "link")."""
    base = {"io_threads": settings.io_threads, "direct_io": True}
    out = [("100%", 1.0, Settings(capacity=1.0, **base), "")]
    for c in sorted(set(settings.capacities) - {1.0}, reverse=True):
        label = f"{c:.0%}"
        if settings.host_cache:
            link = "link" if settings.host_cache >= total_expert_bytes else ""
            tiered = Settings(capacity=c, host_cache=settings.host_cache, **base)
            out.append((f"{label} + host {format_size(settings.host_cache)}", c, tiered, link))
        out.append((f"{label} disk", c, Settings(capacity=c, mapped=False, **base), "disk"))
        if settings.chunked:
            chunked = Settings(capacity=c, mapped=False, prefill="chunk", **base)
            out.append((f"{label} disk, chunk order", c, chunked, "disk"))
    return out


def run_bench_prefill(
    settings: BenchPrefillSettings,
    progress: Callable[[str], None] | None = None,
    on_config: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The report; `on_config(report so far)` after each configuration, so that a run
    cut short still leaves what it measured."""
    say = progress or (lambda line: None)
    done = on_config or (lambda report: None)
    if settings.mlx_memory_limit:
        mx.set_memory_limit(settings.mlx_memory_limit)
    manifest = load_manifest(settings.store)
    config = manifest.config.get("text_config", manifest.config)
    prompts = _prompts(settings, int(config["vocab_size"]))
    step = settings.prefill_step
    warm = (
        np.random.default_rng(settings.seed + 1)
        .integers(0, int(config["vocab_size"]), size=settings.warmup_tokens)
        .tolist()
    )
    say("measuring the store's read rate and the link")
    disk_bw = measure_read_bandwidth(settings.store, settings.io_threads, seed=settings.seed)
    link_bw, link_kind, _ = measure_link_bandwidth()
    report: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "device": str(mx.default_device()),
        "bandwidth": {"disk_bytes_per_s": disk_bw, "link_bytes_per_s": link_bw, "link_kind": link_kind},
        "page_cache": page_cache_reason(settings.store),
        "expert_bytes_total": manifest.expert_bytes_total,
        "configs": [],
    }
    stock_s: dict[int, float] = {}
    if settings.stock:
        say("stock mlx-lm: loading")
        model = load_stock_model(settings.store)
        _first_token_seconds(_stock_run(model, warm, step))
        rows = []
        for n, prompt in prompts.items():
            mx.reset_peak_memory()
            seconds = _first_token_seconds(_stock_run(model, prompt, step))
            stock_s[n] = seconds
            rows.append(
                {
                    "prompt_tokens": n,
                    "ttft_s": seconds,
                    "prompt_tokens_per_s": n / seconds,
                    "peak_memory_bytes": mx.get_peak_memory(),
                }
            )
            say(f"stock: {n} tokens, {seconds:.2f} s")
        report["configs"].append({"name": "stock", "results": rows})
        done(report)
        del model
        gc.collect()
        mx.clear_cache()
    routed: dict[int, list[set[int]]] = {}
    for name, capacity, cfg, moves in _configurations(settings, manifest.expert_bytes_total):
        say(f"{name}: loading")
        sm = load_streaming_model(settings.store, cfg, max_tokens=max(settings.prompt_tokens) + 1)
        try:
            _first_token_seconds(_streamed_run(sm, warm, step))
            rows = []
            for n, prompt in prompts.items():
                if capacity == 1.0:
                    routed[n] = _routed_sets(sm, prompt, step)
                samples = [_measure_streamed(sm, prompt, step, routed.get(n)) for _ in range(settings.runs)]
                row = {"prompt_tokens": n, **samples[-1], "ttft_runs_s": [r["ttft_s"] for r in samples]}
                row["bound_s"], row["bound_why_not"] = _bound(
                    row, stock_s.get(n), moves, disk_bw, link_bw, report["page_cache"]
                )
                row["ratio_to_bound"] = row["ttft_s"] / row["bound_s"] if row["bound_s"] else None
                row["ratio_to_stock"] = row["ttft_s"] / stock_s[n] if n in stock_s else None
                rows.append(row)
                say(f"{name}: {n} tokens, {row['ttft_s']:.2f} s")
            report["configs"].append(
                {
                    "name": name,
                    "capacity": capacity,
                    "slots": sm.capacity,
                    "mapped": sm.mapped_pool is not None,
                    "prefill_order": sm.prefill_note,
                    "results": rows,
                }
            )
            done(report)
        finally:
            sm.close()
            del sm
            gc.collect()
            mx.clear_cache()
    return report


def _bound(
    row: dict[str, Any], stock: float | None, moves: str, disk_bw: float, link_bw: float, page_cache: str | None
) -> tuple[float | None, str | None]:
    if stock is None:
        return None, "no stock run"
    if "min_bytes" not in row:
        return None, "no fully resident run to read the routing from"
    if row["min_bytes"] == 0:
        return stock, None
    if moves == "disk":
        if page_cache:
            return None, f"the store's reads go through the page cache ({page_cache})"
        return stock + row["min_bytes"] / disk_bw, None
    if moves == "link":
        return stock + row["min_bytes"] / link_bw, None
    return None, "a host tier that holds part of the experts: its misses come from the store"


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def format_report(report: dict[str, Any]) -> str:
    bw = report["bandwidth"]
    lines = [
        f"bench prefill on {report['device']}: store read {format_size(bw['disk_bytes_per_s'])}/s, "
        f"link {format_size(bw['link_bytes_per_s'])}/s ({bw['link_kind']})",
        "",
        f"{'configuration':<28} {'tokens':>6} {'TTFT':>8} {'tok/s':>8} {'x stock':>7} {'bound':>8} {'x bound':>7} "
        f"{'read':>9} {'link':>9} {'min':>9} {'peak mem':>9}",
    ]
    for c in report["configs"]:
        for r in c["results"]:
            lines.append(
                f"{c['name']:<28} {r['prompt_tokens']:>6} {r['ttft_s']:>7.2f}s {r['prompt_tokens_per_s']:>8.0f} "
                f"{_fmt(r.get('ratio_to_stock'), '.2f'):>7} {_fmt(r.get('bound_s'), '.2f', 's'):>8} "
                f"{_fmt(r.get('ratio_to_bound'), '.2f'):>7} "
                f"{format_size(r['read_bytes']) if 'read_bytes' in r else '':>9} "
                f"{format_size(r['link_bytes']) if 'link_bytes' in r else '':>9} "
                f"{format_size(r['min_bytes']) if 'min_bytes' in r else '':>9} "
                f"{format_size(r['peak_memory_bytes']):>9}"
            )
    notes = {r["bound_why_not"] for c in report["configs"] for r in c["results"] if r.get("bound_why_not")}
    for note in sorted(notes):
        lines.append(f"bound n/a: {note}")
    if report.get("page_cache"):
        lines.append(f"note: the store's reads go through the page cache ({report['page_cache']})")
    return "\n".join(lines)


def prefill_forecasts(report: dict[str, Any], compute: ComputeProbe) -> list[dict[str, Any]]:
    """The forecast time to first token of every streamed row of a `bench prefill` report,
    with `compute` (`probe_store`)."""
    bw = report["bandwidth"]
    bandwidths = Bandwidths(bw["disk_bytes_per_s"], bw["link_bytes_per_s"], bw["link_kind"], "this run")
    store = Path(report["settings"]["store"])
    host = report["settings"].get("host_cache") or 0
    out = []
    for c in report["configs"]:
        if c.get("capacity") is None:
            continue
        for r in c["results"]:
            n = r["prompt_tokens"]
            config = (c["name"], c["capacity"], host if "host" in c["name"] else 0, bool(c.get("mapped")))
            p = bench_plans(store, [config], bandwidths, n, compute)
            t = p[c["name"]].ttft
            out.append(
                {
                    "name": c["name"],
                    "prompt_tokens": n,
                    "measured_ttft_s": r["ttft_s"],
                    "forecast_ttft_s": t.seconds,
                    "forecast_bound_s": t.bound_seconds,
                    "bound_by": t.bound_by,
                    "measured_vs_forecast": r["ttft_s"] / t.seconds,
                }
            )
    return out


def format_prefill_forecasts(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'forecast (plan)':<28} {'tokens':>6} {'TTFT':>8} {'bound':>8} {'by':>8} {'measured':>9} {'x fcst':>7}"]
    for r in rows:
        lines.append(
            f"{r['name']:<28} {r['prompt_tokens']:>6} {r['forecast_ttft_s']:>7.2f}s {r['forecast_bound_s']:>7.2f}s "
            f"{r['bound_by']:>8} {r['measured_ttft_s']:>8.2f}s {r['measured_vs_forecast']:>7.2f}"
        )
    return "\n".join(lines)
