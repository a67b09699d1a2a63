"""`moestreamctl bench decode`: decode speed of stock mlx-lm, moestream at each pool
capacity (with and without the host-RAM tier), and the naive on-demand baseline,
measured side by side in one run.

Every configuration decodes the same prompt for the same number of tokens, greedily or
sampled with the same seed (random-weight models decode greedily into loops of repeated
tokens, which routes far more regularly than a real model; sampling at temperature 1
does not). The configurations take turns, `rounds` times, so drift of the machine hits
all alike; the medians are reported. The bound for a configuration is the speed it would
reach if moving its bytes cost exactly what the measured bandwidths say, on top of fully
resident compute:

    1 / (1/tps_resident + disk_bytes_per_token / read_bandwidth
                        + host_to_pool_bytes_per_token / link_bandwidth)

where the link bandwidth is the pinned host->GPU copy rate (CUDA) or the host's memcpy
rate (CPU, unified memory), both measured in the same run. A mapped pool's link bytes are
its routed experts not in GPU memory (and its moves).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import mlx.core as mx
import psutil
from mlx_lm.models.cache import make_prompt_cache

from ..._native import ReadEngine
from ...shared.heat_file import peek_usage, usage_path
from ...shared.settings import Settings, format_size
from ...shared.store_format import Manifest, load_manifest
from ..mapped.row_gather import RowGather
from ..model.generation import SamplingParams, generate
from ..model.streaming_model import choose_mapped, load_stock_model, load_streaming_model
from ..planning.bandwidth import measure_layer_reads, measure_link_bandwidth, measure_read_bandwidth, settle_writes
from ..planning.plan import (
    TTFT_PROMPT_TOKENS,
    Bandwidths,
    ComputeProbe,
    Plan,
    _duration,
    heat_counts,
    heat_reuse,
    make_plan,
    probe_compute,
    probe_pools_of,
)
from ..planning.pool_probe import PoolProbe, decode_counters
from ..planning.probe_models import resident_dtype
from ..pool.admission import Admitter, cuda_copier, make_admitter
from ..pool.expert_reader import ExpertReader
from .common import default_of, timed_progress

# With fresh text, round r's decodes seed from seed + (r + 1) * this (warm-ups below 0).
FRESH_SEED_STRIDE = 1000


class LayerClock:
    """Host time of each MoE layer's forward, as `bench decode` reports it: the forward's
    time less the time in MLX's evaluations it starts (its sync, which waits for what
    was queued before; the launch of its experts, which on the CPU encodes each op on
    the host, as stock's launch of the whole token does): the Python a layer costs and
    the graph it builds. Both on the wall clock and as the thread's CPU time, which a
    machine shared with other work does not stretch. Off (the hub's `clock` None) the
    layers read one attribute and time nothing."""

    __slots__ = ("samples", "cpu_samples", "_wall", "_cpu", "_waited", "_waited_cpu")

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.cpu_samples: list[float] = []
        self._wall = self._cpu = self._waited = self._waited_cpu = 0.0

    def start(self) -> None:
        """A layer's forward begins."""
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self._waited = self._waited_cpu = 0.0

    def stop(self) -> None:
        """It ends: one sample of each clock."""
        self.samples.append(time.perf_counter() - self._wall - self._waited)
        self.cpu_samples.append(time.thread_time() - self._cpu - self._waited_cpu)

    def evaluate(self, run: Any, arrays: Sequence[mx.array]) -> None:
        """`run(*arrays)` (mx.eval or mx.async_eval), its time left out of the forward's."""
        wall, cpu = time.perf_counter(), time.thread_time()
        run(*arrays)
        self._waited += time.perf_counter() - wall
        self._waited_cpu += time.thread_time() - cpu

    def take(self) -> tuple[list[float], list[float]]:
        """The wall and CPU samples since the last take, in seconds."""
        out = self.samples, self.cpu_samples
        self.samples, self.cpu_samples = [], []
        return out


def constrained_schema(decode_tokens: int) -> dict[str, Any]:
    """The `constrained` runs' schema: records of a string, a number and a flag, as an
    API's structured output asks, in a list too long to end (and so to stop the decode)
    within `decode_tokens`; its strings keep the grammar's masks as wide as free text."""
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "count", "ok"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": item, "minItems": decode_tokens}


@dataclass(frozen=True)
class BenchDecodeSettings:
    store: Path
    capacities: tuple[float, ...] = (1.0, 0.5, 0.25)
    prompt_tokens: int = 32
    decode_tokens: int = 64
    rounds: int = 3
    policy: str = default_of("policy")
    io_threads: int = default_of("io_threads")
    stock: bool = True
    naive: bool = True
    # The slot pool at each capacity (off: only its "+host" and "+mapped" variants).
    slot_pool: bool = True
    seed: int = 0
    mlx_memory_limit: int | None = None
    # Bytes of the host-RAM tier; > 0 adds a "+host" configuration per partial capacity,
    # made as the daemon would make it: where the tier holds every expert and the loader
    # makes it a mapped pool (`choose_mapped`), "+host" is that mapped pool and
    # "+host:slots" the slot pool with the tier beside it.
    host_cache: int = default_of("host_cache")
    # "auto" makes "+host" as just said; "mapped" or "slots" makes it that way.
    host_tier: str = "auto"
    # 0 decodes greedily; > 0 samples at this temperature (same seed for every config).
    temp: float = 0.0
    # Sampled decodes draw new text every decode (the n-th decode of a round seeds with
    # the round's seed + n, the same for every configuration) instead of one text again:
    # a partial pool replaying one sequence keeps its experts, and hits more than it
    # would on text it has not seen (`plan`'s forecast assumes the latter).
    fresh_text: bool = False
    # Adds a "+mapped" configuration per partial capacity (daemon/mapped/mapped_pool.py).
    mapped: bool = False
    # Prefetch in the partial slot pools: "on" or "off" (the daemon's "auto" measures
    # both while it serves, which would mix the two into one configuration's figures).
    # Mapped pools have no prefetch.
    prefetch: str = "on"
    # Tokens between rebalances of the "+mapped" configurations (Settings).
    mapped_rebalance_tokens: int = default_of("mapped_rebalance_tokens")
    # The CUDA copier copies with its copy kernel (Settings.copy_kernel, on by default).
    copy_kernel: bool = default_of("copy_kernel")
    # A mapped pool's decode steps copy the routed experts into a stack first
    # (Settings.mapped_gather): one configuration per value, ":g" marks those that do;
    # None is the setting's auto.
    mapped_gather: tuple[bool | None, ...] = (default_of("mapped_gather"),)
    # Blocks of the copy kernels that copy ahead of use (Settings.prefetch_copy_blocks).
    prefetch_copy_blocks: int = default_of("prefetch_copy_blocks")
    # Untimed runs of every configuration before the timed rounds; more than one lets a
    # mapped pool's rebalance (every mapped_rebalance_tokens) happen before timing.
    warmup_rounds: int = 1
    # A configuration's round repeats its decode until this many seconds of decoding
    # have passed (0: once). Fast configurations then time seconds instead of a few
    # hundred milliseconds, which one hiccup of a shared machine skews; slow ones still
    # decode once.
    min_round_seconds: float = 0.0
    # Also time each streaming configuration (but the naive reader) through the daemon's
    # own generation loop (`generate`, in process, without the socket): mlx-lm's
    # generate_step with the daemon's sampling, counters and placement ticks around it.
    generation_loop: bool = False
    # Also time each streaming configuration (but the naive reader) through the daemon's
    # generation loop twice per round, side by side: a json_schema request
    # (`CONSTRAINED_SCHEMA`, masked by its grammar: daemon/model/constrain.py) and the
    # same request unconstrained: the cost of structured output.
    constrained: bool = False
    # After the rounds, stock and each fully resident configuration also decode in this
    # many blocks of four, A B B A (stock, it, it, stock). On the H200 decode is bound by
    # the host, whose speed swings by up to 1.5x from one second to the next
    # (tests/bench/results/probes/full_residency_q30_h200.json); a drift within a block
    # cancels, so the ratio per block measures the code, not the moment.
    paired_blocks: int = 0
    # Each partial slot pool also with every read verified against the manifest's
    # checksums (the bench knob verify_checksums), as "+crc"; with paired_blocks, paired
    # against the same pool without.
    checksums: bool = False
    # Each partial slot pool also on the per-layer path (a host sync at every MoE layer,
    # daemon/model/streaming_moe.py `_decode`) instead of the optimistic forwards that
    # check every few layers (daemon/model/optimistic.py), as ":per-layer"; with
    # paired_blocks, paired against the same pool optimistic.
    per_layer: bool = False


@dataclass
class Config:
    name: str
    capacity: float | None
    run: Callable[[int], dict[str, Any]]  # one decode sampled with this seed
    close: Callable[[], None]
    samples: list[dict[str, Any]] = field(default_factory=list)
    # The same configuration through the daemon's generation loop (generation_loop).
    run_generate: Callable[[int], dict[str, Any]] | None = None
    generate_samples: list[dict[str, Any]] = field(default_factory=list)
    # Where it keeps experts in host memory besides the store: "mapped", "slots" or None.
    host_tier: str | None = None
    # An unconstrained and a json_schema request through the generation loop (constrained).
    run_constrained: Callable[[int], dict[str, Any]] | None = None
    constrained_samples: list[dict[str, Any]] = field(default_factory=list)


def timed_decode(
    model,
    prompt: list[int],
    steps: int,
    temp: float,
    seed: int,
    after_prefill: Callable[[], None] | None = None,
    after_token: Callable[[], None] | None = None,
    split: dict[str, float] | None = None,
) -> tuple[float, list[int]]:
    """Decode with mlx-lm's pipelining (step n+1 queued before n is read); returns the
    seconds of the decode steps alone. `split`, where given, gets the host's seconds in
    the model's call (building the graph, and any host sync a layer makes), in launching
    the graph (`mx.async_eval`) and in waiting for the previous token: on a GPU, where the
    wait is near zero, decode is bound by the host, not by the device. (MLX's CPU
    backend computes within the launch, so there the split says little.)"""

    def pick(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1) if temp == 0 else mx.random.categorical(logits * (1.0 / temp))

    mx.random.seed(seed)
    cache = make_prompt_cache(model)
    y = pick(model(mx.array(prompt)[None], cache=cache)[:, -1, :])
    mx.eval(y)
    if after_prefill is not None:
        after_prefill()
    tokens = []
    call = launch = wait = 0.0
    tic = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        next_y = pick(model(y[None], cache=cache)[:, -1, :])
        t1 = time.perf_counter()
        mx.async_eval(next_y)
        t2 = time.perf_counter()
        tokens.append(int(y.item()))
        t3 = time.perf_counter()
        call, launch, wait = call + t1 - t0, launch + t2 - t1, wait + t3 - t2
        if after_token is not None:
            after_token()
        y = next_y
    mx.eval(y)
    seconds = time.perf_counter() - tic
    if split is not None:
        split.update(call_s=call, launch_s=launch, wait_s=wait)
    return seconds, tokens


def host_split_per_token(split: dict[str, float], steps: int) -> dict[str, float]:
    """A decode's `split` as milliseconds per token (the rows' host_*_ms_per_token)."""
    return {
        "host_call_ms_per_token": 1e3 * split["call_s"] / steps,
        "host_launch_ms_per_token": 1e3 * split["launch_s"] / steps,
        "host_wait_ms_per_token": 1e3 * split["wait_s"] / steps,
    }


def layer_host_us(samples: tuple[list[float], list[float]]) -> dict[str, float | None]:
    """The median and 99th percentile of a decode's per-layer host times (LayerClock's
    wall and CPU samples), in microseconds: the rows' host_us_per_layer_* and
    host_cpu_us_per_layer_*."""
    out: dict[str, float | None] = {}
    for key, values in zip(("host_us_per_layer", "host_cpu_us_per_layer"), samples):
        us = sorted(1e6 * s for s in values)
        out[f"{key}_median"] = statistics.median(us) if us else None
        out[f"{key}_p99"] = us[min(len(us) - 1, math.ceil(0.99 * len(us)) - 1)] if us else None
    return out


def _streaming_config(
    name: str,
    capacity: float | None,
    settings: BenchDecodeSettings,
    prompt: list[int],
    naive: bool = False,
    admitter: Admitter | None = None,
    mapped: bool = False,
    mapped_gather: bool = False,
    host_cache: int = 0,
    verify: bool = False,
    per_layer: bool = False,
) -> Config:
    sm = load_streaming_model(
        settings.store,
        Settings(
            capacity=capacity,
            policy=settings.policy,
            io_threads=settings.io_threads,
            prefetch=settings.prefetch,
            host_cache=host_cache,
            mapped_rebalance_tokens=settings.mapped_rebalance_tokens,
            copy_kernel=settings.copy_kernel,
            mapped_gather=mapped_gather,
            prefetch_copy_blocks=settings.prefetch_copy_blocks,
            verify_checksums=verify,
        ),
        naive=naive,
        admitter=admitter,
        mapped=mapped,
    )
    if per_layer and sm.optimistic is not None:
        sm.optimistic.force(False)
    # What the daemon's generation loop does after each token (the routing of the fully
    # resident pools read back: a mapped pool's placement, or a full pool's counts).
    readback = sm.routing_readback()
    tick = readback.tick if readback is not None else None
    expert_bytes = sm.manifest.layers[0].expert_bytes
    # Where the configuration keeps experts in host memory besides the store's files.
    host_tier = "mapped" if sm.mapped_pool is not None else "slots" if admitter is not None or host_cache else None

    def run(seed: int) -> dict[str, Any]:
        before: dict[str, float] = {}
        split: dict[str, float] = {}
        # Each MoE layer's host time in the decode steps (not the prefill's).
        clock = LayerClock()

        def decode_starts() -> None:
            nonlocal redos_before
            before.update(decode_counters(sm))
            redos_before = sm.optimistic.redos if sm.optimistic is not None else 0
            clock.take()

        redos_before = 0

        with sm.diagnostics.clocked(clock):
            seconds, tokens = timed_decode(
                sm.model, prompt, settings.decode_tokens, settings.temp, seed, decode_starts, tick, split
            )
        layer_host = clock.take()
        if sm.mapped_pool is not None:
            sm.mapped_pool.drain()  # moves still running would slow the next configuration
        after = decode_counters(sm)
        d = {k: after[k] - before[k] for k in before}
        redos = sm.optimistic.redos - redos_before if sm.optimistic is not None else 0
        n = settings.decode_tokens
        hits, misses = d["hits_decode"], d["misses_decode"]
        tier = d["tier_hits"] + d["tier_misses"]
        # Prefetched experts cross the link too: copied ahead from the tier while the
        # GPU computes, or promoted from the prefetcher's buffer (read from disk).
        link_bytes = d["bytes_to_pool"] + d["prestage_bytes"] + d["prefetch_promoted"] * expert_bytes
        disk_bytes = d["bytes_from_disk"] + d["prefetch_bytes_read"]
        if sm.mapped_pool is not None:
            # Routed experts that were in GPU memory; the kernels read the rest over the
            # link, and each move to GPU memory copies one expert over it too.
            hits, misses = d["placed_on_gpu"], d["placed_routed"] - d["placed_on_gpu"]
            link_bytes = (misses + d["placement_moves"]) * expert_bytes
        return {
            "tokens_per_s": n / seconds,
            "tokens": tokens,
            "host_tier": host_tier,
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "tier_hit_rate": d["tier_hits"] / tier if tier else None,
            "disk_bytes_per_token": disk_bytes / n,
            "prefetch_promoted_per_token": d["prefetch_promoted"] / n,
            "host_to_pool_bytes_per_token": link_bytes / n,
            "admission_bytes_per_s": d["bytes_to_pool"] / d["copy_seconds"] if d["copy_seconds"] > 0 else None,
            "host_syncs_per_token": d["host_syncs"] / n + 1,
            # Every sync a token waits for: the layers' read-backs, the waits for the
            # streams before slots are written, and the sampled token.
            "syncs_per_token": (d["host_syncs"] + d["quiesces"]) / n + 1,
            # Optimistic forwards run again from a layer that missed (daemon/model/optimistic.py).
            "redos_per_token": redos / n,
            **layer_host_us(layer_host),
            # Experts copied ahead into the next layer's slots (prefetch from the host
            # tier), and those of them routed: counted among the hits.
            "prestaged_per_token": d["prestaged"] / n,
            "prestaged_used_per_token": d["prestaged_used"] / n,
            "placement_moves_per_token": d["placement_moves"] / n if sm.mapped_pool is not None else None,
            "placement_ms_per_token": 1e3 * d["placement_seconds"] / n if sm.mapped_pool is not None else None,
            "placement_worker_ms_per_token": 1e3 * d["placement_worker_seconds"] / n
            if sm.mapped_pool is not None
            else None,
            **host_split_per_token(split, n),
        }

    def run_generate(seed: int, grammar: Any = None) -> dict[str, Any]:
        # One more token than the bench loop decodes: the first comes with the prompt.
        params = SamplingParams(max_tokens=settings.decode_tokens + 1, temp=settings.temp, seed=seed)
        result = generate(sm, prompt, params, grammar=grammar)
        if result.stats.tokens_per_s is None:
            raise RuntimeError(
                f"{name}: the generation loop stopped after {len(result.tokens)} token(s) ({result.finish_reason})"
            )
        return {
            "tokens_per_s": result.stats.tokens_per_s,
            "tokens": result.tokens[: settings.decode_tokens],
            "mask_ms_per_token": result.stats.constraint.mask_ms_per_token if result.stats.constraint else None,
        }

    def run_constrained(seed: int) -> dict[str, Any]:
        """An unconstrained request and a json_schema one through the generation loop,
        in an order that alternates with the seed's parity (a drift hits both alike)."""
        from ...shared.protocol import Constraint
        from ..model.constrain import grammar_for

        out: dict[str, Any] = {}
        for constrained in (False, True) if seed % 2 == 0 else (True, False):
            grammar = None
            if constrained:
                tic = time.perf_counter()
                schema = Constraint("json_schema", json.dumps(constrained_schema(settings.decode_tokens)))
                grammar = grammar_for(sm.tokenizer, schema)
                out["compile_ms"] = 1e3 * (time.perf_counter() - tic)
            key = "json_schema_tokens_per_s" if constrained else "unconstrained_tokens_per_s"
            run = run_generate(seed, grammar)
            out[key] = run["tokens_per_s"]
            if constrained:
                out["mask_ms_per_token"] = run["mask_ms_per_token"]
        return out

    return Config(
        name,
        capacity,
        run,
        sm.close,
        run_generate=run_generate if settings.generation_loop and not naive else None,
        host_tier=host_tier,
        run_constrained=run_constrained if settings.constrained and not naive else None,
    )


def _stock_config(settings: BenchDecodeSettings, prompt: list[int]) -> Config:
    model = load_stock_model(settings.store)

    def run(seed: int) -> dict[str, Any]:
        split: dict[str, float] = {}
        seconds, tokens = timed_decode(model, prompt, settings.decode_tokens, settings.temp, seed, split=split)
        return {
            "tokens_per_s": settings.decode_tokens / seconds,
            "tokens": tokens,
            "host_tier": None,
            "hit_rate": 1.0,
            "tier_hit_rate": None,
            "disk_bytes_per_token": 0.0,
            "host_to_pool_bytes_per_token": 0.0,
            "admission_bytes_per_s": None,
            "host_syncs_per_token": 1.0,
            "syncs_per_token": 1.0,
            "redos_per_token": None,
            **layer_host_us(([], [])),
            "prestaged_per_token": None,
            "prestaged_used_per_token": None,
            "prefetch_promoted_per_token": None,
            "placement_moves_per_token": None,
            "placement_ms_per_token": None,
            "placement_worker_ms_per_token": None,
            **host_split_per_token(split, settings.decode_tokens),
        }

    return Config("stock-mlx-lm", None, run, lambda: None)


def timed_round(
    run: Callable[[int], dict[str, Any]], tokens: int, min_seconds: float, seed: int = 0, fresh: bool = False
) -> dict[str, Any]:
    """One timed round of a configuration: `run` (one decode of `tokens` tokens, sampled
    with `seed`, or with `seed` + n for the n-th decode where `fresh`), repeated until
    `min_seconds` of decoding have passed. Tokens/s is all tokens over all decoding
    seconds; the per-token figures are the decodes' mean (each decodes the same number of
    tokens); `tokens` are the first decode's, or None where a repeat of the same seed
    decoded others (same prompt and seed, so they must not differ)."""
    runs = [run(seed)]
    seconds = tokens / runs[0]["tokens_per_s"]
    while seconds < min_seconds:
        runs.append(run(seed + len(runs) if fresh else seed))
        seconds += tokens / runs[-1]["tokens_per_s"]
    if len(runs) == 1:
        return {**runs[0], "repeats": 1}
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if key == "tokens":
            out[key] = value if fresh or all(v == value for v in values) else None
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and all(v is not None for v in values):
            out[key] = statistics.fmean(values)
        else:
            out[key] = value
    out["tokens_per_s"] = len(runs) * tokens / seconds
    out["repeats"] = len(runs)
    return out


def paired_blocks(
    stock: Callable[[], dict[str, Any]],
    ours: Callable[[], dict[str, Any]],
    blocks: int,
    on_block: Callable[[list[dict[str, float]], list[float]], None] | None = None,
) -> dict[str, Any]:
    """`blocks` blocks of four decodes, stock / ours / ours / stock, and the ratio of ours
    to stock per block (each side's two decodes' tokens over their seconds). A drift of
    the machine's speed that is linear within a block hits both sides alike. The summary:
    median and quartiles of the ratios, and the geometric mean with its 95% interval
    (normal approximation of the mean log ratio). `on_block` gets the blocks so far and
    their ratios after each block (so that a run cut short can keep them)."""
    if blocks < 2:
        raise ValueError("paired blocks: at least 2, for an interval")
    ratios, rows = [], []
    for _ in range(blocks):
        a1, b1, b2, a2 = stock(), ours(), ours(), stock()
        a = 2 / (1 / a1["tokens_per_s"] + 1 / a2["tokens_per_s"])
        b = 2 / (1 / b1["tokens_per_s"] + 1 / b2["tokens_per_s"])
        rows.append({"stock_tokens_per_s": a, "tokens_per_s": b})
        ratios.append(b / a)
        if on_block is not None:
            on_block(rows, ratios)
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    q = statistics.quantiles(ratios, n=4)
    return {
        "blocks": rows,
        "ratios": ratios,
        "median": statistics.median(ratios),
        "quartiles": [q[0], q[2]],
        "geometric_mean": math.exp(mean),
        "interval_95": [math.exp(mean - half), math.exp(mean + half)],
    }


def measure_admission(admitter: Admitter, manifest, experts: int = 64) -> dict[str, Any]:
    """Bytes/s of admitting `experts` experts of the first layer from the host tier into
    pool rows in one batch (a first fill loads the tier; the second is timed)."""
    layer = manifest.layers[0]
    n = min(experts, layer.num_experts)
    rows = {t.name: mx.zeros((n, *t.shape), dtype=getattr(mx, t.dtype)) for t in layer.tensors}
    mx.eval(list(rows.values()))
    admitter.prepare(rows)
    placements = [(e, e) for e in range(n)]
    admitter.fill(layer, placements, rows)
    before = admitter.stats()
    admitter.fill(layer, placements, rows)
    after = admitter.stats()
    moved = after["bytes_to_pool"] - before["bytes_to_pool"]
    seconds = after["copy_seconds"] - before["copy_seconds"]
    return {"experts": n, "bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds if seconds else None}


# Seconds a round may run before every thread's stack is printed (then again as often).
STALL_DUMP_S = 120


def tier_is_mapped(settings: BenchDecodeSettings, manifest: Manifest) -> tuple[bool, str]:
    """What the loader makes of the bench's host tier at a partial capacity (capacity 0
    stands for any partial one): the mapped pool where it holds every expert on an
    NVIDIA GPU, else the slot pool with the tier; and why."""
    if settings.host_tier != "auto":
        return settings.host_tier == "mapped", f"{settings.host_tier}: --host-tier"
    return choose_mapped(
        manifest, 0, Settings(host_cache=settings.host_cache), psutil.virtual_memory().available, cuda_copier()[1]
    )


def warm_tier(tier: Admitter, manifest: Manifest, store: Path) -> int:
    """Fill the benchmark's shared host tier before anything is timed, hottest first by
    the store's saved heat (else layer by layer), as a daemon's warm start fills its tier
    from the heat: its rows then measure a tier as it serves, not its first reads from the
    disk (which a run of new text in every decode made 2x slower on the H200). Returns the
    bytes read."""
    warm = getattr(tier, "warm", None)
    if warm is None:
        return 0
    try:
        counts = peek_usage(usage_path(Settings().heat_folder(store)))
    except (OSError, ValueError):
        counts = {}
    keys = [(layer.ordinal, e) for layer in manifest.layers for e in range(layer.num_experts)]
    keys.sort(key=lambda k: -counts.get(k[0], {}).get(k[1], 0))  # stable: layer order among equals
    return warm(list(manifest.layers), keys)


def pool_configs(settings: BenchDecodeSettings) -> list[tuple[float, bool]]:
    """The (capacity, mapped) pools of the bench's partial configurations, each once:
    what the forecast's pool probe (daemon/pool_probe.py) probes. A slot pool with a
    host tier and one without share a probe (the probe's has a tier; the disk is the
    plan's own term)."""
    manifest = load_manifest(settings.store)
    partial = [c for c in settings.capacities if c < 1]
    out: list[tuple[float, bool]] = []
    tier_mapped = bool(settings.host_cache) and tier_is_mapped(settings, manifest)[0]
    for c in partial:
        if settings.slot_pool or settings.host_cache:
            out.append((c, False))
        if tier_mapped or settings.mapped:
            out.append((c, True))
    return out


def run_bench_decode(
    settings: BenchDecodeSettings,
    progress: Callable[[str], None] | None = None,
    on_loaded: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """Run every configuration; `progress` gets one line per model loaded and per run
    (so that a run cut short still shows what it measured); `on_loaded`, once all are
    loaded and before anything is timed, gets each one's name, capacity and host tier
    (the forecast's configurations: a run cut short still shows what was forecast)."""
    say = timed_progress(progress)
    if settings.fresh_text and settings.temp == 0:
        raise ValueError("fresh text needs a temperature above 0: a greedy decode of one prompt is one text")
    if settings.mlx_memory_limit:
        mx.set_memory_limit(settings.mlx_memory_limit)
    manifest = load_manifest(settings.store)
    vocab = manifest.config.get("text_config", manifest.config)["vocab_size"]
    rng = random.Random(settings.seed)
    prompt = [rng.randrange(vocab) for _ in range(settings.prompt_tokens)]

    # The mapped configurations' gather settings, auto resolved as the loader would.
    gathers = [RowGather.kernel_available() if g is None else g for g in settings.mapped_gather]
    configs: list[Config] = []
    shared_reader: ExpertReader | None = None
    try:
        if settings.stock:
            configs.append(_stock_config(settings, prompt))
        tier, tier_mapped, tier_note, warmed = None, False, None, 0
        if settings.host_cache:
            # One host tier for every slot pool's "+host" configuration: they run in
            # turn, and a machine would hold one such tier, not one per pool size.
            shared_reader = ExpertReader(settings.store, manifest, threads=settings.io_threads)
            tier, _ = make_admitter(
                shared_reader,
                manifest,
                settings.host_cache,
                copy_kernel=settings.copy_kernel,
                ahead_blocks=settings.prefetch_copy_blocks,
            )
            tier_mapped, tier_note = tier_is_mapped(settings, manifest)
            say(f"host tier of {format_size(settings.host_cache)}: mapped pool {tier_note}")
            warmed = warm_tier(tier, manifest, settings.store)
            say(f"host tier filled with {format_size(warmed)} before timing (its steady state, not its first reads)")
        for c in settings.capacities:
            if settings.slot_pool:
                configs.append(_streaming_config(f"moestream@{c:g}", c, settings, prompt))
                if settings.checksums and c < 1:
                    configs.append(_streaming_config(f"moestream@{c:g}+crc", c, settings, prompt, verify=True))
                if settings.per_layer and c < 1:
                    configs.append(_streaming_config(f"moestream@{c:g}:per-layer", c, settings, prompt, per_layer=True))
            if tier is not None and c < 1:
                if tier_mapped:
                    configs.append(
                        _streaming_config(
                            f"moestream@{c:g}+host",
                            c,
                            settings,
                            prompt,
                            mapped=True,
                            mapped_gather=gathers[0],
                            host_cache=settings.host_cache,
                        )
                    )
                configs.append(
                    _streaming_config(
                        f"moestream@{c:g}+host{':slots' if tier_mapped else ''}", c, settings, prompt, admitter=tier
                    )
                )
            if settings.mapped and c < 1:
                for g in gathers:
                    configs.append(
                        _streaming_config(
                            f"moestream@{c:g}+mapped{':g' if g else ''}",
                            c,
                            settings,
                            prompt,
                            mapped=True,
                            mapped_gather=g,
                        )
                    )
        if settings.naive:
            configs.append(_streaming_config("naive-on-demand", None, settings, prompt, naive=True))
        say(f"loaded {len(configs)} configurations: {', '.join(c.name for c in configs)}")
        if on_loaded is not None:
            on_loaded([{"name": c.name, "capacity": c.capacity, "host_tier": c.host_tier} for c in configs])

        def round_seed(r: int) -> int:
            # Rounds far apart: a round's decodes take its seed + n.
            return settings.seed + (r + 1) * FRESH_SEED_STRIDE if settings.fresh_text else settings.seed

        for w in range(settings.warmup_rounds):  # kernels, page tables, first reads, the host tier
            for c in configs:
                c.run(round_seed(-1 - w))
                if c.run_generate is not None:
                    c.run_generate(round_seed(-1 - w))
                if c.run_constrained is not None:
                    c.run_constrained(round_seed(-1 - w))
                say(f"warm-up {w + 1}/{settings.warmup_rounds} {c.name}")
        for r in range(settings.rounds):
            for c in configs:
                gc.collect()
                # A round that stalls prints every thread's stack (and goes on): one
                # once stalled on the H200 with no line to say where.
                faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True, file=sys.stderr)
                try:
                    c.samples.append(
                        timed_round(
                            c.run,
                            settings.decode_tokens,
                            settings.min_round_seconds,
                            round_seed(r),
                            settings.fresh_text,
                        )
                    )
                finally:
                    faulthandler.cancel_dump_traceback_later()
                sample = c.samples[-1]
                repeats = f" ({sample['repeats']} decodes)" if sample["repeats"] > 1 else ""
                say(
                    f"round {r + 1}/{settings.rounds} {c.name}: {sample['tokens_per_s']:.2f} tok/s{repeats}, hit "
                    f"{sample['hit_rate']:.3f}"
                )
                if c.run_generate is not None:
                    gc.collect()
                    c.generate_samples.append(
                        timed_round(
                            c.run_generate,
                            settings.decode_tokens,
                            settings.min_round_seconds,
                            round_seed(r),
                            settings.fresh_text,
                        )
                    )
                    say(
                        f"round {r + 1}/{settings.rounds} {c.name} through generate: "
                        f"{c.generate_samples[-1]['tokens_per_s']:.2f} tok/s"
                    )
                if c.run_constrained is not None:
                    gc.collect()
                    # Seeds of both parities across rounds: the two requests' order alternates.
                    pair = c.run_constrained(round_seed(r) + r)
                    c.constrained_samples.append(pair)
                    say(
                        f"round {r + 1}/{settings.rounds} {c.name} json_schema: {pair['json_schema_tokens_per_s']:.2f} "
                        f"tok/s, unconstrained {pair['unconstrained_tokens_per_s']:.2f} tok/s"
                    )
        paired: dict[str, dict[str, Any]] = {}
        by_name = {c.name: c for c in configs}
        # (the configuration, the one it is paired against): stock against each full pool,
        # each "+crc" pool against the same pool without checksums, each ":per-layer" pool
        # against the same pool optimistic.
        pairs = [(c, configs[0]) for c in configs if c.capacity == 1.0 and settings.stock]
        pairs += [(c, by_name[c.name.removesuffix("+crc")]) for c in configs if c.name.endswith("+crc")]
        pairs += [(c, by_name[c.name.removesuffix(":per-layer")]) for c in configs if c.name.endswith(":per-layer")]
        for c, base in pairs if settings.paired_blocks else ():
            gc.collect()
            paired[c.name] = paired_blocks(
                lambda base=base: base.run(settings.seed),
                lambda c=c: c.run(settings.seed),
                settings.paired_blocks,
            )
            paired[c.name]["against"] = "stock" if settings.stock and base is configs[0] else base.name
            say(
                f"{c.name} against {paired[c.name]['against']} in {settings.paired_blocks} A B B A blocks: median "
                f"{paired[c.name]['median']:.3f}, 95% interval {paired[c.name]['interval_95'][0]:.3f}"
                f"-{paired[c.name]['interval_95'][1]:.3f}"
            )
        admission = measure_admission(tier, manifest) if tier is not None else None
    finally:
        for c in configs:
            c.close()
        if shared_reader is not None:
            shared_reader.close()
    say("measuring the store's read bandwidth and the host->pool link")
    settle_writes()
    bandwidth = measure_read_bandwidth(settings.store, settings.io_threads, seed=settings.seed)
    layer_reads = measure_layer_reads(settings.store, settings.io_threads, seed=settings.seed)
    page_cache = page_cache_reason(settings.store)
    link, link_kind, link_probe = measure_link_bandwidth()
    say(format_read_and_link(bandwidth, layer_reads, link_kind, link, bool(page_cache)))

    rows = []
    # Each round's first decode, which every configuration samples with the same seed.
    reference_tokens = [s["tokens"] for s in configs[0].samples] if configs else []
    for c in configs:
        row: dict[str, Any] = {"name": c.name, "capacity": c.capacity, "host_tier": c.samples[0]["host_tier"]}
        for key in (
            "tokens_per_s",
            "hit_rate",
            "tier_hit_rate",
            "disk_bytes_per_token",
            "host_to_pool_bytes_per_token",
            "admission_bytes_per_s",
            "host_syncs_per_token",
            "syncs_per_token",
            "redos_per_token",
            "host_us_per_layer_median",
            "host_us_per_layer_p99",
            "host_cpu_us_per_layer_median",
            "host_cpu_us_per_layer_p99",
            "prestaged_per_token",
            "prestaged_used_per_token",
            "prefetch_promoted_per_token",
            "placement_moves_per_token",
            "placement_ms_per_token",
            "placement_worker_ms_per_token",
            "host_call_ms_per_token",
            "host_launch_ms_per_token",
            "host_wait_ms_per_token",
        ):
            values = [s[key] for s in c.samples if s[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["tokens_per_s_runs"] = [s["tokens_per_s"] for s in c.samples]
        row["decodes_per_round"] = [s["repeats"] for s in c.samples]
        if c.generate_samples:
            gen = [s["tokens_per_s"] for s in c.generate_samples]
            row["generate_tokens_per_s"] = statistics.median(gen)
            row["generate_tokens_per_s_runs"] = gen
            # Round by round against the bench loop, which ran just before it.
            row["generate_vs_bench_paired"] = statistics.median(g / b for g, b in zip(gen, row["tokens_per_s_runs"]))
            # Greedy, both loops must decode the same tokens; sampled, the daemon draws
            # from each request's own key (generation.request_sampler), so they differ.
            row["generate_same_tokens"] = (
                all(s["tokens"] == c.samples[0]["tokens"] for s in c.generate_samples) if settings.temp == 0 else None
            )
        if c.constrained_samples:
            row["json_schema"] = constrained_summary(c.constrained_samples)
        row["same_tokens_as_first"] = all(s["tokens"] == ref for s, ref in zip(c.samples, reference_tokens))
        if c.name in paired:
            row["paired_blocks"] = paired[c.name]
        if row["admission_bytes_per_s"] is not None:
            row["admission_vs_link"] = row["admission_bytes_per_s"] / link
        rows.append(row)
    resident = next((r for r in rows if r["name"] == "stock-mlx-lm"), None) or next(
        (r for r in rows if r["capacity"] == 1.0), None
    )
    naive = next((r for r in rows if r["name"] == "naive-on-demand"), None)
    for row in rows:
        if resident is not None:
            add_bound(row, resident, bandwidth, link, page_cache)
        if naive is not None:
            row["vs_naive"] = row["tokens_per_s"] / naive["tokens_per_s"]
    return {
        "store": str(settings.store),
        "model_type": manifest.model_type,
        "experts_per_layer": manifest.layers[0].num_experts,
        "moe_layers": len(manifest.layers),
        "expert_bytes": manifest.layers[0].expert_bytes,
        "policy": settings.policy,
        "prompt_tokens": settings.prompt_tokens,
        "decode_tokens": settings.decode_tokens,
        "temp": settings.temp,
        "fresh_text": settings.fresh_text,
        "rounds": settings.rounds,
        "warmup_rounds": settings.warmup_rounds,
        "min_round_seconds": settings.min_round_seconds,
        "generation_loop": settings.generation_loop,
        "constrained": settings.constrained,
        "paired_blocks": settings.paired_blocks,
        "checksums": settings.checksums,
        "per_layer": settings.per_layer,
        "host_cache_bytes": settings.host_cache,
        "host_tier_mapped": tier_note,
        # Bytes read into the host tier before timing (`warm_tier`).
        "host_tier_warmed_bytes": warmed,
        "mapped": settings.mapped,
        "prefetch": settings.prefetch,
        "copy_kernel": settings.copy_kernel,
        "prefetch_copy_blocks": settings.prefetch_copy_blocks,
        "mapped_rebalance_tokens": settings.mapped_rebalance_tokens if settings.mapped else None,
        "mapped_gather": gathers if settings.mapped else None,
        "read_bandwidth_bytes_per_s": bandwidth,
        # The read rate in batches of a few experts waited for in turn, as decode reads
        # a layer's misses ({batch: bytes/s}; the forecast's disk term).
        "read_bandwidth_by_batch": layer_reads,
        # Why the store was read through the page cache (None: direct I/O).
        "read_page_cache": page_cache,
        "link_bandwidth_bytes_per_s": link,
        "link_kind": link_kind,
        "link_probe": link_probe,
        "admission_probe": admission,
        "admission_probe_vs_link": admission["bytes_per_s"] / link if admission and admission["bytes_per_s"] else None,
        "device": str(mx.default_device()),
        "results": rows,
    }


# Below this share of a token's time spent moving its bytes at the measured bandwidths,
# the bound is the resident speed within the noise of measuring it: a ratio to it says
# no more than "x stock" does, and lands above 1 as often as below.
BOUND_MIN_MOVE_SHARE = 0.05


def constrained_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's json_schema runs against its unconstrained ones: medians, and
    the cost (1 - constrained / unconstrained tokens/s) paired round by round."""
    costs = [1 - s["json_schema_tokens_per_s"] / s["unconstrained_tokens_per_s"] for s in samples]
    mask = statistics.median(s["mask_ms_per_token"] for s in samples)
    unconstrained = statistics.median(s["unconstrained_tokens_per_s"] for s in samples)
    return {
        "tokens_per_s": statistics.median(s["json_schema_tokens_per_s"] for s in samples),
        "unconstrained_tokens_per_s": unconstrained,
        "cost": statistics.median(costs),
        "cost_runs": costs,
        "compile_ms": statistics.median(s["compile_ms"] for s in samples),
        # The grammar's own host time per token, and its share of an unconstrained token's time.
        "mask_ms_per_token": mask,
        "mask_share": mask * unconstrained / 1e3,
    }


def bound_why_not(move_share: float, disk_bytes_per_token: float, page_cache: str | None) -> str | None:
    """Why a configuration's bound does not apply, or None where it does:
    "no_bytes" (it moves none: the bound is the resident speed itself), "page_cache" (its
    reads come through the page cache, whose speed the read bandwidth does not give) or
    "few_bytes" (moving them takes under BOUND_MIN_MOVE_SHARE of a token)."""
    if move_share == 0:
        return "no_bytes"
    if page_cache is not None and disk_bytes_per_token > 0:
        return "page_cache"
    if move_share < BOUND_MIN_MOVE_SHARE:
        return "few_bytes"
    return None


def add_bound(
    row: dict[str, Any],
    resident: dict[str, Any],
    read_bandwidth: float,
    link_bandwidth: float,
    page_cache: str | None = None,
) -> None:
    """Add to a result row its ratio to the resident configuration and its bound (see
    the module docstring), three ways, since resident decode on a shared machine swings
    between rounds (stock 44 to 93 tok/s in one H200 run):
    - `fraction_of_bound`: against the bound of the resident median;
    - `fraction_of_bound_paired`: round by round (the configurations run in turn, so
      each round's resident speed is the machine's state then), the median ratio;
    - `fraction_of_best_bound`: against the bound of the fastest resident round, the
      strictest;
    and whether the bound applies (`bound_applies`; `bound_why_not` says why not, see
    `bound_why_not`), from `bound_move_share`, the share of a token that moving its
    bytes takes on top of resident compute. `page_cache` is why the store was read
    through the page cache (None: direct I/O)."""

    def bound(resident_tps: float) -> float:
        return 1.0 / (
            1.0 / resident_tps
            + row["disk_bytes_per_token"] / read_bandwidth
            + row["host_to_pool_bytes_per_token"] / link_bandwidth
        )

    runs, resident_runs = row["tokens_per_s_runs"], resident["tokens_per_s_runs"]
    row["vs_resident"] = row["tokens_per_s"] / resident["tokens_per_s"]
    # The same ratio taken round by round, steadier than the ratio of medians.
    row["vs_resident_paired"] = statistics.median(a / b for a, b in zip(runs, resident_runs))
    row["bound_tokens_per_s"] = bound(resident["tokens_per_s"])
    row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
    row["fraction_of_bound_paired"] = statistics.median(a / bound(b) for a, b in zip(runs, resident_runs))
    row["best_bound_tokens_per_s"] = bound(max(resident_runs))
    row["fraction_of_best_bound"] = row["tokens_per_s"] / row["best_bound_tokens_per_s"]
    move = row["disk_bytes_per_token"] / read_bandwidth + row["host_to_pool_bytes_per_token"] / link_bandwidth
    row["bound_move_share"] = move / (move + 1.0 / resident["tokens_per_s"])
    row["bound_why_not"] = bound_why_not(row["bound_move_share"], row["disk_bytes_per_token"], page_cache)
    row["bound_applies"] = row["bound_why_not"] is None


def format_or_dash(value: Any, fmt: str) -> str:
    """A report cell: `value` formatted, or "-" where there is none, padded to the width
    `fmt` gives (so that a column with gaps stays aligned); right-aligned, as numbers
    are, unless `fmt` aligns otherwise."""
    if value is not None:
        return format(value, fmt)
    spec = re.match(r"(?:.?([<>=^]))?[-+ ]?z?#?0?(\d*)", fmt)
    align = spec.group(1) if spec.group(1) in ("<", "^") else ">"
    return format("-", f"{align}{spec.group(2)}")


def _bound_note(why: str, report: dict[str, Any]) -> str:
    """The footnote of a table's rows whose bound does not apply, for one reason."""
    if why == "no_bytes":
        return "no bytes moved per token, so the bound is the resident speed itself (x stock compares them)"
    if why == "page_cache":
        return (
            f"the store was read through the page cache ({report.get('read_page_cache')}), whose speed the "
            f"measured read bandwidth does not give"
        )
    return (
        f"moving their bytes takes under {BOUND_MIN_MOVE_SHARE:.0%} of a token at the measured bandwidths, so "
        f"the bound is the resident speed within its noise (x stock compares them)"
    )


def format_report(report: dict[str, Any]) -> str:
    num = format_or_dash
    lines = [
        f"{report['model_type']}: {report['moe_layers']} MoE layers x {report['experts_per_layer']} experts, "
        f"{report['decode_tokens']} decode tokens (temp {report['temp']}), median of {report['rounds']}"
        + (f" rounds of at least {report['min_round_seconds']:g} s" if report.get("min_round_seconds") else "")
        + "; "
        f"disk {format_size(report['read_bandwidth_bytes_per_s'])}/s"
        f"{' (through the page cache)' if report.get('read_page_cache') else ''}, "
        f"{report['link_kind']} {format_size(report['link_bandwidth_bytes_per_s'])}/s",
        f"{'config':<26} {'tok/s':>8} {'x stock':>8} {'hit':>6} {'tier hit':>8} {'disk MB/t':>9} "
        f"{'h2d MB/t':>9} {'adm GB/s':>8} {'syncs/t':>7} {'bound':>7} {'of bound':>8} {'paired':>6} {'of best':>7} "
        f"{'x naive':>7}",
    ]
    # The rows whose bound does not apply, by reason (reports before bound_why_not have none).
    not_applied: dict[str, list[str]] = {}
    for r in report["results"]:
        if r.get("bound_why_not"):
            not_applied.setdefault(r["bound_why_not"], []).append(r["name"])
    marks = {why: f"n/a {i + 1}" for i, why in enumerate(not_applied)}
    for r in report["results"]:
        adm = r["admission_bytes_per_s"] / 1e9 if r["admission_bytes_per_s"] else None
        if r.get("bound_why_not"):
            bound = f"{marks[r['bound_why_not']]:>7} {'-':>8} {'-':>6} {'-':>7}"
        else:
            bound = (
                f"{num(r.get('bound_tokens_per_s'), '7.1f')} {num(r.get('fraction_of_bound'), '8.2f')} "
                f"{num(r.get('fraction_of_bound_paired'), '6.2f')} {num(r.get('fraction_of_best_bound'), '7.2f')}"
            )
        lines.append(
            f"{r['name']:<26} {r['tokens_per_s']:>8.1f} {num(r.get('vs_resident'), '8.3f')} {r['hit_rate']:>6.3f} "
            f"{num(r['tier_hit_rate'], '8.3f')} {r['disk_bytes_per_token'] / 1e6:>9.2f} "
            f"{r['host_to_pool_bytes_per_token'] / 1e6:>9.2f} {num(adm, '8.1f')} {r['host_syncs_per_token']:>7.1f} "
            f"{bound} {num(r.get('vs_naive'), '7.1f')}"
        )
    for why, names in not_applied.items():
        lines.append(f"{marks[why]}: {', '.join(names)}: {_bound_note(why, report)}")
    lines.append(
        "host ms per token: model call / launch / wait for the token (on a GPU, a wait near 0 means bound by the "
        "host); host us per MoE layer (its forward less MLX's evaluations), wall and the thread's CPU: median / p99; "
        "syncs per token"
    )
    for r in report["results"]:
        if r.get("host_call_ms_per_token") is not None:
            lines.append(
                f"{r['name']:<26} {r['host_call_ms_per_token']:>8.2f} {r['host_launch_ms_per_token']:>8.2f} "
                f"{r['host_wait_ms_per_token']:>8.2f} {num(r.get('host_us_per_layer_median'), '9.1f')} "
                f"{num(r.get('host_us_per_layer_p99'), '9.1f')} {num(r.get('host_cpu_us_per_layer_median'), '9.1f')} "
                f"{num(r.get('host_cpu_us_per_layer_p99'), '9.1f')} {num(r.get('syncs_per_token'), '7.1f')}"
            )
    for r in report["results"]:
        pb = r.get("paired_blocks")
        if pb is not None:
            lines.append(
                f"{r['name']} against {pb.get('against', 'stock')} in {len(pb['ratios'])} A B B A blocks: median "
                f"{pb['median']:.3f} "
                f"(quartiles {pb['quartiles'][0]:.3f}-{pb['quartiles'][1]:.3f}), geometric mean "
                f"{pb['geometric_mean']:.3f} (95% interval {pb['interval_95'][0]:.3f}-{pb['interval_95'][1]:.3f})"
            )
    looped = [r for r in report["results"] if r.get("generate_tokens_per_s") is not None]
    if looped:
        lines.append("through the daemon's generation loop (in process):")
        for r in looped:
            lines.append(
                f"{r['name']:<26} {r['generate_tokens_per_s']:>8.1f} tok/s, {r['generate_vs_bench_paired']:.2f}x the "
                "bench loop (paired)"
                + (", other tokens than the bench loop" if r["generate_same_tokens"] is False else "")
            )
    costed = [r for r in report["results"] if r.get("json_schema") is not None]
    if costed:
        lines.append("a json_schema request against the same request unconstrained, through the generation loop:")
        for r in costed:
            j = r["json_schema"]
            lines.append(
                f"{r['name']:<26} {j['tokens_per_s']:>8.1f} tok/s against {j['unconstrained_tokens_per_s']:.1f}: "
                f"cost {100 * j['cost']:.1f}% (paired median); the grammar's own {j['mask_ms_per_token']:.3f} ms a "
                f"token ({100 * j['mask_share']:.1f}% of an unconstrained token), compiled in {j['compile_ms']:.1f} ms"
            )
    return "\n".join(lines)


def format_read_and_link(
    read: float, layer_reads: dict[int, float], link_kind: str, link: float, page_cache: bool = False
) -> str:
    """The probed bandwidths in one line, as the benchmarks print them."""
    return (
        f"read {format_size(read)}/s{' through the page cache' if page_cache else ''} "
        f"({', '.join(f'{format_size(r)}/s' for r in layer_reads.values())} in batches of "
        f"{', '.join(map(str, layer_reads))}), {link_kind} {format_size(link)}/s"
    )


def page_cache_reason(store: Path) -> str | None:
    """Why the store's reads go through the page cache (the read engine's fallback where
    the filesystem refuses direct I/O), or None where they bypass it. Through the page
    cache a read costs what its cached pages cost, which the measured read bandwidth, a
    mix of cache and disk, does not give."""
    manifest = load_manifest(store)
    with ReadEngine(threads=1, direct=True) as engine:
        for file in sorted({layer.file for layer in manifest.layers}):
            info = engine.file_info(engine.open(str(store / file)))
            if not info["direct"]:
                return info["fallback_reason"] or "buffered reads"
    return None


# ---- the plan's forecasts beside the measurements ---------------------------------------


def probe_store(
    store: Path, pools: list[tuple[float, bool]] = (), settings: Settings | None = None
) -> tuple[ComputeProbe, dict[tuple[float, bool], PoolProbe]]:
    """The compute probe of a store's architecture, and the pool probes of the (capacity
    share, mapped) configurations `pools` with `settings` (the policy and prefetch they
    run with). A benchmark's forecast probes before it loads anything, as `plan` does:
    probed after its runs, beside what they left behind (threads, pools, a full
    allocator), the probe timed a decode several times too slow (tests/bench/RESULTS.md,
    "The compute probe on its own")."""
    from ...shared.settings import default_state_dir

    manifest = load_manifest(store)
    dtype = resident_dtype(store, manifest)
    compute = probe_compute(manifest, dtype)
    probes = {}
    if pools:
        probes = probe_pools_of(
            store, manifest, dtype, list(pools), settings or Settings(model=str(store)), default_state_dir(os.environ)
        )
    return compute, probes


def bench_plans(
    store: Path,
    configs: list[tuple[str, float | None, int, bool]],
    bandwidths: Bandwidths,
    prompt_tokens: int,
    compute: ComputeProbe,
    pools: Mapping[tuple[float, bool], PoolProbe] | None = None,
) -> dict[str, Plan]:
    """{name: plan} for (name, capacity, host cache, mapped) configurations, each with
    its pool probe from `pools` where there is one."""
    manifest = load_manifest(store)
    counts, source = heat_counts(store, Settings(model=str(store)), manifest)
    reuse, reuse_source = heat_reuse(store, Settings(model=str(store)), manifest)
    return {
        name: make_plan(
            store,
            Settings(model=str(store), capacity=capacity, host_cache=host),
            bandwidths,
            compute,
            counts,
            source,
            prompt_tokens=prompt_tokens,
            mapped=mapped,
            pool=(pools or {}).get((capacity, mapped)) if capacity is not None else None,
            reuse=reuse,
            reuse_source=reuse_source,
        )
        for name, capacity, host, mapped in configs
    }


def config_plans(
    store: Path,
    rows: list[dict[str, Any]],
    bw: Bandwidths,
    host: int,
    compute: ComputeProbe,
    pools: Mapping[tuple[float, bool], PoolProbe] | None = None,
) -> dict[str, Plan]:
    """{name: plan} of `bench decode`'s moestream configurations (rows with a name, a
    capacity and a host tier: "mapped" (a mapped pool over a tier of `host` bytes),
    "slots", or None; "+mapped" rows are mapped pools without a tier)."""
    configs = [
        (
            r["name"],
            r["capacity"],
            host if r.get("host_tier") else 0,
            r.get("host_tier") == "mapped" or "+mapped" in r["name"],
        )
        for r in rows
        if r["capacity"] is not None
    ]
    return bench_plans(store, configs, bw, TTFT_PROMPT_TOKENS, compute, pools)


def decode_forecasts(
    report: dict[str, Any], compute: ComputeProbe, pools: Mapping[tuple[float, bool], PoolProbe] | None = None
) -> list[dict[str, Any]]:
    """The forecast of every moestream row of a `bench decode` report, with the run's own
    bandwidths, `compute` and `pools` (`probe_store`), beside its measured tok/s."""
    rows = [r for r in report["results"] if r["capacity"] is not None]
    bw = Bandwidths(
        report["read_bandwidth_bytes_per_s"],
        report["link_bandwidth_bytes_per_s"],
        report["link_kind"],
        "this run",
        # A report from before the batched read probe has none: the bulk rate then.
        {int(b): float(r) for b, r in (report.get("read_bandwidth_by_batch") or {}).items()},
    )
    plans = config_plans(Path(report["store"]), rows, bw, report.get("host_cache_bytes") or 0, compute, pools)
    return [
        {
            "name": r["name"],
            "measured_tokens_per_s": r["tokens_per_s"],
            "forecast_tokens_per_s": plans[r["name"]].decode.tokens_per_s,
            "forecast_bound_tokens_per_s": plans[r["name"]].decode.bound_tokens_per_s,
            "bound_by": plans[r["name"]].decode.bound_by,
            "measured_hit_rate": r["hit_rate"],
            "forecast_hit_rate": plans[r["name"]].hit_rate,
            "forecast_hit_source": plans[r["name"]].hits.source,
            "measured_vs_forecast": r["tokens_per_s"] / plans[r["name"]].decode.tokens_per_s,
            "forecast_terms_ms": {k: 1e3 * v for k, v in plans[r["name"]].decode.terms_s.items()},
        }
        for r in rows
    ]


def format_forecast_lines(plans: Mapping[str, Plan]) -> list[str]:
    """A line per configuration: its forecast, hit rate and terms (before it is timed)."""
    return [
        f"forecast {name}: {p.decode.tokens_per_s:.2f} tok/s (bound {p.decode.bound_tokens_per_s:.2f}, "
        f"{p.decode.bound_by}), hit {p.hit_rate:.3f} from {p.hits.source}; "
        + ", ".join(f"{k} {_duration(v)}" for k, v in p.decode.terms_s.items() if v)
        for name, p in plans.items()
    ]


def format_decode_forecasts(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'forecast (plan)':<26} {'tok/s':>8} {'bound':>8} {'by':>8} {'hit':>6} {'measured':>9} {'x fcst':>7}"]
    for r in rows:
        lines.append(
            f"{r['name']:<26} {r['forecast_tokens_per_s']:>8.1f} {r['forecast_bound_tokens_per_s']:>8.1f} "
            f"{r['bound_by']:>8} {r['forecast_hit_rate']:>6.3f} {r['measured_tokens_per_s']:>9.1f} "
            f"{r['measured_vs_forecast']:>7.2f}"
        )
    return "\n".join(lines)
