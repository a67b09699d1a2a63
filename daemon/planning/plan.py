"""What a store will cost and do before anything of it is loaded: `moestreamctl plan`.

The forecast is a sum of times per token, each measured apart from the model:

    decode s/token = resident compute + pool host work + disk bytes / read bandwidth
                                                     + host->pool bytes / link bandwidth

- resident compute: models of the store's own architecture (mlx-lm's class, the
  store's config, dtype and quantization) with random weights, two depths (4 and 16
  layers of a deep model, `probe_layer_counts`) and at most 64 experts a layer, timed
  decoding here; their time per layer, extrapolated to every layer (`probe_compute`). No
  byte of the store is loaded.
- pool host work: a partial pool reads each MoE layer's routing back to the host, waits
  for it, looks the experts up, tells its policy, ranks the next layer and launches its
  copies, all while the device waits. The pool probe (daemon/pool_probe.py) streams
  random models of the same two depths through moestream's own pool at the planned share
  of their experts and times them against the same models unstreamed: the difference,
  extrapolated along the MoE layers to the store's and less the probe's own misses'
  copies, is the term. Without a pool probe
  (`plan --no-probe` with none kept) the term is the sync alone: the same random models
  timed with a wait after every layer (`synced_decode_s`), less their plain decode.
- bytes: a token routes top-k experts per MoE layer; those not in the pool are misses,
  read from the host tier where it holds them, else from the store. The hit rate of an
  LRU pool (the default policy; a mapped pool too, whose rebalancing keeps the recently
  hot) is read off the LRU stack distances the daemon's pools recorded while serving
  the store (`pool_reuse.json` beside the heat, daemon/pool/reuse.py): locality within
  a text included, which the counts cannot show. Without them, and for the other
  policies, it is the share of the routing counts that the hottest `capacity` experts
  of each layer take (a pool that keeps the hottest, as autopin pins and LFU keeps
  them), from the store's saved heat, else uniform; the demo store has both from its
  shipped routing trace. `HitEstimate.source` says which.
- bandwidths: a quick probe of the store's reads and of the host->pool copy, or the last
  probe's figures (`Bandwidths.source`). Decode reads a layer's misses together and
  waits for them before the layer runs, a few reads in flight where a prefill has many,
  so its disk term takes the rate measured in batches of that layer's expected misses
  (`Bandwidths.decode_read_rate`); on the H200's disk a decode step read at about half
  the rate of many reads in flight (tests/bench/RESULTS.md, "The H200 table with the
  probe first").

A plan reads a store through its `StoreShape` (manifest, file sizes, resident dtype):
of a store on disk, or of a hub repository before its pull (daemon/planning/repo.py: the
store `pull` would write, laid out from the config and weight headers), so `plan OWNER/NAME`
and `plan --model STORE` after the pull are one computation. The compute and pool probes
are kept by the config and dtype they time (`probe_key`), which a store and its repository
share. With no --capacity or --memory-budget the pool is sized to fit the machine's memory
(this one's, or `--memory` of another Mac's) where every expert does not (`fit_to_memory`).

The bound beside each forecast is the same sum without the pool's host work (the
`bench decode` bound), with the term that dominates it named. The time to first token of
a 2k-token prompt is the probe's prefill time per token, plus the bytes of every expert
the prompt routes that the pool lacks (a layer-major prefill brings each in once). The
probe prefills as the daemon does: only the caches evaluated, as mlx-lm's generate_step
(every position's logits, once timed in, made the forecast 1.5x slow on the demo), and
with a wait after every layer where the daemon goes layer by layer (`_prefills_by_layer`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from ...shared.heat_file import group_usage, peek_usage, read_usage, usage_path
from ...shared.settings import Settings, demo_store_path, format_size
from ...shared.store_format import MANIFEST_NAME, POOL_REUSE_NAME, Manifest, load_manifest
from ..pool.capacity import (
    ContextLimit,
    PoolCapacityError,
    context_limit,
    device_memory,
    kv_cache_bytes,
    kv_reserve_tokens,
    layer_count,
    memory_held,
    plan_capacity,
    top_k_of,
)
from ..pool.reuse import lru_hit_rate
from .pool_probe import PoolProbe, from_json
from .probe_models import probe_config, random_model, resident_dtype

TTFT_PROMPT_TOKENS = 2048
# The demo model's routing counts, from its recorded trace (tests/data/traces/demo_stdlib),
# shipped so that a plan of the demo has heat where the user has none yet.
DEMO_COUNTS = Path(__file__).resolve().parent.parent / "demo" / "routing_counts.json"
# The demo trace's decode steps as stack distances (tests/test_plan.py rebuilds it).
DEMO_REUSE = Path(__file__).resolve().parent.parent / "demo" / "routing_reuse.json"
BANDWIDTH_FILE = "bandwidth.json"


# ---- inputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Bandwidths:
    read_bytes_per_s: float  # many reads in flight, as a prefill's read-ahead makes them
    link_bytes_per_s: float
    link_kind: str
    source: str  # "probed now" or "last probed <time>"
    # {batch: bytes/s} of a few reads at a time, each batch waited for, as a decode step
    # reads one layer's misses (`measure_layer_reads`); empty where not measured.
    read_by_batch: Mapping[int, float] = field(default_factory=dict)

    def decode_read_rate(self, batch: float) -> float:
        """The read rate of a layer's `batch` misses (a mean: fractional), interpolated
        in log(batch) between the measured sizes and held at the ends (a mean under 1 is
        mostly batches of 0 or 1 read, each paying a batch of 1's rate)."""
        points = sorted(self.read_by_batch.items())
        if not points:
            return self.read_bytes_per_s
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, r0), (b1, r1) in zip(points, points[1:]):
            if batch <= b1:
                return r0 + (r1 - r0) * math.log(batch / b0) / math.log(b1 / b0)
        return points[-1][1]


