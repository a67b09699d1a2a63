"""The pool's own time per MoE layer, probed before a store is loaded (`moestreamctl plan`).

A partial pool's decode costs more than its model's compute and its bytes' moves: each
MoE layer reads its routing back to the host and waits for it, then the host looks the
experts up, tells the policy, chooses victims, ranks the next layer and launches the
admission and prefetch copies, while the device waits for the next layer. On the H200
that work was about as large as the compute itself for a slot pool with a host tier
(tests/bench/RESULTS.md, "The H200 table with the probe first"), and no byte count
gives it.

So the probe runs the code that does it: random-weight models of the store's
architecture at the compute probe's two depths (daemon/plan.py `probe_config`: at most
64 experts a layer) are written as stores of their own into a temporary folder, then
decoded as stock mlx-lm and streamed through moestream's pool at the planned share of
their experts (a slot pool with a host tier holding every expert, or a mapped pool).
Their embeddings are scaled, and each step is fed the next token of a fixed text, so
that routing varies from token to token as a trained model's does (at mlx-lm's
initialisation nearly every token routes to the same experts, and a random model's
greedy text soon repeats one token: a pool would never miss). The streamed models' extra
time, extrapolated along their MoE layers and less the link time of their own misses, is
the pool's host time (`PoolProbe.host_s`); the plan adds its own misses' bytes at the
link's and the disk's rates.

A slot pool without a host tier is probed with one: its reads then cost memory copies,
not the disk's time, which the plan's disk term holds.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

from ...shared.settings import Settings
from ...shared.store_format import Manifest
from ..pool.capacity import top_k_of
from .probe_models import probe_config, random_model

if TYPE_CHECKING:
    from ..model.streaming_model import StreamingModel

# Token embeddings times this: routing then follows the token, not the near-constant
# residual stream of a random model (tests/bench/make_random_moe.py measured an LRU hit
# rate at 25% of 0.29 at 64 on the q30 shape, near a real model's 0.30).
PROBE_EMBED_SCALE = 64.0
T = TypeVar("T")


@dataclass(frozen=True)
class PoolProbe:
    """One pool configuration's probe: per decode token, the probe's models of two
    depths plain and streamed, and what the streamed pools missed."""

    capacity: float
    mapped: bool
    moe_layers: tuple[int, int]  # of the two models
    plain_s: tuple[float, float]
    pooled_s: tuple[float, float]
    # Per token and MoE layer, over both models: routed experts the pool lacked.
    misses_per_layer: float
    hit_rate: float
    expert_bytes: int
    slots: int  # of the probe models' `experts` per layer
    experts: int

    def host_s(self, moe_layers: int, link_bytes_per_s: float) -> float:
        """The pool's time per token beyond compute for a model of `moe_layers` MoE
        layers: the streamed models' extra time, extrapolated along their MoE layers as
        the compute probe extrapolates (a per-token part and a per-layer part), less
        their own misses' copies over a link of `link_bytes_per_s`."""
        (m0, m1), extra = self.moe_layers, [q - p for q, p in zip(self.pooled_s, self.plain_s)]
        slope = (extra[1] - extra[0]) / (m1 - m0) if m1 > m0 else extra[0] / max(m0, 1)
        at = extra[0] + (moe_layers - m0) * max(slope, 0.0)
        own_link = self.misses_per_layer * self.expert_bytes / link_bytes_per_s
        return max(at - own_link * moe_layers, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolProbe:
        return from_json(cls, d)


def from_json(cls: type[T], d: Mapping[str, Any]) -> T:
    """The dataclass `cls` from its `asdict` read back from JSON (its lists made tuples
    again); KeyError for a field it lacks, other keys left out."""
    return cls(**{f.name: tuple(d[f.name]) if isinstance(d[f.name], list) else d[f.name] for f in fields(cls)})


def write_probe_store(config: dict[str, Any], dtype: str, folder: Path, tokenizer: list[Path]) -> Path:
    """A random-weight model of `config` (daemon/plan.py `random_model`, embeddings
    scaled) saved with the `tokenizer` files (the planned store's: a store is loaded
    with its tokenizer) and converted into a store under `folder`; returns the store."""
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from ..store.convert import convert_model

    model_dir = folder / "model"
    model = random_model(config, dtype, PROBE_EMBED_SCALE)
    save_model(model_dir, model, donate_model=True)
    save_config(dict(config), model_dir / "config.json")
    for f in tokenizer:
        shutil.copy2(f, model_dir / f.name)
    del model
    mx.clear_cache()
    store = folder / "store"
    convert_model(model_dir, store)
    for f in model_dir.iterdir():
        f.unlink()
    model_dir.rmdir()
    return store


def _decode_s(model: Any, vocab: int, steps: int, repeats: int, after_token: Callable[[], None] | None = None) -> float:
    """Decode s/token, the median of `repeats` decodes of `steps` tokens after a
    PROMPT_TOKENS prompt. Each step is fed the next token of a fixed pseudo-random text,
    not the model's own choice (a random model's greedy text soon repeats one token, and
    with it one routing), and waits for the step before, as generate_step does.
    `after_token`: called after each step is queued, as the generation loop calls a
    mapped pool's `tick` (its routing read back, counted and rebalanced)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    text = [(i * 7919 + 13) % vocab for i in range(PROMPT_TOKENS + steps)]
    times = []
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([text[:PROMPT_TOKENS]]), cache=cache))
        tic = time.perf_counter()
        last = None
        for token in text[PROMPT_TOKENS:]:
            out = mx.argmax(model(mx.array([[token]]), cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(out)
            if last is not None:
                last.item()
            if after_token is not None:
                after_token()
            last = out
        mx.eval(last)
        times.append((time.perf_counter() - tic) / steps)
    return statistics.median(times)


PROMPT_TOKENS = 4


def decode_counters(sm: "StreamingModel") -> dict[str, float]:
    """A streaming model's cumulative counters that decode figures are taken from (as
    differences over a decode)."""
    s = sm.pool_stats()
    placed = s.mapped_pool or {}
    a = sm.admitter.stats()
    pf = sm.prefetcher.stats() if sm.prefetcher is not None else None
    return {
        "hits_decode": s.hits_decode,
        "misses_decode": s.misses_decode,
        "host_syncs": s.host_syncs,
        "quiesces": s.quiesces,
        "prestaged": s.prestaged,
        "prestaged_used": s.prestaged_used,
        # The prefetcher's own reads (into its buffer) and promotions into pools.
        "prefetch_bytes_read": pf.get("bytes_read", 0) if pf else 0,
        "prefetch_promoted": pf.get("promoted", 0) if pf else 0,
        "bytes_from_disk": a.get("bytes_from_disk", 0),
        "bytes_to_pool": a.get("bytes_to_pool", 0),
        "prestage_bytes": a.get("prestage_bytes", 0),
        "copy_seconds": a.get("copy_seconds", 0.0),
        "tier_hits": a.get("tier_hits", 0),
        "tier_misses": a.get("tier_misses", 0),
        "placed_routed": placed.get("routed", 0),
        "placed_on_gpu": placed.get("routed_on_gpu", 0),
        "placement_moves": placed.get("moves", 0),
        # Host time of the decode thread (read-back, counts), and of the placement's
        # worker thread (policies, driver calls), which runs beside it.
        "placement_seconds": placed.get("readback_seconds", 0.0),
        "placement_worker_seconds": placed.get("decide_seconds", 0.0) + placed.get("place_seconds", 0.0),
    }


def probe_pools(
    store: Path,
    manifest: Manifest,
    dtype: str,
    configs: list[tuple[float, bool]],
    settings: Settings,
    *,
    layers: tuple[int, int],
    folder: Path | None = None,
    steps: int = 16,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[tuple[float, bool], PoolProbe]:
    """Probe each (capacity: a fraction of the experts, mapped) pool configuration of
    the `store` (`manifest`) where it is a partial pool of the probe's experts, with
    models of the store's architecture of `layers` layers (daemon/plan.py
    `probe_layer_counts`); `settings` gives the policy, prefetch and copy settings the
    daemon would run with. The probe stores live in a temporary folder in `folder`
    (None: the system's), each removed once timed. `progress`: called with a line per
    model and pool timed."""
    import mlx.core as mx

    from ...shared.store_format import load_manifest
    from ..model.streaming_model import load_stock_model, load_streaming_model

    tokenizer = [store / name for name in manifest.tokenizer_files]
    # Per configuration, per depth: (MoE layers, plain s, pooled s, hits, misses).
    runs: dict[tuple[float, bool], list[tuple[int, float, float, int, int]]] = {}
    shape: dict[tuple[float, bool], tuple[int, int, int]] = {}
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: None)
    for depth in sorted(set(layers)):
        say(f"  pool: a model of {depth} layers, its store written and timed unstreamed")
        config = probe_config(manifest.config, depth)
        cfg = config.get("text_config", config)
        vocab = int(cfg.get("vocab_size") or cfg["num_vocab"])
        with tempfile.TemporaryDirectory(prefix="moestream-pool-probe-", dir=folder) as tmp:
            probe_store = write_probe_store(config, dtype, Path(tmp), tokenizer)
            probe = load_manifest(probe_store)
            keys = [(layer.ordinal, e) for layer in probe.layers for e in range(layer.num_experts)]
            expert = max(layer.expert_bytes for layer in probe.layers)
            most = max(layer.num_experts for layer in probe.layers)
            plain_model = load_stock_model(probe_store)
            _decode_s(plain_model, vocab, 2, 1)  # kernels built
            plain = _decode_s(plain_model, vocab, steps, repeats)
            del plain_model
            mx.clear_cache()
            for capacity, mapped in configs:
                # The planned share of the probe's (fewer) experts, never below top-k.
                slots = max(math.ceil(capacity * most), top_k_of(config))
                if slots >= most:
                    continue  # nothing to stream: no pool work
                say(f"  pool: the same model streamed, {slots} of {most} experts a layer{' mapped' if mapped else ''}")
                run_settings = Settings(
                    capacity=slots,
                    policy=settings.policy,
                    io_threads=settings.io_threads,
                    prefetch=settings.prefetch,
                    # A tier that holds every expert: a slot pool's misses cost copies,
                    # not the disk's time (the plan's disk term).
                    host_cache=(len(keys) + 1) * expert,
                    copy_kernel=settings.copy_kernel,
                    prefetch_copy_blocks=settings.prefetch_copy_blocks,
                    mapped_rebalance_tokens=settings.mapped_rebalance_tokens,
                )
                sm = load_streaming_model(probe_store, run_settings, mapped=mapped)
                try:
                    warm = getattr(sm.admitter, "warm", None)
                    if sm.mapped_pool is None and warm is not None:
                        warm(list(probe.layers), keys)
                    # Without its tick a mapped pool never reads its routing back: no
                    # counts, no rebalance, and its misses (read over the link in place)
                    # uncounted, so host_s took their link time for host work.
                    tick = sm.mapped_pool.tick if sm.mapped_pool is not None else None
                    _decode_s(sm.model, vocab, steps, 1, tick)  # kernels built, the pool filled
                    if sm.mapped_pool is not None:
                        sm.mapped_pool.settle()
                    before = decode_counters(sm)
                    pooled = _decode_s(sm.model, vocab, steps, repeats, tick)
                    if sm.mapped_pool is not None:
                        sm.mapped_pool.settle()
                    after = decode_counters(sm)
                finally:
                    sm.close()
                    del sm
                    mx.clear_cache()
                d = {k: after[k] - before[k] for k in before}
                hits, misses = d["hits_decode"], d["misses_decode"]
                if mapped and d["placed_routed"]:
                    # Its counts take in the prompts' forwards too: their shares, at the
                    # decode's routings (top-k a layer a step).
                    routings = top_k_of(config) * steps * repeats * len(probe.layers)
                    missed = (d["placed_routed"] - d["placed_on_gpu"]) / d["placed_routed"]
                    hits, misses = (1.0 - missed) * routings, missed * routings
                runs.setdefault((capacity, mapped), []).append((len(probe.layers), plain, pooled, hits, misses))
                shape[(capacity, mapped)] = (expert, slots, most)
    out = {}
    for key, rows in runs.items():
        if len(rows) == 1:
            rows = rows * 2  # one depth: no per-layer slope, the per-layer mean instead
        hits = sum(r[3] for r in rows)
        misses = sum(r[4] for r in rows)
        expert, slots, most = shape[key]
        out[key] = PoolProbe(
            capacity=key[0],
            mapped=key[1],
            moe_layers=(rows[0][0], rows[-1][0]),
            plain_s=(rows[0][1], rows[-1][1]),
            pooled_s=(rows[0][2], rows[-1][2]),
            # Decode forwards only (a prompt's forward counts as a prefill's).
            misses_per_layer=misses / sum(steps * repeats * r[0] for r in rows),
            hit_rate=hits / (hits + misses) if hits + misses else 1.0,
            expert_bytes=expert,
            slots=slots,
            experts=most,
        )
    return out
