"""`moestreamctl bench predict`: how well the predictor names the next layer's experts,
and whether prefetching them makes decode faster.

At each capacity of a slot pool (fractions of a layer's experts; 25% and 50% by default;
a mapped pool has no prefetch to measure):

1. recall: one decode with diagnostics on; recall at top-k, top-2k and top-4k (routed
   experts the predictor had named / routed experts), the attribution of every routed
   expert, the compute window and the expert-matmul time per call with prefetch on and
   off (reads must not slow the layer that computes while they run);
2. speed: decode tokens/s with prefetch off and on on the same model, in `rounds` blocks
   of off / on / on / off (so the pool's state and the machine's drift hit both alike):
   the medians, their ratio on/off, the ratio per block with its median and 95%
   interval, and where the host's time per token went (model call, launch, wait); and
   the bytes read from the store per decode token both ways, against the read bandwidth
   measured at the start: where reads are the bound, decode can at most reach that
   bandwidth, which caps what prefetch can gain (`disk`);
3. auto: what `prefetch = auto` decides on this machine, through the generation loop the
   daemon runs.

Every run decodes the same prompt, greedily or sampled with the same seed.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ...shared.settings import Settings, format_size
from ...shared.store_format import load_manifest
from ..model.diagnostics import Recorder
from ..model.generation import SamplingParams, generate
from ..model.streaming_model import StreamingModel, load_streaming_model
from ..planning.bandwidth import measure_read_bandwidth
from ..planning.pool_probe import decode_counters
from .common import default_of, timed_progress
from .decode import (
    BOUND_MIN_MOVE_SHARE,
    format_or_dash,
    host_split_per_token,
    page_cache_reason,
    paired_blocks,
    timed_decode,
)


@dataclass(frozen=True)
class BenchPredictSettings:
    store: Path
    capacities: tuple[float, ...] = (0.25, 0.5)
    prompt_tokens: int = 32
    decode_tokens: int = 64
    rounds: int = 3
    policy: str = default_of("policy")
    io_threads: int = default_of("io_threads")
    host_cache: int = default_of("host_cache")
    temp: float = 0.0
    seed: int = 0
    mlx_memory_limit: int | None = None
    # The CUDA copier copies with its copy kernel (Settings.copy_kernel, on by default).
    copy_kernel: bool = default_of("copy_kernel")
    # Blocks of the copy kernels that copy ahead of use (Settings.prefetch_copy_blocks).
    prefetch_copy_blocks: int = default_of("prefetch_copy_blocks")
    # MoE layers ahead whose experts the slot pool's prefetch reads (Settings.prefetch_depth).
    depth: int = default_of("prefetch_depth")
    # Bytes of the slot pool's prefetch buffer (Settings.prefetch_buffer; 0: the default).
    prefetch_buffer: int = default_of("prefetch_buffer")


def _decode(
    sm: StreamingModel,
    prompt: list[int],
    steps: int,
    temp: float,
    seed: int,
    split: dict[str, float] | None = None,
    disk: list[int] | None = None,
) -> float:
    """Seconds of `steps` decode steps after the prompt, with mlx-lm's pipelining (the
    loop of `bench decode`, which also fills `split`). `disk`, where given, gets the
    bytes read from the store during the decode steps appended: the pools' demand reads
    and the prefetcher's reads, counted as they complete (so a read the prompt started
    and the first step finished counts, and one still running at the end does not)."""
    before: dict[str, float] = {}
    snapshot = (lambda: before.update(decode_counters(sm))) if disk is not None else None
    seconds = timed_decode(sm.model, prompt, steps, temp, seed, after_prefill=snapshot, split=split)[0]
    if disk is not None:
        after = decode_counters(sm)
        disk.append(int(sum(after[k] - before[k] for k in ("bytes_from_disk", "prefetch_bytes_read"))))
    return seconds


def _diagnosed(sm: StreamingModel, prompt: list[int], settings: BenchPredictSettings, prefetch: bool) -> dict[str, Any]:
    sm.prefetcher.switch(prefetch)
    rec = Recorder()
    copier = getattr(sm.admitter, "copier", None)
    before = copier.counters() if copier is not None else None
    with sm.diagnostics.recording(rec):
        _decode(sm, prompt, settings.decode_tokens, settings.temp, settings.seed)
    out = rec.to_dict()
    if copier is not None:
        out["copier"] = _copier_per_forward(before, copier.counters(), settings)
    return out


def _copier_per_forward(
    before: dict[str, Any], after: dict[str, Any], settings: BenchPredictSettings
) -> dict[str, Any]:
    """The CUDA copier's work per forward: copy calls, spans and copy-kernel launches,
    and the host ms spent reading spans and exporting buffers (bind), queuing (enqueue)
    and waiting (wait); and why the driver refused the copy kernel, if it did."""
    forwards = settings.decode_tokens + 1
    # Counters are numbers, except kernel_error (why the driver refused the kernel).
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    return {
        "calls": d["calls"] / forwards,
        "spans": d["spans"] / forwards,
        "kernel_launches": d["kernel_launches"] / forwards,
        "bind_ms": 1e3 * d["bind_seconds"] / forwards,
        "enqueue_ms": 1e3 * d["enqueue_seconds"] / forwards,
        "wait_ms": 1e3 * d["wait_seconds"] / forwards,
        "us_per_span": 1e6 * (d["bind_seconds"] + d["enqueue_seconds"]) / d["spans"] if d["spans"] else None,
        "kernel_error": after.get("kernel_error") or None,
    }


def _warm_up(sm: StreamingModel, prompt: list[int], settings: BenchPredictSettings) -> None:
    """One decode each way before anything is timed: kernels compiled (on CUDA the first
    calls JIT-compile them), a host tier filled, prediction's reads done once. Without it
    the first timed run pays for all of that."""
    for enabled in (True, False):
        sm.prefetcher.switch(enabled)
        _decode(sm, prompt, settings.decode_tokens, settings.temp, settings.seed)


def _speeds(
    sm: StreamingModel, prompt: list[int], settings: BenchPredictSettings, say: Callable[[str], None]
) -> dict[str, Any]:
    """Decode tokens/s with prefetch off and on, in `rounds` blocks of off / on / on / off
    (so that a drift of the machine within a block hits both alike): the medians of
    each, the ratio on/off per block (`paired`, with rounds >= 2), the host's time per
    token (model call, launch, wait; `bench decode`'s split) and the bytes read from the
    store per token, median over the decodes."""
    speeds: dict[bool, list[float]] = {False: [], True: []}
    splits: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    disk: dict[bool, list[int]] = {False: [], True: []}

    def run(enabled: bool):
        def decode() -> dict[str, float]:
            sm.prefetcher.switch(enabled)
            split: dict[str, float] = {}
            tps = settings.decode_tokens / _decode(
                sm, prompt, settings.decode_tokens, settings.temp, settings.seed, split, disk[enabled]
            )
            speeds[enabled].append(tps)
            splits[enabled].append(host_split_per_token(split, settings.decode_tokens))
            return {"tokens_per_s": tps}

        return decode

    def on_block(blocks: list[dict[str, float]], ratios: list[float]) -> None:
        say(
            f"speed block {len(blocks)}/{settings.rounds}: off {blocks[-1]['stock_tokens_per_s']:.1f} tok/s, "
            f"on {blocks[-1]['tokens_per_s']:.1f} ({ratios[-1]:.2f}x)"
        )

    if settings.rounds >= 2:
        paired = paired_blocks(run(False), run(True), settings.rounds, on_block)
    else:
        paired = None
        run(False)()
        run(True)()
        say(f"speed: off {speeds[False][0]:.1f} tok/s, on {speeds[True][0]:.1f}")
    host = {
        f"prefetch_{'on' if enabled else 'off'}": {
            k: statistics.median(s[k] for s in splits[enabled]) for k in splits[enabled][0]
        }
        for enabled in (False, True)
    }
    return {
        "tps": {k: statistics.median(v) for k, v in speeds.items()},
        "paired": paired,
        "host": host,
        "on_decodes": len(speeds[True]),
        "disk_bytes_per_token": {k: statistics.median(v) / settings.decode_tokens for k, v in disk.items()},
    }


def disk_figures(
    tps: dict[bool, float],
    disk_bytes_per_token: dict[bool, float],
    read_bandwidth: float,
    page_cache: str | None = None,
) -> dict[str, Any]:
    """Decode against the store's read bandwidth, prefetch off (False) and on (True):
    bytes read per token, the tokens/s that reading them alone would allow (`bound`), the
    share of that bound reached (also the share of a token that reading its bytes at
    that bandwidth takes), and `speedup_ceiling`: the on/off ratio if decode with
    prefetch ran at the read bandwidth, every other cost hidden (None where prefetch
    read nothing from the store: a host tier served it).

    `bound_applies` says whether the read bound means anything here; where not,
    `bound_why_not` says why: "no_reads" (nothing read), "page_cache" (`page_cache` says
    why the store was read through the page cache, whose speed the bandwidth does not
    give) or "few_reads" (reading takes under BOUND_MIN_MOVE_SHARE of a token both ways,
    so the bound, and the ceiling taken from it, lie far above any speed that compute
    allows)."""

    def bound(nbytes: float) -> float | None:
        return read_bandwidth / nbytes if nbytes > 0 else None

    out: dict[str, Any] = {"read_bandwidth_bytes_per_s": read_bandwidth}
    for enabled in (False, True):
        way = f"prefetch_{'on' if enabled else 'off'}"
        b = bound(disk_bytes_per_token[enabled])
        out[way] = {
            "bytes_per_token": disk_bytes_per_token[enabled],
            "bound_tokens_per_s": b,
            "of_bound": tps[enabled] / b if b else None,
        }
    b_on = out["prefetch_on"]["bound_tokens_per_s"]
    out["speedup_ceiling"] = b_on / tps[False] if b_on else None
    share = max(out[way]["of_bound"] or 0.0 for way in ("prefetch_off", "prefetch_on"))
    if share == 0:
        out["bound_why_not"] = "no_reads"
    elif page_cache is not None:
        out["bound_why_not"] = "page_cache"
    elif share < BOUND_MIN_MOVE_SHARE:
        out["bound_why_not"] = "few_reads"
    else:
        out["bound_why_not"] = None
    out["bound_applies"] = out["bound_why_not"] is None
    out["page_cache"] = page_cache
    return out


def _paired_fields(speeds: dict[str, Any]) -> dict[str, Any]:
    """A result's speed fields from `_speeds`."""
    tps, paired = speeds["tps"], speeds["paired"]
    return {
        "tokens_per_s_off": tps[False],
        "tokens_per_s_on": tps[True],
        # The ratio of the medians, and the median of the ratios per block with the 95%
        # interval of their geometric mean.
        "speedup": tps[True] / tps[False],
        "speedup_paired": paired["median"] if paired else None,
        "speedup_interval_95": paired["interval_95"] if paired else None,
        "speedup_per_block": paired["ratios"] if paired else None,
        # Where the host's time per token went with prefetch off and on.
        "host_ms_per_token": speeds["host"],
    }


def _load(settings: BenchPredictSettings, capacity: float, **pool: Any) -> StreamingModel:
    """The model at `capacity` with prefetch on; `pool` names the kind of pool."""
    return load_streaming_model(
        settings.store,
        Settings(
            capacity=capacity,
            policy=settings.policy,
            io_threads=settings.io_threads,
            prefetch="on",
            prefetch_copy_blocks=settings.prefetch_copy_blocks,
            prefetch_depth=settings.depth,
            prefetch_buffer=settings.prefetch_buffer,
            **pool,
        ),
        max_tokens=settings.prompt_tokens + settings.decode_tokens + 512,
    )


def _speed_stage(settings: BenchPredictSettings) -> str:
    """The progress line that starts the timed decodes."""
    if settings.rounds >= 2:
        return f"speed: {settings.rounds} blocks of decodes with prefetch off / on / on / off"
    return "speed: one decode with prefetch off, one on"


def _capacity_run(
    settings: BenchPredictSettings,
    capacity: float,
    prompt: list[int],
    read_bandwidth: float,
    page_cache: str | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    sm = _load(settings, capacity, host_cache=settings.host_cache, mapped=False, copy_kernel=settings.copy_kernel)
    try:
        if sm.prefetcher is None:
            raise ValueError(f"capacity {capacity:g}: every expert fits in the pool, so there is nothing to prefetch")
        say("warm-up: one decode with prefetch on and one off")
        _warm_up(sm, prompt, settings)
        say("recall: one diagnosed decode with prefetch on and one off")
        on = _diagnosed(sm, prompt, settings, True)
        off = _diagnosed(sm, prompt, settings, False)
        say(f"recall at top-k {format_or_dash(on['recall'].get('decode', {}).get('top_k'), '.3f')}")
        say(_speed_stage(settings))
        speeds = _speeds(sm, prompt, settings, say)
        say("auto: the generation loop with prefetch = auto until it decides")
        auto = _auto(sm, prompt, settings)
        say(f"auto decided {auto['decision']}")
        pf = sm.prefetcher.stats()
        pools = sm.pool_stats()
    finally:
        sm.close()
    return {
        "capacity": capacity,
        "slots": sm.capacity,
        "pool": "slots",
        "recall": on["recall"],
        "attribution": on["attribution"],
        "window_ms": on["window"]["mean_ms"],
        "read_wait_ms_per_call": on["read_wait"]["mean_ms"],
        "matmul_ms_per_call": {
            "prefetch_on": on["segments"]["matmul"]["mean_ms"],
            "prefetch_off": off["segments"]["matmul"]["mean_ms"],
        },
        "host_ms_per_call": {k: v["mean_ms"] for k, v in on["host"].items()},
        # Where a diagnosed run's time went: each segment's seconds summed over the MoE
        # layers, per forward (prompt and decode steps), with prefetch on and off.
        "segment_ms_per_forward": {
            name: _per_forward(run, settings) for name, run in (("prefetch_on", on), ("prefetch_off", off))
        },
        # Where the CUDA copier's host time goes (absent without it).
        "copier_per_forward": {name: run.get("copier") for name, run in (("prefetch_on", on), ("prefetch_off", off))},
        **_paired_fields(speeds),
        "disk": disk_figures(speeds["tps"], speeds["disk_bytes_per_token"], read_bandwidth, page_cache),
        "auto": auto,
        "prefetch": {
            k: pf[k]
            for k in (
                "submitted",
                "promoted",
                "waited",
                "dropped_unused",
                "no_room",
                "used_fraction",
                "buffer_experts",
                "buffer_bytes",
            )
        },
        # With a host tier, predicted experts it holds are copied straight into the next
        # layer's slots (no read): how many, how many were then routed, and the seconds
        # layers waited for those copies.
        "prestaged": {
            "experts": pools.prestaged,
            "used": pools.prestaged_used,
            "wait_seconds": pools.admission.get("prestage_wait_seconds", 0.0),
        },
    }


def _per_forward(diagnosed: dict[str, Any], settings: BenchPredictSettings) -> dict[str, float]:
    forwards = settings.decode_tokens + 1  # the prompt's forward and each decode step
    return {k: 1e3 * v["seconds"] / forwards for k, v in diagnosed["segments"].items()}


def _auto(sm: StreamingModel, prompt: list[int], settings: BenchPredictSettings) -> dict[str, Any]:
    """Run the daemon's generation loop with `prefetch = auto` until the governor decides."""
    governor = sm.prefetcher.start_auto()
    needed = 2 * governor.trials * governor.window
    # Sampled even when the bench is greedy: a request that ends on an end-of-sequence
    # token before the governor decides is then followed by a different one.
    params = SamplingParams(max_tokens=needed + 2, temp=settings.temp if settings.temp else 1.0, seed=settings.seed)
    for attempt in range(8):  # a request can end early on an end-of-sequence token
        generate(sm, prompt, SamplingParams(**{**params.__dict__, "seed": settings.seed + attempt}))
        if governor.decided:
            break
    return governor.to_dict()


def _prefixed(say: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    """`say` with `prefix` before every line (the capacity a stage belongs to)."""
    return lambda line: say(prefix + line)


def _read_bandwidth(settings: BenchPredictSettings, manifest: Any) -> float:
    """What decode could read from the store per second at best, for the bound of the
    reads it makes: random whole-expert reads through the engine at the bench's thread
    count, about 512 MB three times, the fastest (a shared disk's rate wanders by a third
    between probes of 128 reads)."""
    expert_bytes = max(manifest.layers[0].expert_bytes, 1) if manifest.layers else 1 << 20
    samples = min(max(128, (512 << 20) // expert_bytes), 4096)
    return max(
        measure_read_bandwidth(settings.store, settings.io_threads, samples=samples, seed=settings.seed + i)
        for i in range(3)
    )


def run_bench_predict(settings: BenchPredictSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure every capacity; `progress` gets a line as each stage starts and ends (as
    `bench decode`'s does), so that a long run shows where it is."""
    say = timed_progress(progress)
    if settings.mlx_memory_limit:
        mx.set_memory_limit(settings.mlx_memory_limit)
    manifest = load_manifest(settings.store)
    config = manifest.config
    vocab = config.get("text_config", config)["vocab_size"]
    rng = random.Random(settings.seed)
    prompt = [rng.randrange(vocab) for _ in range(settings.prompt_tokens)]
    say("measuring the store's read bandwidth")
    read_bandwidth = _read_bandwidth(settings, manifest)
    page_cache = page_cache_reason(settings.store)
    say(f"read {format_size(read_bandwidth)}/s{' through the page cache' if page_cache else ''}")
    results = []
    for c in settings.capacities:
        say(f"capacity {c:.0%} (slot pool): loading the model")
        at = _prefixed(say, f"capacity {c:.0%}: ")
        results.append(_capacity_run(settings, c, prompt, read_bandwidth, page_cache, at))
        say(
            f"capacity {c:.0%}: done, decode {results[-1]['tokens_per_s_off']:.1f} tok/s with prefetch off, "
            f"{results[-1]['tokens_per_s_on']:.1f} on"
        )
    return {
        "store": str(settings.store),
        "model_type": manifest.model_type,
        "moe_layers": len(manifest.layers),
        "experts_per_layer": manifest.layers[0].num_experts if manifest.layers else 0,
        "device": str(mx.default_device()),
        "prompt_tokens": settings.prompt_tokens,
        "decode_tokens": settings.decode_tokens,
        "rounds": settings.rounds,
        "temp": settings.temp,
        "policy": settings.policy,
        "host_cache": settings.host_cache,
        "prefetch_depth": settings.depth,
        "prefetch_buffer": settings.prefetch_buffer,
        "read_bandwidth_bytes_per_s": read_bandwidth,
        # Why the store was read through the page cache (None: direct I/O).
        "read_page_cache": page_cache,
        "copy_kernel": settings.copy_kernel,
        "prefetch_copy_blocks": settings.prefetch_copy_blocks,
        "results": results,
    }


def format_report(report: dict[str, Any]) -> str:
    num = format_or_dash
    lines = [
        f"{report['model_type']}: {report['moe_layers']} MoE layers x {report['experts_per_layer']} experts on "
        f"{report['device']}, {report['decode_tokens']} decode tokens (temp {report['temp']}), median of "
        f"{report['rounds']}"
        f"{' blocks off/on/on/off' if report['rounds'] >= 2 else ''}, "
        f"prefetch depth {report.get('prefetch_depth', 1)}",
        f"{'capacity':>8} {'recall@k':>8} {'@2k':>6} {'@4k':>6} {'off tok/s':>9} {'on tok/s':>9} {'on/off':>6} "
        f"{'paired':>6} "
        f"{'window ms':>9} {'mm on/off ms':>13}  auto",
    ]
    for r in report["results"]:
        rc = r["recall"]["decode"]
        mm = r["matmul_ms_per_call"]
        lines.append(
            f"{r['capacity']:>8.0%} {num(rc['top_k'], '8.3f')} {num(rc['top_2k'], '6.3f')} {num(rc['top_4k'], '6.3f')} "
            f"{r['tokens_per_s_off']:>9.1f} {r['tokens_per_s_on']:>9.1f} {r['speedup']:>6.2f} "
            f"{num(r.get('speedup_paired'), '6.2f')} "
            f"{num(r['window_ms'], '9.3f')} {num(mm['prefetch_on'], '6.3f')}/{num(mm['prefetch_off'], '6.3f')}  "
            f"{r['auto']['decision']}"
        )
    for r in report["results"]:
        iv = r.get("speedup_interval_95")
        host = r.get("host_ms_per_token")
        if host:
            parts = [
                f"{name[len('prefetch_') :]} {h['host_call_ms_per_token']:.2f}/{h['host_launch_ms_per_token']:.2f}/"
                f"{h['host_wait_ms_per_token']:.2f}"
                for name, h in host.items()
            ]
            lines.append(
                f"{r['capacity']:>8.0%} host ms per token, model call/launch/wait: {', '.join(parts)}"
                + (f"; on/off per block: 95% interval {iv[0]:.2f}-{iv[1]:.2f}" if iv else "")
            )
        disk = r.get("disk")
        if disk:
            lines.append(f"{r['capacity']:>8.0%} {_disk_line(disk)}")
        pf = r.get("prefetch")
        if pf and pf["submitted"] and "buffer_experts" in pf:  # older reports lack the buffer
            lines.append(f"{r['capacity']:>8.0%} {_buffer_line(pf)}")
    return "\n".join(lines)


# Unrouted reads dropped beyond this share of prefetch's reads cost disk time that a
# larger buffer gives back (the H200 at depth 2: 11% with 256 experts, none with 4 GB).
_DROPPED_HINT_SHARE = 0.05


def _disk_line(disk: dict[str, Any]) -> str:
    """The reads per token against the read bound, or why that bound does not apply
    (`disk_figures`; reports from before bound_why_not always take the bound)."""
    off, on = disk["prefetch_off"], disk["prefetch_on"]
    line = (
        f"read from the store per token off/on: {format_size(off['bytes_per_token'])}/"
        f"{format_size(on['bytes_per_token'])} at {format_size(disk['read_bandwidth_bytes_per_s'])}/s: "
    )
    why = disk.get("bound_why_not")
    if why == "no_reads":
        return line + "nothing read (a host tier served the pool), so no read bound"
    if why == "page_cache":
        return line + (
            f"the store was read through the page cache ({disk['page_cache']}), whose speed that "
            f"bandwidth does not give, so no read bound"
        )
    if why == "few_reads":
        share = max(off["of_bound"] or 0.0, on["of_bound"] or 0.0)
        return line + (
            f"reading them takes {share:.1%} of a token at that bandwidth, so no read bound applies "
            f"(under {BOUND_MIN_MOVE_SHARE:.0%}: the disk's bandwidth is not what limits decode here)"
        )
    num = format_or_dash
    return line + (
        f"of that bound off {num(off['of_bound'], '.2f')}, on {num(on['of_bound'], '.2f')}; "
        f"prefetch could give at most {num(disk['speedup_ceiling'], '.2f')}x"
    )


def _buffer_line(pf: dict[str, Any]) -> str:
    dropped = pf["dropped_unused"] / pf["submitted"]
    line = (
        f"prefetch buffer {pf['buffer_experts']} experts ({format_size(pf['buffer_bytes'])}): "
        f"{dropped:.1%} of its reads dropped before any token routed them"
    )
    if dropped > _DROPPED_HINT_SHARE:
        line += "; a larger --prefetch-buffer keeps them for a later token"
    return line