def probe_bandwidths(store: Path | StoreShape, threads: int) -> Bandwidths:
    """The store's reads (where it is yet to be pulled: a scratch file of its first
    layer's experts where it will be, `bandwidth.scratch_layer`) and the link."""
    shape = store if isinstance(store, StoreShape) else StoreShape.of_store(store)
    from contextlib import nullcontext

    from .bandwidth import (
        measure_layer_reads,
        measure_link_bandwidth,
        measure_read_bandwidth,
        scratch_layer,
        settle_writes,
    )

    where = shape.store
    made = nullcontext((where, list(shape.manifest.layers)))
    if where is None:
        made = scratch_layer(shape.disk_dir or Path(tempfile.gettempdir()), shape.manifest.layers[0])
    with made as (folder, layers):
        settle_writes()
        read = measure_read_bandwidth(folder, threads, samples=64, layers=layers)
        layer_reads = measure_layer_reads(folder, threads, layers=layers)
    link, kind, _ = measure_link_bandwidth()
    return Bandwidths(read, link, kind, "probed now", layer_reads)


def _keep_json(folder: Path, name: str, data: Any) -> Path:
    """Write `data` as JSON to `folder`/`name` (temporary file, then rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    return path


def save_bandwidths(folder: Path, bw: Bandwidths) -> Path:
    """Keep the probe's figures for `plan --no-probe`."""
    return _keep_json(folder, BANDWIDTH_FILE, {**asdict(bw), "at": time.time()})


def load_bandwidths(folder: Path) -> Bandwidths | None:
    """The last probe's figures, or None where there are none (or they cannot be read)."""
    try:
        data = json.loads((folder / BANDWIDTH_FILE).read_text())
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(data["at"])))
        # JSON's keys are strings; a file from before the batched probe has none.
        batches = {int(b): float(r) for b, r in data.get("read_by_batch", {}).items()}
        return from_json(Bandwidths, {**data, "source": f"last probed {when}", "read_by_batch": batches})
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class StoreShape:
    """What a plan reads of a store: its manifest, the bytes of its files, the dtype of
    its resident weights; from a store on disk (`of_store`), or from a hub repository
    before any of its weights is downloaded (daemon/planning/repo.py: its config and
    weight headers laid out as `pull` would write the store)."""

    name: str
    manifest: Manifest
    resident_bytes: int
    store_bytes: int  # every file of the store but its manifest
    dtype: str  # most of the resident weights' (`dominant_dtype`)
    tokenizer_dir: Path  # holds the tokenizer files the manifest names (the pool probe loads them)
    store: Path | None = None  # the store's folder (its heat, its reads); None before a pull
    disk_dir: Path | None = None  # where its reads would come from (a store's folder, or where a pull puts it)

    @classmethod
    def of_store(cls, store: Path) -> StoreShape:
        manifest = load_manifest(store)
        files = [f for f in store.rglob("*") if f.is_file() and f.name != MANIFEST_NAME]
        return cls(
            name=str(store),
            manifest=manifest,
            resident_bytes=sum((store / f).stat().st_size for f in manifest.resident_files),
            store_bytes=sum(f.stat().st_size for f in files),
            dtype=resident_dtype(store, manifest),
            tokenizer_dir=store,
            store=store,
            disk_dir=store,
        )


def probe_key(config: Mapping[str, Any], dtype: str) -> str:
    """The compute and pool probes' key: they time random models of the config in the
    dtype, so one store, its copies and `plan REPO_ID` before its pull share them."""
    text = json.dumps(config, sort_keys=True, default=str) + dtype
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class ComputeProbe:
    """Resident decode and prefill times per token of the store's architecture, from
    random-weight models of `layers[0]` and `layers[1]` layers."""

    layers: tuple[int, int]
    decode_s: tuple[float, float]  # per token, for each model
    # Per prompt token, for each model, as stock's chunks prefill: the caches evaluated, not
    # the logits (mlx-lm's generate_step; every position's logits took a third of a prefill
    # of the demo on a CPU), nor the last layer's output, which no cache needs.
    prefill_s: tuple[float, float]
    # Per token, as `decode_s`, with the host waiting for every decoder layer's output.
    synced_decode_s: tuple[float, float]
    # Per prompt token, as `prefill_s`, with every layer's output evaluated in turn, as a
    # layer-major prefill runs (daemon/model/prefill.py): the last layer's too (1.15x the
    # demo's chunked prefill on a CPU).
    layered_prefill_s: tuple[float, float]
    # What each token of mean context adds to a prompt token's time, as a share of it
    # (attention reads the whole cache): a 2k-token prompt's tokens took 1.2x a 48-token
    # one's on the demo (its mean context 1k tokens longer).
    prefill_growth: float
    device: str
    dtype: str
    # The share of a core the machine gave the probe on MLX's CPU backend, which its times
    # are scaled by to an idle machine's (`_time_model`); 1 on a GPU.
    cpu_share: float = 1.0

    def per_layer(self, times: tuple[float, float]) -> float:
        return max((times[1] - times[0]) / (self.layers[1] - self.layers[0]), 0.0)

    def at(self, times: tuple[float, float], layers: int) -> float:
        """The time of a model of `layers` layers, extrapolated along the two measured."""
        return max(times[0] + (layers - self.layers[0]) * self.per_layer(times), times[0])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Timed(NamedTuple):
    """One timing of a probe model (`_time_model`)."""

    decode_s: float  # per token
    prefill_s: float  # per prompt token
    share: float  # of a core the machine gave the probe (1 on a GPU)
    # A longer prompt's time per token over the probe's, less 1, per token of mean
    # context more (0: not measured).
    growth: float


def _time_model(model: Any, vocab: int, prompt_tokens: int, steps: int, long_prompt: int = 0) -> _Timed:
    """Decode and prefill times of `model`, pipelined as mlx-lm's generate_step and
    `bench decode` decode. The prompt but its last token is prefilled as generate_step
    does (the caches evaluated); the last token is the first decode step, as there. With
    `long_prompt`, a prompt of that many tokens is prefilled too, in one chunk as the
    daemon prefills one of up to 2k tokens: what a longer context adds to each token
    (attention reads it all), which the plan's 2k-token prompt meets. (A few tokens after
    a long cache would not do: DeepSeek's latent attention expands every cached position
    again for each chunk, which one long chunk does once.)

    On MLX's CPU backend one thread computes a prefill while this one waits, so the
    process's CPU time over the wall time is the share of a core the machine gave the
    probe: other work on a shared machine's cores stretched each figure by its inverse
    (twice, with a load of four on two cores). Every figure is scaled back by it to an
    idle machine's, which the plan forecasts."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    on_cpu = mx.default_device() == mx.cpu

    def prefill(tokens: int) -> tuple[float, float, list[Any]]:
        """(s per token scaled to an idle machine, the share, the cache) of a prompt of
        `tokens` but its last token."""
        cache = make_prompt_cache(model)
        prompt = mx.array([[i * 7919 % vocab for i in range(tokens - 1)]])
        tic, cpu = time.perf_counter(), time.process_time()
        model(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        wall, cpu = time.perf_counter() - tic, time.process_time() - cpu
        share = min(cpu / wall, 1.0) if on_cpu and wall > 0 and cpu > 0 else 1.0
        return share * wall / (tokens - 1), share, cache

    per_token, share, cache = prefill(prompt_tokens)
    y = mx.argmax(model(mx.array([[(prompt_tokens - 1) * 7919 % vocab]]), cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    tic = time.perf_counter()
    for _ in range(steps):
        next_y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(next_y)
        y.item()
        y = next_y
    mx.eval(y)
    decode = share * (time.perf_counter() - tic) / steps
    growth = 0.0
    if long_prompt > prompt_tokens:
        del cache
        longer = prefill(long_prompt)[0]
        growth = max(longer / per_token - 1.0, 0.0) / ((long_prompt - prompt_tokens) / 2)
    return _Timed(decode, per_token, share, growth)


class _Waited:
    """Stands in for a decoder layer: runs it, then waits for its output, as a slot
    pool's read-back of the layer's routing makes the host wait."""

    def __init__(self, layer: Any) -> None:
        self._layer = layer

    def __getattr__(self, name: str) -> Any:
        # The model's loop may ask a layer what it is (qwen3_next's `is_linear`).
        return getattr(self._layer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        out = self._layer(*args, **kwargs)
        mx.eval(out)
        return out


def _time_synced(model: Any, vocab: int, prompt_tokens: int, steps: int) -> _Timed:
    """`_time_model`'s figures of `model` with a wait after every decoder layer (a model
    with no list of layers: its plain figures, so the sync terms are 0)."""
    from ..model.prefill import UnsupportedModel, decoder_of

    try:
        decoder, key = decoder_of(model)
    except UnsupportedModel:
        return _time_model(model, vocab, prompt_tokens, steps)
    held = decoder[key]
    decoder[key] = [_Waited(layer) for layer in held]
    try:
        return _time_model(model, vocab, prompt_tokens, steps)
    finally:
        decoder[key] = held


# The probe's two models: PROBE_MIN_LAYERS layers and at most PROBE_MAX_LAYERS (the
# whole model where it has no more; 2 and all of it where it has fewer than
# PROBE_MAX_LAYERS). A long lever arm keeps the per-layer slope, a difference of two
# timings, steady, and its short end away from the cheaper regime of a very shallow model:
# on the H200 a 2-layer q30 model ran 0.19 ms a layer cheaper than the slope from 8 to 24
# layers in each of three runs (tests/bench/RESULTS.md, "The H200 table with the probe first").
PROBE_MIN_LAYERS = 4
PROBE_MAX_LAYERS = 16
# The probe's prompt, and the longer one that says what context adds to a prompt token.
PROBE_PROMPT_TOKENS = 48
PROBE_LONG_PROMPT_TOKENS = 512


def probe_layer_counts(total: int) -> tuple[int, int]:
    """The layer counts of the probe's two models for a model of `total` layers."""
    if total >= PROBE_MAX_LAYERS:
        return PROBE_MIN_LAYERS, PROBE_MAX_LAYERS
    return (2, total) if total > 2 else (1, total)


def probe_compute(
    manifest: Manifest,
    dtype: str,
    *,
    steps: int = 12,
    prompt_tokens: int = PROBE_PROMPT_TOKENS,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> ComputeProbe:
    """Time random-weight models of the store's architecture in `dtype` with the layers
    of `probe_layer_counts` (and at most PROBE_MAX_EXPERTS experts a layer), in turns (a
    drift of a shared machine hits both alike); nothing of the store but its config is
    read."""
    import mlx.core as mx

    cfg = manifest.config.get("text_config", manifest.config)
    counts = probe_layer_counts(layer_count(manifest.config))
    models = [random_model(probe_config(manifest.config, n), dtype) for n in sorted(set(counts))]
    vocab = int(cfg.get("vocab_size") or cfg["num_vocab"])  # phixtral: num_vocab
    for model in models:  # kernels built, buffers allocated
        _time_model(model, vocab, 8, 2, long_prompt=16)
    times: list[list[_Timed]] = [[] for _ in models]
    waited: list[list[_Timed]] = [[] for _ in models]
    for r in range(repeats):
        if progress is not None:
            progress(f"  compute: round {r + 1} of {repeats}")
        for j, (model, got, w) in enumerate(zip(models, times, waited)):
            # The longer prompt on the shallower model alone: the growth is per layer.
            long_prompt = PROBE_LONG_PROMPT_TOKENS if j == 0 else 0
            got.append(_time_model(model, vocab, prompt_tokens, steps, long_prompt))
            w.append(_time_synced(model, vocab, prompt_tokens, steps))

    def median(runs: list[_Timed], name: str) -> float:
        return statistics.median(getattr(t, name) for t in runs)

    decode, prefill = ([median(got, name) for got in times] for name in ("decode_s", "prefill_s"))
    # Never below the plain figures: the waits add time, and noise must not take it away.
    synced, layered = (
        [max(median(w, name), plain) for w, plain in zip(waited, figures)]
        for name, figures in (("decode_s", decode), ("prefill_s", prefill))
    )
    share = statistics.median(t.share for runs in (*times, *waited) for t in runs)
    growth = median(times[0], "growth")
    del models
    mx.clear_cache()
    if len(decode) == 1:
        counts = (counts[0], counts[0] + 1)  # one model: no per-layer slope to take
        decode, prefill, synced, layered = ([x[0], x[0] * 2] for x in (decode, prefill, synced, layered))
    return ComputeProbe(
        counts,
        tuple(decode),
        tuple(prefill),
        tuple(synced),
        tuple(layered),
        growth,
        str(mx.default_device()),
        dtype,
        share,
    )


# ---- the expected hit rate -------------------------------------------------------------


@dataclass(frozen=True)
class HitEstimate:
    """Expected shares of a layer's routings: in the pool, else in the host tier."""

    source: str
    pool_hit: list[float]  # per MoE layer
    tier_hit: list[float]  # of the misses, per MoE layer
    # Per layer, the experts' shares of routings (hottest first): the prefill's forecast.
    shares: list[list[float]] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "pool_hit": self.pool_hit, "tier_hit": self.tier_hit}


def _peek_table(path: Path) -> tuple[dict[int, dict[int, int]], int, str]:
    """A heat-format file's table and its total, read only (a corrupt file is the
    daemon's to set aside when it starts); ({}, 0, why) where it cannot be read, why ""
    where it is missing."""
    try:
        table = peek_usage(path)
    except FileNotFoundError:
        return {}, 0, ""
    except (OSError, ValueError) as e:
        return {}, 0, str(e)
    return table, sum(sum(c.values()) for c in table.values()), ""


def _shipped_with_the_demo(manifest: Manifest, shipped: Path) -> tuple[dict[int, dict[int, int]], int]:
    """What the package ships for the demo store (`shipped`), where `manifest` is the
    demo's; ({}, 0) for any other store."""
    demo = load_manifest(demo_store_path())
    if manifest.store_id != demo.store_id or not shipped.is_file():
        return {}, 0
    load = read_usage(shipped)
    return load.counts, load.total


def heat_counts(store: Path, settings: Settings, manifest: Manifest) -> tuple[dict[int, dict[int, int]], str]:
    """The routing counts to plan from, and where they come from."""
    path = usage_path(settings.heat_folder(store))
    saved, total, why = _peek_table(path)
    problem = f" (the saved heat {path} cannot be read: {why})" if why else ""
    if total > 0:
        return saved, f"saved heat {path} ({total} routings)"
    try:
        group, paths = group_usage(path.parent)
    except (OSError, ValueError) as e:
        group, paths, problem = {}, [], problem + f" (an expert-parallel group's heat cannot be read: {e})"
    total = sum(sum(c.values()) for c in group.values())
    if total > 0:
        where = f"{len(paths)} ranks of an expert-parallel group in {path.parent}"
        return group, f"the saved heat of {where} ({total} routings)"
    shipped, total = _shipped_with_the_demo(manifest, DEMO_COUNTS)
    if total > 0:
        return shipped, f"the demo model's recorded routing ({total} routings; no saved heat yet)"
    return {}, "no heat: assumed uniform" + problem


def heat_reuse(store: Path, settings: Settings, manifest: Manifest) -> tuple[dict[int, dict[int, int]], str]:
    """The LRU stack distances to plan from ({layer: {distance: count}}), and where they
    come from; ({}, "") where there are none (an unreadable file too: the counts stand in)."""
    path = settings.heat_folder(store) / POOL_REUSE_NAME
    saved, total, _ = _peek_table(path)
    experts = {layer.ordinal: layer.num_experts for layer in manifest.layers}
    # A distance past a layer's experts (or a layer the store lacks) is another model's.
    fits = all(
        layer in experts and all(0 <= d <= experts[layer] for d in distances) for layer, distances in saved.items()
    )
    if total > 0 and fits:
        return saved, f"the LRU stack distances in {path} ({total} routings)"
    shipped, total = _shipped_with_the_demo(manifest, DEMO_REUSE)
    if total > 0:
        return shipped, f"the demo trace's LRU stack distances ({total} routings)"
    return {}, ""


# The pool sizes `plan` prints an LRU pool's hit rate at, as shares of a layer's experts.
CURVE_SHARES = (0.125, 0.25, 0.5, 0.75)


def hit_curve(manifest: Manifest, reuse: Mapping[int, Mapping[int, int]]) -> dict[float, float]:
    """{share: an LRU pool's hit rate, the mean over the layers with stack distances} at
    CURVE_SHARES of each layer's experts (at least top-k slots); {} without any."""
    k = top_k_of(manifest.config)
    out = {}
    for share in CURVE_SHARES:
        rates = [
            lru_hit_rate(reuse[layer.ordinal], max(k, round(share * layer.num_experts)), k, layer.num_experts)
            for layer in manifest.layers
            if layer.ordinal in reuse
        ]
        rates = [r for r in rates if r is not None]
        if rates:
            out[share] = statistics.fmean(rates)
    return out


def estimate_hits(
    manifest: Manifest,
    counts: Mapping[int, Mapping[int, int]],
    source: str,
    slots: int,
    tier_experts: int,
    reuse: Mapping[int, Mapping[int, int]] | None = None,
    reuse_source: str = "",
) -> HitEstimate:
    """Each layer's hottest `slots` experts in the pool; the next hottest of the host
    tier's `tier_experts` (shared by all layers, split evenly) in the tier. With `reuse`
    (an LRU pool's stack distances, `heat_reuse`), a layer's hit rates are an LRU pool's
    of `slots`, and of the pool and its tier share together, instead."""
    layers = manifest.layers
    k = top_k_of(manifest.config)
    tier_per_layer = tier_experts / max(len(layers), 1)
    pool, tier, shares = [], [], []
    used_reuse = False
    for layer in layers:
        n = layer.num_experts
        c = counts.get(layer.ordinal, {})
        total = sum(c.values())
        share = sorted((c.get(e, 0) / total for e in range(n)), reverse=True) if total else [1.0 / n] * n
        s = min(slots, n)
        hit = 1.0 if s >= n else min(sum(share[:s]), 1.0)
        t_end = min(n, s + int(tier_per_layer))
        frac = tier_per_layer - int(tier_per_layer)
        in_tier = sum(share[s:t_end]) + (share[t_end] * frac if t_end < n else 0.0)
        lru = lru_hit_rate(reuse[layer.ordinal], s, k, n) if reuse and layer.ordinal in reuse and s < n else None
        if lru is not None:
            used_reuse = True
            both = 1.0 if t_end >= n else lru_hit_rate(reuse[layer.ordinal], t_end, k, n)
            hit, in_tier = lru, max(both - lru, 0.0)
        pool.append(hit)
        tier.append(in_tier / (1.0 - hit) if hit < 1.0 else 0.0)
        shares.append(share)
    return HitEstimate(reuse_source if used_reuse else source, pool, tier, shares)


# ---- the plan --------------------------------------------------------------------------


@dataclass
class Forecast:
    tokens_per_s: float
    bound_tokens_per_s: float
    bound_by: str  # compute | disk | link
    seconds: float | None = None  # a time to first token
    bound_seconds: float | None = None
    terms_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    store: str
    model_type: str
    moe_layers: int
    experts_per_layer: int
    top_k: int
    expert_bytes: int
    resident_bytes: int
    slots_per_layer: int
    pool_bytes: int
    host_cache_bytes: int
    kv_bytes_per_1k_tokens: int
    hits: HitEstimate
    bandwidths: Bandwidths
    compute: ComputeProbe
    decode: Forecast
    ttft: Forecast
    # A mapped pool (every expert in host memory, read in place; see `make_plan`).
    mapped: bool = False
    pool_probe: PoolProbe | None = None
    # An LRU pool's hit rate (mean over layers) at these shares of each layer's experts,
    # from the stack distances (`hit_curve`); empty without them.
    hit_curve: dict[float, float] = field(default_factory=dict)
    # A request's context and the memory left for KV caches (the daemon's `status` says the same).
    context: ContextLimit | None = None
    # Every file of the store but its manifest, and its experts' files.
    store_bytes: int = 0
    expert_file_bytes: int = 0
    # Where the pool was sized to fit a machine's memory (no --capacity or --memory-budget
    # given, and every expert does not fit): that memory, as `start --memory-budget` takes it.
    fitted_to: str | None = None

    @property
    def hit_rate(self) -> float:
        return statistics.fmean(self.hits.pool_hit)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        nested = ("bandwidths", "compute", "decode", "ttft")
        out = {k: v for k, v in d.items() if k not in ("hits", "pool_probe", *nested)}
        out.update(pool_probe=d["pool_probe"], hit_rate=self.hit_rate, hits=self.hits.to_dict())
        return out | {k: d[k] for k in nested}


# Below this share of a core, `plan` says the machine was busy while it probed.
BUSY_SHARE = 0.9


def _duration(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _bound(terms: Mapping[str, float]) -> str:
    return max(("compute", "disk", "link"), key=lambda k: terms.get(k, 0.0))


def _pool_slots(shape: StoreShape, settings: Settings) -> tuple[int, int]:
    """(resident bytes, pool slots per layer) as the daemon sizes them."""
    manifest, resident = shape.manifest, shape.resident_bytes
    slots = plan_capacity(
        manifest,
        capacity=settings.capacity,
        memory_budget=settings.memory_budget,
        resident_bytes=resident,
        max_tokens=kv_reserve_tokens(manifest.config, settings.max_context),
        top_k=top_k_of(manifest.config),
        prompt_cache_bytes=settings.prompt_cache_bytes,
    )
    return resident, slots


def _prefills_by_layer(prompt_tokens: int, partial: bool, top_k: int, slots: int) -> bool:
    """Whether the daemon prefills this prompt layer by layer (`LayerMajorPrefill.wanted`):
    a partial pool stages its layers' experts (`StreamingMoE.stacks_for`), and one chunk
    long enough goes so at every pool."""
    from ..model.prefill import LAYER_PROGRESS_TOKENS, chunk_sizes

    sizes = chunk_sizes(prompt_tokens)
    if not sizes:
        return False
    stacks = partial and (len(sizes) > 1 or max(sizes) * top_k > slots)
    return stacks or (len(sizes) == 1 and prompt_tokens >= LAYER_PROGRESS_TOKENS)


def make_plan(
    store: Path | StoreShape,
    settings: Settings,
    bandwidths: Bandwidths,
    compute: ComputeProbe,
    counts: Mapping[int, Mapping[int, int]],
    source: str,
    *,
    prompt_tokens: int = TTFT_PROMPT_TOKENS,
    mapped: bool = False,
    pool: PoolProbe | None = None,
    reuse: Mapping[int, Mapping[int, int]] | None = None,
    reuse_source: str = "",
    memory: tuple[int, str] | None = None,
) -> Plan:
    """The plan's arithmetic (see the module docstring): no probe, no MLX. `memory`: the
    device's (`device_memory`), which bounds the context where there is no memory budget
    (None: unknown, so only the model's own does). `mapped`: the
    pool is a mapped one (`daemon/model/streaming_model.py` `choose_mapped`): every
    expert sits in host memory, so no miss comes from disk, and its decode reads the
    routing back once per token, not once per layer (no sync term). `pool`: the pool
    probe of this configuration (daemon/pool_probe.py), whose host time per MoE layer
    then stands for the sync term; None: the sync term alone. `reuse`: the LRU stack
    distances (`heat_reuse`), used where the pool's policy is LRU or the pool is mapped.
    `store`: a store's folder, or the shape of one (`StoreShape`)."""
    shape = store if isinstance(store, StoreShape) else StoreShape.of_store(store)
    manifest = shape.manifest
    k = top_k_of(manifest.config)
    resident, slots = _pool_slots(shape, settings)
    expert = max(layer.expert_bytes for layer in manifest.layers)
    pool_bytes = sum(min(slots, layer.num_experts) * layer.expert_bytes for layer in manifest.layers)
    tier_experts = settings.host_cache // expert if expert else 0
    # Stack distances describe an LRU pool (and stand in for a mapped one's rebalancing).
    if not (mapped or settings.policy == "lru"):
        reuse = None
    hits = estimate_hits(manifest, counts, source, slots, tier_experts, reuse, reuse_source)
    partial = any(slots < layer.num_experts for layer in manifest.layers)
    layers = layer_count(manifest.config)

    # Decode: per token, k routings per MoE layer; the misses come over the link, from
    # the host tier or (its misses) from the store.
    misses = sum(k * (1.0 - h) for h in hits.pool_hit)
    # Each layer's reads from the store, read together and waited for: at that batch's rate.
    disk_per_layer = [0.0 if mapped else k * (1.0 - h) * (1.0 - t) for h, t in zip(hits.pool_hit, hits.tier_hit)]
    disk_s = sum(n * expert / bandwidths.decode_read_rate(n) for n in disk_per_layer if n > 0)
    compute_s = compute.at(compute.decode_s, layers)
    # The probe waits after every decoder layer; a slot pool, after every MoE layer.
    waits_s = max(compute.at(compute.synced_decode_s, layers) - compute_s, 0.0) * len(manifest.layers) / layers
    terms = {
        "compute": compute_s,
        "sync": waits_s if partial and not mapped and pool is None else 0.0,
        # The pool's own host work (its read-backs and waits with it).
        "pool": pool.host_s(len(manifest.layers), bandwidths.link_bytes_per_s) if partial and pool is not None else 0.0,
        "disk": disk_s,
        "link": misses * expert / bandwidths.link_bytes_per_s,
    }
    bound_s = terms["compute"] + terms["disk"] + terms["link"]
    decode = Forecast(1.0 / sum(terms.values()), 1.0 / bound_s, _bound(terms), terms_s=terms)

    # First token of a prompt: every expert its tokens route, brought in once per layer.
    fill_missing = fill_disk = 0.0
    for share, layer, t in zip(hits.shares, manifest.layers, hits.tier_hit):
        s = min(slots, layer.num_experts)
        routed = sum(1.0 - (1.0 - p) ** (prompt_tokens * k) for p in share[s:])
        fill_missing += routed
        fill_disk += 0.0 if mapped else routed * (1.0 - t)
    by_layer = _prefills_by_layer(prompt_tokens, partial, k, slots)
    # Per prompt token at the probe's prompt, and with what its longer mean context adds.
    per_token = compute.at(compute.layered_prefill_s if by_layer else compute.prefill_s, layers)
    per_token *= 1.0 + compute.prefill_growth * max(prompt_tokens - PROBE_PROMPT_TOKENS, 0) / 2
    pterms = {
        "compute": per_token * prompt_tokens,
        "disk": fill_disk * expert / bandwidths.read_bytes_per_s,
        "link": fill_missing * expert / bandwidths.link_bytes_per_s,
    }
    ttft_s = sum(pterms.values()) + terms["compute"]
    ttft = Forecast(
        prompt_tokens / ttft_s,
        prompt_tokens / max(pterms.values()),
        _bound(pterms),
        seconds=ttft_s,
        bound_seconds=max(pterms.values()),
        terms_s=pterms,
    )
    return Plan(
        store=shape.name,
        model_type=manifest.model_type,
        moe_layers=len(manifest.layers),
        experts_per_layer=max(layer.num_experts for layer in manifest.layers),
        top_k=k,
        expert_bytes=expert,
        resident_bytes=resident,
        slots_per_layer=slots,
        pool_bytes=pool_bytes,
        host_cache_bytes=settings.host_cache,
        kv_bytes_per_1k_tokens=kv_cache_bytes(manifest.config, 1024),
        hits=hits,
        bandwidths=bandwidths,
        compute=compute,
        decode=decode,
        ttft=ttft,
        mapped=mapped,
        pool_probe=pool if partial else None,
        hit_curve=hit_curve(manifest, reuse) if reuse else {},
        store_bytes=shape.store_bytes,
        expert_file_bytes=sum(
            layer.stride * sum(map(manifest.holds, range(layer.num_experts))) for layer in manifest.layers
        ),
        context=context_limit(
            manifest.config,
            settings.max_context,
            settings.memory_budget,
            memory,
            memory_held(manifest, resident, pool_bytes, slots, settings.prompt_cache_bytes),
        ),
    )


def save_compute(folder: Path, store_id: str, compute: ComputeProbe) -> None:
    """Keep a store's compute probe for `plan --no-probe`."""
    _keep_json(folder, f"compute-{store_id}.json", compute.to_dict())


def load_compute(folder: Path, store_id: str) -> ComputeProbe | None:
    """The last compute probe of the store, or None where there is none (or it cannot be read)."""
    try:
        # A probe from before a field was added lacks it: probed again.
        return from_json(ComputeProbe, json.loads((folder / f"compute-{store_id}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_pool_probes(folder: Path, store_id: str, probes: Mapping[tuple[float, bool], PoolProbe]) -> None:
    """Keep a store's pool probes (with those kept before, by configuration) for `plan
    --no-probe`."""
    merged = {**load_pool_probes(folder, store_id), **probes}
    _keep_json(folder, f"pools-{store_id}.json", [p.to_dict() for p in merged.values()])


def load_pool_probes(folder: Path, store_id: str) -> dict[tuple[float, bool], PoolProbe]:
    """The store's kept pool probes by (capacity, mapped); none where they cannot be read."""
    try:
        rows = json.loads((folder / f"pools-{store_id}.json").read_text())
        probes = [PoolProbe.from_dict(d) for d in rows]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {(p.capacity, p.mapped): p for p in probes}


def _pool_share(shape: StoreShape, settings: Settings) -> float:
    """The planned pool's slots as a share of a layer's experts."""
    _, slots = _pool_slots(shape, settings)
    return slots / max(layer.num_experts for layer in shape.manifest.layers)


def plan_store(store: Path, settings: Settings, **options: Any) -> Plan:
    """`plan_shape` (and its `options`) of the store at `store`."""
    return plan_shape(StoreShape.of_store(store), settings, **options)


# The share of a Mac's unified memory that its GPU may use (Metal's recommended working
# set): about three quarters on the larger Macs; approximate, and raised with
# `sudo sysctl iogpu.wired_limit_mb=...`.
MAC_GPU_SHARE = 0.75


def mac_memory(total: int) -> tuple[int, str]:
    """The memory a model may use on a Mac of `total` bytes of unified memory, and what it is."""
    return int(total * MAC_GPU_SHARE), f"a {format_size(total)} Mac's GPU share (about {MAC_GPU_SHARE:.0%})"


def plan_shape(
    shape: StoreShape,
    settings: Settings,
    *,
    probe: bool = True,
    progress: Callable[[str], None] | None = None,
    memory: tuple[int, str] | None = None,
    disk_bandwidth: float | None = None,
) -> Plan:
    """The plan of a store, or of one before its pull (`StoreShape`): probe (or, with
    `probe=False`, take the last probe's figures where there are any) and plan with
    `settings`. `memory`: the machine's (default: this one's, `device_memory`); with no
    --capacity or --memory-budget the pool is sized to fit it where every expert does
    not. `disk_bandwidth`: the store's read rate, given (another Mac's disk) rather than
    probed. `progress`: called with a line per probe."""
    from ...shared.settings import default_state_dir

    say = progress or (lambda line: None)
    manifest = shape.manifest
    state = default_state_dir(os.environ)
    memory = memory or device_memory()
    settings, fitted = fit_to_memory(shape, settings, memory)
    bandwidths = _bandwidths(shape, settings, state, probe, disk_bandwidth, say)
    dtype = shape.dtype
    key_id = probe_key(manifest.config, dtype)
    compute = None if probe else load_compute(state, key_id)
    if compute is None:
        say("probing compute: random-weight models of the store's architecture")
        compute = probe_compute(manifest, dtype, progress=say)
        save_compute(state, key_id, compute)
    mapped = _would_map(shape, settings)
    key = (_pool_share(shape, settings), mapped)
    pool = None if probe else load_pool_probes(state, key_id).get(key)
    if pool is None and key[0] < 1.0:
        say(f"probing the {'mapped' if mapped else 'slot'} pool at {key[0]:.0%}: a small random model streamed")
        probes = probe_pools_of(shape.tokenizer_dir, manifest, dtype, [key], settings, state, progress=say)
        save_pool_probes(state, key_id, probes)
        pool = probes.get(key)
    if shape.store is not None:
        counts, source = heat_counts(shape.store, settings, manifest)
        reuse, reuse_source = heat_reuse(shape.store, settings, manifest)
    else:
        (counts, source), (reuse, reuse_source) = ({}, "no heat: assumed uniform"), ({}, "")
    plan = make_plan(
        shape,
        settings,
        bandwidths,
        compute,
        counts,
        source,
        mapped=mapped,
        pool=pool,
        reuse=reuse,
        reuse_source=reuse_source,
        memory=memory,
    )
    plan.fitted_to = fitted
    return plan


def fit_to_memory(shape: StoreShape, settings: Settings, memory: tuple[int, str]) -> tuple[Settings, str | None]:
    """`settings` with the pool sized to fit `memory` where neither a capacity nor a
    budget is given and every expert does not fit (else as they are), and that memory as
    `start --memory-budget` takes it (None where nothing was fitted)."""
    if settings.capacity is not None or settings.memory_budget is not None:
        return settings, None
    fit = settings.replace(memory_budget=memory[0])
    try:
        _, slots = _pool_slots(shape, fit)
    except PoolCapacityError as e:
        raise PoolCapacityError(f"this model does not fit in {memory[1]}: {e}") from None
    if slots >= max(layer.num_experts for layer in shape.manifest.layers):
        return settings, None
    flag = f"{memory[0] / 2**30:.4g}G" if memory[0] >= 2**30 else f"{memory[0] // 2**20}M"
    return fit, f"{format_size(memory[0])} ({memory[1]}): `start --memory-budget {flag}`"


def _bandwidths(
    shape: StoreShape,
    settings: Settings,
    state: Path,
    probe: bool,
    disk_bandwidth: float | None,
    say: Callable[[str], None],
) -> Bandwidths:
    """The last probe's figures (without `probe`), else probed now: a store's reads (a
    scratch file's where the store is yet to be pulled) and the link; the disk's rate
    replaced by `disk_bandwidth` where given (and then not probed)."""
    bandwidths = None if probe else load_bandwidths(state)
    if bandwidths is None and disk_bandwidth is not None:
        from .bandwidth import measure_link_bandwidth

        say("probing the host->pool link")
        link, kind, _ = measure_link_bandwidth()
        bandwidths = Bandwidths(disk_bandwidth, link, kind, "probed now")
    if bandwidths is None:
        say(f"probing the {'store' if shape.store is not None else 'disk'}'s reads and the host->pool link")
        bandwidths = probe_bandwidths(shape, settings.io_threads)
        save_bandwidths(state, bandwidths)
    if disk_bandwidth is not None:
        source = f"disk given; link {bandwidths.source}"
        bandwidths = replace(bandwidths, read_bytes_per_s=disk_bandwidth, read_by_batch={}, source=source)
    return bandwidths


def probe_pools_of(
    tokenizer_dir: Path,
    manifest: Manifest,
    dtype: str,
    configs: list[tuple[float, bool]],
    settings: Settings,
    folder: Path,
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[float, bool], PoolProbe]:
    """The pool probes (daemon/pool_probe.py) of these (capacity share, mapped)
    configurations of the store (`tokenizer_dir`: where its tokenizer files are), on the
    probe's shorter model."""
    from .pool_probe import probe_pools

    layers = probe_layer_counts(layer_count(manifest.config))
    return probe_pools(
        tokenizer_dir, manifest, dtype, configs, settings, layers=layers, folder=folder, progress=progress
    )


def _would_map(shape: StoreShape, settings: Settings) -> bool:
    """Whether the daemon would make a mapped pool with these settings (its own rule)."""
    if settings.mapped is not None:
        return settings.mapped
    import psutil

    from ..model.streaming_model import choose_mapped
    from ..pool.admission import cuda_copier

    _, slots = _pool_slots(shape, settings)
    _, cuda_why_not = cuda_copier()
    return choose_mapped(shape.manifest, slots, settings, psutil.virtual_memory().available, cuda_why_not)[0]


def _context_text(c: ContextLimit) -> str:
    own = f"the model's {c.model_tokens}" if c.model_tokens else "the model names none"
    room = f"; {format_size(c.kv_room_bytes)} of {c.memory} left for KV caches" if c.kv_room_bytes is not None else ""
    return f"{c.tokens} tokens per request, bound by {c.bound} ({own}{room})"


def format_plan(p: Plan) -> str:
    d, t = p.decode, p.ttft
    bw = p.bandwidths
    per_layer = [f"{h:.0%}" for h in p.hits.pool_hit]
    layers = f"every layer {per_layer[0]}" if len(set(per_layer)) == 1 else "per layer " + ", ".join(per_layer)

    def terms(f: Forecast) -> str:
        return ", ".join(f"{k} {_duration(v)}" for k, v in f.terms_s.items() if v)

    return "\n".join(
        [
            f"{p.store}: {p.model_type}, {p.moe_layers} MoE layers x {p.experts_per_layer} experts "
            f"(top-{p.top_k}, {format_size(p.expert_bytes)} each)",
            f"  store      {format_size(p.store_bytes)} on disk ({format_size(p.expert_file_bytes)} of experts)",
            f"  resident   {format_size(p.resident_bytes)} of weights that stay in memory",
            f"  pool       {p.slots_per_layer} slots per layer, {format_size(p.pool_bytes)}"
            + (f"; host tier {format_size(p.host_cache_bytes)}" if p.host_cache_bytes else "")
            + (f"; sized to fit {p.fitted_to}" if p.fitted_to else ""),
            f"  KV cache   {format_size(p.kv_bytes_per_1k_tokens)} per 1k tokens of context",
        ]
        + ([f"  context    {_context_text(p.context)}"] if p.context is not None else [])
        + [
            f"  hit rate   {p.hit_rate:.1%} expected in the pool ({layers}); from {p.hits.source}",
        ]
        + (
            [
                "  by size    an LRU pool of "
                + " / ".join(f"{share:.3g}" for share in (100 * x for x in p.hit_curve))
                + "% of the experts hits "
                + " / ".join(f"{rate:.0%}" for rate in p.hit_curve.values())
            ]
            if p.hit_curve
            else []
        )
        + [
            f"  bandwidth  disk {format_size(bw.read_bytes_per_s)}/s"
            + (
                " (a few reads at a time: "
                + ", ".join(f"{b}: {format_size(r)}/s" for b, r in sorted(bw.read_by_batch.items()))
                + ")"
                if bw.read_by_batch
                else ""
            )
            + f", {bw.link_kind} {format_size(bw.link_bytes_per_s)}/s ({bw.source})",
            f"  decode     {d.tokens_per_s:.1f} tok/s forecast; bound {d.bound_tokens_per_s:.1f} tok/s by {d.bound_by} "
            f"({terms(d)} per token)",
            f"  TTFT       {t.seconds:.2f} s forecast for a {TTFT_PROMPT_TOKENS}-token prompt; bound "
            f"{t.bound_seconds:.2f} s by {t.bound_by} ({terms(t)})",
            f"  probe      resident compute on {p.compute.device}: random-weight models of {p.compute.layers[0]} and "
            f"{p.compute.layers[1]} layers, {1e3 * p.compute.per_layer(p.compute.decode_s):.3f} ms per layer per token",
        ]
        + (
            [
                f"  busy       the machine gave the probe {p.compute.cpu_share:.0%} of a core (other work on its "
                "cores): its times are scaled to an idle machine's"
            ]
            if p.compute.cpu_share < BUSY_SHARE
            else []
        )
        + (
            [
                f"  pool probe the {'mapped' if pp.mapped else 'slot'} pool at {pp.slots} of {pp.experts} experts "
                f"streaming the same models (hit {pp.hit_rate:.0%}): "
                f"{1e3 * pp.host_s(p.moe_layers, bw.link_bytes_per_s) / p.moe_layers:.3f} ms of host work per MoE "
                "layer per token"
            ]
            if (pp := p.pool_probe) is not None
            else []
        )
    )
