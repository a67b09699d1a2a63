"""Load an expert store as a streaming mlx-lm model.

The model is built by mlx-lm's own classes from the manifest's config, quantized the way
`mlx_lm.utils.load_model` quantizes it, and given the resident weights; every
`SwitchGLU`/`SwitchMLP` the manifest names is wrapped in a `StreamingMoE` whose expert
tensors are the pool's slot arrays. The stacked expert tensors are never materialised.
"""

from __future__ import annotations

import contextlib
import copy
import typing
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import psutil
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_tokenizer

from ..._native import CudaCopier
from ...shared.settings import Settings, format_size
from ...shared.status import LayerStatus, PoolTotals
from ...shared.store_format import Manifest, StoreError, load_manifest
from ..mapped.mapped_pool import CountingMover, MappedPool, MappedPoolStats
from ..mapped.row_gather import RowGather
from ..policies import make_policy
from ..pool.admission import Admitter, DirectAdmitter, cuda_copier, make_admitter
from ..pool.capacity import EXPERT_COUNT_KEYS, kv_reserve_tokens, plan_capacity, top_k_of_blocks
from ..pool.expert_pool import ExpertPool, PoolCapacityError, PoolStats
from ..pool.expert_reader import ExpertReader
from ..pool.resident_routing import ResidentRouting
from ..prefetch.predictor import make_prefetcher, next_layers, routers_of
from ..prefetch.prefetcher import Prefetcher
from ..store.layout import beside_experts
from ..store.quantize import quantize_like_weights
from .chat import turn_end
from .diagnostics import Diagnostics
from .expert_parallel import ExpertShare
from .kv_buckets import default_continuation_bucket
from .mtp_head import load_mtp_head
from .optimistic import OptimisticDecode
from .prefill import LayerMajorPrefill, UnsupportedModel
from .streaming_moe import StreamingMoE

# How many of the lowest MoE layers' routing a pool hands its policy as a hint.
LOWER_HINT_LAYERS = 4
# Host memory a mapped pool leaves free beyond its experts: the resident weights are
# read through it, and the rest of the process and the system need room too.
MAPPED_HOST_MARGIN = 2 * 2**30


def counter_fields(stats_type: type) -> tuple[str, ...]:
    """The counters of a statistics dataclass: its int and float fields, in order (not
    arrays such as `PoolStats.routed`, the per-expert counts for heat)."""
    hints = typing.get_type_hints(stats_type)
    return tuple(f.name for f in fields(stats_type) if hints[f.name] in (int, float))


# The one list of each pool's counters: a field added to the dataclass is summed by
# `pool_stats` and taken per request (daemon/model/generation.py) with the rest.
POOL_COUNTERS = counter_fields(PoolStats)
PLACEMENT_COUNTERS = counter_fields(MappedPoolStats)
_read_counters = attrgetter(*POOL_COUNTERS)


@dataclass
class StreamingModel:
    """A loaded store: the model, its tokenizer, and the pools that feed it."""

    model: nn.Module
    tokenizer: Any
    manifest: Manifest
    pools: list[ExpertPool]
    reader: ExpertReader
    # How experts reach the pools (straight from the store, or through host memory).
    admitter: Admitter
    admission_note: dict[str, Any]
    store_dir: Path
    capacity: int
    resident_bytes: int
    # False when the reader came with a shared admitter (benchmarks share one host tier).
    owns_reader: bool = True
    # Loaded on the first speculative request that needs them (daemon/model/speculative.py),
    # through `mtp_head()` and `draft_model()`: the store's MTP head, and draft models by path.
    _mtp: Any = field(default=None, init=False, repr=False)
    _draft_models: OrderedDict[str, Any] = field(default_factory=OrderedDict, init=False, repr=False)
    # The chat template's end of turn (`turn_end()`), found on first use: (text or None,).
    _turn_end: tuple[str | None] | None = field(default=None, init=False, repr=False)
    # Draft models kept between requests (least recently used out first): each may be GBs,
    # and a request may name any path.
    max_draft_models: int = 1
    # The diagnostics switch and totals (daemon/model/diagnostics.py), and the prefetcher of
    # predicted experts (daemon/prefetch/prefetcher.py; None where every pool is full,
    # which a mapped pool's are: it has no prefetch).
    diagnostics: Any = None
    prefetcher: Any = None
    # The mapped pool (every expert in host memory, the hottest in GPU memory), else None.
    mapped_pool: MappedPool | None = None
    # The routing counts of the fully resident pools of a model without a mapped pool,
    # from the first `routing_readback()` on (daemon/pool/resident_routing.py).
    resident_routing: ResidentRouting | None = field(default=None, init=False, repr=False)
    # The layer-major prefill (daemon/model/prefill.py), None where `prefill = chunk` or
    # the model's forward does not have the shape it drives (then `prefill_note` says why).
    layer_major: LayerMajorPrefill | None = None
    prefill_note: str = ""
    # This rank's share of an expert-parallel group (daemon/model/expert_parallel.py), else None.
    share: ExpertShare | None = None
    # Keys of short continuations after a cached prefix are padded to multiples of this
    # (daemon/model/kv_buckets.py `continue_prompt`; CUDA only), else 0.
    continuation_bucket: int = 0
    # A vision-language store's mlx-vlm model (daemon/model/vision.py), else None: the
    # model takes no images.
    vision: Any = None
    # The optimistic decode forwards of a model with partial slot pools
    # (daemon/model/optimistic.py), else None.
    optimistic: OptimisticDecode | None = None

    def mtp_head(self) -> Any:
        """The store's multi-token-prediction head (daemon/model/mtp_head.py), loaded on
        first use and kept for later requests."""
        if self._mtp is None:
            self._mtp = load_mtp_head(self.store_dir, self.manifest.config)
        return self._mtp

    def turn_end(self) -> str | None:
        """The text a chat's answer ends at where no end token spells it
        (daemon/model/chat.py `turn_end`): one render of the chat template, on the
        first chat request, not on every one."""
        if self._turn_end is None:
            self._turn_end = (turn_end(self.tokenizer),)
        return self._turn_end[0]

    def draft_model(self, path: str, load: Callable[[str], nn.Module]) -> nn.Module:
        """The draft model at `path` (a resolved path: the key), made by `load(path)` on
        first use (which checks it against this model) and kept for later requests: the
        `max_draft_models` used last. A request running with one evicted keeps its own
        reference until it ends."""
        model = self._draft_models.get(path)
        if model is None:
            model = load(path)
            while len(self._draft_models) >= self.max_draft_models:
                self._draft_models.popitem(last=False)
            self._draft_models[path] = model
        self._draft_models.move_to_end(path)
        return model

    def routing_readback(self) -> MappedPool | ResidentRouting | None:
        """What reads the routing of the fully resident pools back once per token (its
        `tick` after each token, `settle` at the end): the mapped pool's placement, else
        the fully resident pools' counts, started on the first call (from then on their
        forwards log ids, which only ticks consume: a caller that never ticks never
        calls this). None where no pool is fully resident, or in an expert-parallel
        group (its resident path counts nothing yet)."""
        if self.mapped_pool is not None:
            return self.mapped_pool
        if self.resident_routing is None and self.share is None:
            full = [p for p in self.pools if p.fully_resident]
            if full:
                self.resident_routing = ResidentRouting(full)
        return self.resident_routing

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards that are no request's (the batch's probe at load): what they route is
        read back, then left out of the pools' counters, so of every request's statistics
        and of the heat."""
        saved = [(p.stats, copy.deepcopy(p.stats)) for p in self.pools]
        if self.mapped_pool is not None:
            saved.append((self.mapped_pool.stats, copy.deepcopy(self.mapped_pool.stats)))
        try:
            yield
        finally:
            readback = self.mapped_pool if self.mapped_pool is not None else self.resident_routing
            if readback is not None:
                readback.settle()
            for p in self.pools:
                p.flush()  # the forwards' accounting a hit left for later, before the counters go back
            for stats, before in saved:
                # In place: the pools' readers hold these objects.
                for f in fields(before):
                    setattr(stats, f.name, getattr(before, f.name))

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def counters(self) -> dict[str, float]:
        """The cumulative counters, summed over layers (POOL_COUNTERS), and the mapped
        pool's as `placement_<name>` (PLACEMENT_COUNTERS): what a request's share of the
        work is taken from, as differences."""
        # Read twice per request per turn of the engine loop (a batch's every member,
        # every step): one attrgetter per pool, summed by column, takes a third of the
        # time of a getattr per counter.
        columns = zip(*(_read_counters(p.stats) for p in self.pools))
        totals: dict[str, float] = dict.fromkeys(POOL_COUNTERS, 0)
        totals.update(zip(POOL_COUNTERS, map(sum, columns)))
        if self.mapped_pool is not None:
            for key in PLACEMENT_COUNTERS:
                totals["placement_" + key] = getattr(self.mapped_pool.stats, key)
        return totals

    def pool_stats(self) -> PoolTotals:
        """Totals over layers, plus per-layer occupancy and hit rates."""
        counters = self.counters()
        totals = {key: counters[key] for key in POOL_COUNTERS}
        layers = []
        for i, p in enumerate(self.pools):
            layers.append(
                LayerStatus(
                    layer=p.layer.ordinal,
                    resident=int((p.slot_of >= 0).sum()),
                    capacity=p.capacity,
                    pinned=len(p.pinned),
                    hit_rate=p.stats.hit_rate(),
                    routed=p.stats.routed_total,
                    on_gpu=len(self.mapped_pool.on_gpu[i]) if self.mapped_pool is not None else None,
                )
            )
        mapped = self.mapped_pool
        return PoolTotals(
            **totals,
            hit_rate=PoolStats(**totals).hit_rate(),
            layers=layers,
            admission=self.admitter.stats() | self.admission_note,
            prefill_order=self.prefill_note,
            mapped=mapped is not None,
            mapped_pool={"gpu_slots": mapped.gpu_slots, **mapped.stats.to_dict()} if mapped is not None else None,
        )

    def close(self) -> None:
        try:
            # Copies the CUDA copier queued without waiting (a host tier's prestage into
            # the next layer's slots) write into this model's pools: they must land
            # before the pools can be freed and their memory handed to other arrays.
            self.admitter.settle()
            if self.prefetcher is not None:
                self.prefetcher.drain()
            if self.resident_routing is not None:
                self.resident_routing.close()
            if self.mapped_pool is not None:
                self.mapped_pool.close()  # raises what its worker failed with, if anything
        finally:
            if self.owns_reader:
                self.reader.close()


def _module_at(root: nn.Module, path: str) -> tuple[Any, str | int, nn.Module]:
    """(parent, key in parent, module) for a dotted parameter path like model.layers.3.mlp.switch_mlp."""
    parent: Any = None
    key: str | int = ""
    node: Any = root
    for part in path.split("."):
        parent = node
        key = int(part) if part.isdigit() and isinstance(node, list) else part
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise StoreError(f"the model has no module {path!r} (store and mlx-lm disagree)") from None
    return parent, key, node


def _quantize(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array], manifest: Manifest) -> None:
    quantization = config.get("quantization")
    if quantization is None:
        if config.get("quantization_config"):
            raise StoreError(
                "the store's config has a 'quantization_config' but no mlx 'quantization'; "
                "convert the model again with this moestream"
            )
        return
    fixed = {k: v for k, v in quantization.items() if isinstance(v, (dict, bool))}
    fixed.update(
        {
            f"{layer.module_path}.{proj}": q or False
            for layer in manifest.layers
            for proj, q in layer.quantization.items()
        }
    )
    quantize_like_weights(model, quantization, weights, fixed)


def _build_model(store: Path, manifest: Manifest) -> tuple[nn.Module, dict[str, mx.array]]:
    """The mlx-lm model of the manifest's config, quantized, and its resident weights."""
    config = dict(manifest.config)
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise StoreError(f"{store}: {e} (mlx-lm {__import__('mlx_lm').__version__})") from e
    model = model_class(args_class.from_dict(config))
    weights: dict[str, mx.array] = {}
    for name in manifest.resident_files:
        path = store / name
        if not path.is_file():
            raise StoreError(f"{store}: resident weights file {name} is missing")
        try:
            weights.update(mx.load(str(path)))
        except (RuntimeError, ValueError) as e:  # MLX's reader: a truncated or corrupt file
            raise StoreError(
                f"{store}: resident weights file {name} cannot be read ({e}); convert the store again"
            ) from e
    _quantize(model, config, weights, manifest)
    # Its initial weights (replaced by the store's) drew on MLX's global random key, lazily:
    # never evaluated, the key's graph kept every draw of every build (0.11 MiB of the
    # daemon's RSS per load: keep-alive reloads, draft models). Evaluated, it is one key.
    mx.eval(mx.random.state)
    return model, weights


def _load_resident(model: nn.Module, weights: dict[str, mx.array], manifest: Manifest, store: Path) -> None:
    """Load every weight but the experts' projections into the (unwrapped) model."""
    expert_prefixes = tuple(
        f"{layer.module_path}.{projection}."
        for layer in manifest.layers
        for projection in {t.name.rsplit(".", 1)[0] for t in layer.tensors}
    )
    expected = {k for k, _ in tree_flatten(model.parameters()) if not k.startswith(expert_prefixes)}
    missing = expected - weights.keys()
    extra = weights.keys() - expected
    if missing or extra:
        raise StoreError(
            f"{store}: resident weights do not match the model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
        )
    model.load_weights(list(weights.items()), strict=False)
    model.eval()


def load_streaming_model(
    store_dir: str | Path,
    settings: Settings,
    *,
    max_tokens: int | None = 4096,
    naive: bool = False,
    admitter: Admitter | None = None,
    mapped: bool | None = None,
    host_available: int | None = None,
    share: ExpertShare | None = None,
) -> StreamingModel:
    """Load a store for streaming. A memory budget keeps room for a KV cache of
    `max_tokens` tokens when it sizes the pool (None: `settings.max_context`, else the
    model's context up to KV_RESERVE_TOKENS: `kv_reserve_tokens`). `naive=True` is the
    on-demand baseline of the benchmarks: a pool of top-k slots that reuses nothing
    between forwards. An
    `admitter` (with its reader) may be shared between models of the same store; the
    model then leaves closing its reader to the caller.

    `mapped` (default `settings.mapped`) makes a mapped pool (daemon/mapped/mapped_pool.py):
    every expert in host memory, `capacity` experts per layer in GPU memory. It is
    refused before anything is allocated when host memory (`host_available` bytes,
    default what the system reports available), or a host tier given with it, cannot
    hold every expert. None (auto) decides by `choose_mapped` once the capacity is
    known: a host tier that holds every expert is then made as a mapped pool.

    `share` (daemon/model/expert_parallel.py): this rank's share of an expert-parallel
    group; its pools, capacity, reads and prefetch cover only the experts it owns (a
    capacity is then a fraction of the share), with the slot pool and the chunked
    prefill (the paths expert parallelism runs through so far)."""
    store = Path(store_dir)
    full = load_manifest(store)
    check_shard(full, store, share)
    manifest = full if share is None else share.manifest_view(full)
    if host_available is None:
        host_available = psutil.virtual_memory().available
    mapped = _mapped_asked(manifest, settings, mapped, share, host_available)
    config = manifest.config
    model, weights = _build_model(store, manifest)
    resident_bytes = sum(v.nbytes for v in weights.values())
    found = [_module_at(model, layer.module_path) for layer in manifest.layers]
    k = top_k_of_blocks([parent for parent, _, _ in found], config)
    capacity = (
        k
        if naive
        else plan_capacity(
            manifest,
            capacity=settings.capacity,
            memory_budget=settings.memory_budget,
            resident_bytes=resident_bytes,
            max_tokens=kv_reserve_tokens(config, settings.max_context) if max_tokens is None else max_tokens,
            top_k=k,
            prompt_cache_bytes=settings.prompt_cache_bytes,
        )
    )
    # One copier for the whole load: the admitter's copies and a mapped pool's moves.
    copier, cuda_why_not = cuda_copier()
    auto_note = None
    if mapped is None:
        mapped, auto_note = choose_mapped(
            manifest, capacity, settings, host_available, cuda_why_not, naive=naive or admitter is not None
        )
    owns_reader = admitter is None
    if admitter is None:
        reader = ExpertReader(
            store, manifest, threads=settings.io_threads, direct=settings.direct_io, verify=settings.verify_checksums
        )
    else:
        reader = admitter.reader
    # mapped_gather auto: where the CUDA copy kernel runs (measured there; see Settings).
    kernel = RowGather.kernel_available()
    use_gather = kernel if settings.mapped_gather is None else settings.mapped_gather
    gather = RowGather(use_kernel=kernel) if mapped and use_gather else None
    try:
        admitter, note = _admission(reader, manifest, settings, mapped, gather, admitter, (copier, cuda_why_not))
        if auto_note is not None:
            note["mapped_auto"] = auto_note
        for layer, (_, _, module) in zip(full.layers, found):
            if not isinstance(module, (SwitchGLU, SwitchMLP)):
                raise StoreError(f"{layer.module_path} is a {type(module).__name__}, not a SwitchGLU/SwitchMLP")
            _check_layout(module, layer, store, manifest.config)
        slots = [layer.num_experts if mapped else min(capacity, layer.num_experts) for layer in manifest.layers]
        # Every pool with a slot per expert loads them all (but the naive baseline's).
        resident = [not naive and n == layer.num_experts for n, layer in zip(slots, manifest.layers)]
        # The MoE block that holds each layer's experts has its router (`gate`).
        routers = routers_of(manifest.layers, [parent for parent, _, _ in found])
        diagnostics = Diagnostics(default=settings.diagnostics)
        prefetcher = make_prefetcher(
            manifest.layers,
            routers,
            resident,
            reader=reader,
            manifest=manifest,
            admitter=admitter,
            top_k=k,
            prefetch=settings.prefetch,
            predict=not naive,
            depth=settings.prefetch_depth,
            buffer_bytes=settings.prefetch_buffer,
        )
        pools = _make_pools(manifest, slots, settings.policy, admitter, k, naive, gather, prefetcher, mapped=mapped)
        # Resident weights first, while the model is as the store's names know it (a
        # module beside the experts, e.g. a norm, sits inside the module wrapped next).
        _load_resident(model, weights, manifest, store)
        # Decode forwards that check residency every few layers instead of at each: a
        # slot pool's, where some layer is partial.
        optimistic = None if mapped or naive or share is not None or all(resident) else OptimisticDecode(diagnostics)
        streaming = []
        for (parent, key, module), pool, nxt in zip(found, pools, next_layers(pools, routers, settings.prefetch_depth)):
            parent[key] = StreamingMoE(module, pool, diagnostics, nxt, prefetcher, share, optimistic)
            streaming.append((parent[key], pool.layer.module_path))
        if optimistic is not None and not optimistic.install(model, streaming):
            optimistic = None
        vision = None
        if manifest.takes_images and share is None:
            vision = _load_vision(store, manifest, weights, pools, diagnostics)
            resident_bytes += vision.nbytes
        mx.eval(model.parameters())
        for pool, full_pool in zip(pools, resident):
            if full_pool:
                pool.load_all()
        mapped_pool = _place(pools, capacity, settings, copier) if mapped else None
        if share is None:
            layer_major, prefill_note = _layer_major(model, settings)
        else:
            layer_major, prefill_note = None, "chunk: expert-parallel (one all_sum per layer and chunk)"
        tokenizer = load_tokenizer(store, eos_token_ids=config.get("eos_token_id"))
    except BaseException:
        if owns_reader:
            reader.close()
        raise
    return StreamingModel(
        model=model,
        tokenizer=tokenizer,
        manifest=manifest,
        pools=pools,
        reader=reader,
        admitter=admitter,
        admission_note=note,
        store_dir=store,
        capacity=capacity,
        resident_bytes=resident_bytes,
        owns_reader=owns_reader,
        diagnostics=diagnostics,
        prefetcher=prefetcher,
        mapped_pool=mapped_pool,
        layer_major=layer_major,
        prefill_note=prefill_note,
        max_draft_models=settings.max_draft_models,
        share=share,
        continuation_bucket=default_continuation_bucket(),
        vision=vision,
        optimistic=optimistic,
    )


def _mapped_asked(
    manifest: Manifest, settings: Settings, mapped: bool | None, share: ExpertShare | None, host_available: int
) -> bool | None:
    """Whether the load makes a mapped pool (None: `choose_mapped` decides once the
    capacity is known); one asked for is refused here, before anything is allocated,
    where host memory or a host tier given with it cannot hold every expert."""
    if share is not None:
        if mapped or settings.mapped:
            raise PoolCapacityError("expert parallelism runs with the slot pool: drop --mapped")
        return False
    mapped = settings.mapped if mapped is None else mapped
    need, host_cache = manifest.expert_bytes_total, settings.host_cache
    if mapped and host_cache and host_cache < need:
        # A host tier given with `--mapped` is the mapped pool, so it must hold every
        # expert; a smaller one asks for the slot pool's tier, which `--mapped` is not.
        raise PoolCapacityError(
            f"--mapped keeps every expert ({format_size(need)}) in host memory, more than --host-cache "
            f"{format_size(host_cache)}: give a --host-cache of at least that, or drop --mapped "
            "(the slot pool then keeps a tier of that size)"
        )
    if mapped:
        check_mapped_host_memory(manifest, host_available)
    return mapped


def _make_pools(
    manifest: Manifest,
    slots: list[int],
    policy: str,
    admitter: Admitter,
    top_k: int,
    naive: bool,
    gather: RowGather | None,
    prefetcher: Prefetcher | None,
    *,
    mapped: bool,
) -> list[ExpertPool]:
    """A pool of `slots[i]` slots per MoE layer, each with its eviction policy; the naive
    baseline's reuse nothing between forwards."""
    pools: list[ExpertPool] = []
    for layer, n in zip(manifest.layers, slots):
        pools.append(
            ExpertPool(
                layer,
                n,
                make_policy(policy, layer.num_experts, n),
                admitter,
                top_k=top_k,
                reuse=not naive,
                host_memory=mapped,
                gather=gather,
                lower=pools[:LOWER_HINT_LAYERS],
                prefetcher=prefetcher,
            )
        )
    return pools


def _admission(
    reader: ExpertReader,
    manifest: Manifest,
    settings: Settings,
    mapped: bool,
    gather: RowGather | None,
    shared: Admitter | None,
    cuda: tuple[CudaCopier | None, str | None],
) -> tuple[Admitter, dict[str, Any]]:
    """What brings experts into the pools, and the note `status` shows of it: a mapped
    pool's direct reads, the admitter another model of the store shares, else one made
    for this load (a host tier, the CUDA copier)."""
    if mapped:
        note: dict[str, Any] = {"mapped": True, "gather": gather is not None}
        if settings.host_cache:
            note["host_tier"] = "mapped: it holds every expert, read in place"
        return DirectAdmitter(reader), note
    if shared is not None:
        return shared, {"shared": True}
    return make_admitter(
        reader,
        manifest,
        settings.host_cache,
        cuda=cuda,
        copy_kernel=settings.copy_kernel,
        ahead_blocks=settings.prefetch_copy_blocks,
    )


def _place(pools: list[ExpertPool], gpu_slots: int, settings: Settings, copier: CudaCopier | None) -> MappedPool:
    """The mapped pool's placement of every layer's hottest experts in GPU memory."""
    mover = copier if copier is not None else CountingMover()
    placement = MappedPool(pools, gpu_slots, mover, rebalance_tokens=settings.mapped_rebalance_tokens)
    placement.place_initial()
    return placement


def check_mapped_host_memory(manifest: Manifest, available: int, margin: int = MAPPED_HOST_MARGIN) -> None:
    """Raise `PoolCapacityError` when `available` bytes of host memory cannot hold every
    expert of the store plus `margin`."""
    need = manifest.expert_bytes_total
    if available < need + margin:
        raise PoolCapacityError(
            f"--mapped keeps every expert in host memory: the store's experts take {format_size(need)} "
            f"(+ {format_size(margin)} to spare), but only {format_size(available)} is available; "
            "use --host-cache SIZE (a cache of the hottest experts in host memory) or drop --mapped"
        )


def _load_vision(
    store: Path, manifest: Manifest, weights: dict[str, mx.array], pools: list[ExpertPool], diagnostics: Diagnostics
):
    """The vision-language model's tower and language model (daemon/model/vision.py),
    its MoE layers streaming from the same pools as the text model's."""
    from .vision import load_vision

    def stream(vlm: nn.Module) -> None:
        for layer, pool in zip(manifest.layers, pools):
            parent, key, module = _module_at(vlm, layer.module_path)
            parent[key] = StreamingMoE(module, pool, diagnostics)

    return load_vision(store, manifest, weights, lambda m, w: _quantize(m, manifest.config, w, manifest), stream)


def _layer_major(model: nn.Module, settings: Settings) -> tuple[LayerMajorPrefill | None, str]:
    if settings.prefill == "chunk":
        return None, "chunk: stock's order (prefill = chunk)"
    try:
        prefill = LayerMajorPrefill(model, stage_ahead_blocks=settings.mapped_stage_ahead_blocks)
        return prefill, "layer: a partial pool's prompt goes through one layer at a time"
    except UnsupportedModel as e:
        return None, f"chunk: {e}"


def choose_mapped(
    manifest: Manifest,
    capacity: int,
    settings: Settings,
    host_available: int,
    cuda_why_not: str,
    *,
    naive: bool = False,
) -> tuple[bool, str]:
    """`mapped = auto`: whether to make a mapped pool, and why. Mapped where it measured
    fastest and is safe: an NVIDIA GPU (the pool's misses are read over the link; on
    unified memory and the CPU there is nothing to place), a partial pool, host RAM for
    every expert plus the margin, and no host tier asked for or one that holds every
    expert (tests/bench/RESULTS.md, "The mapped pool", has the figures).

    A host tier that holds every expert is made as a mapped pool: the same experts in
    host memory, but read in place by the kernels (gathered first where the copy kernel
    runs) instead of copied into slots after the routing of each layer is read back,
    one host sync per layer that bounds the slot pool's tier at every capacity. A
    smaller tier keeps the slot pool, which reads the experts the tier lacks from disk.
    `cuda_why_not` is what `cuda_copier` said: empty where the CUDA copier is
    available, else why not."""
    if naive:
        return False, "off: a benchmark's own pool"
    if cuda_why_not:
        return False, f"off: {cuda_why_not}"
    if all(capacity >= layer.num_experts for layer in manifest.layers):
        return False, "off: every expert fits in the pool"
    need_tier = manifest.expert_bytes_total
    if settings.host_cache and settings.host_cache < need_tier:
        return False, (
            f"off: --host-cache {format_size(settings.host_cache)} holds part of the experts "
            f"({format_size(need_tier)}): the slot pool with a host tier"
        )
    need = need_tier + MAPPED_HOST_MARGIN
    if host_available < need:
        return False, f"off: host RAM {format_size(host_available)} available, every expert needs {format_size(need)}"
    if settings.host_cache:
        return True, "on: an NVIDIA GPU, a partial pool and a host tier that holds every expert, read in place"
    return True, "on: an NVIDIA GPU, a partial pool and host RAM for every expert"


def check_shard(manifest: Manifest, store: Path, share: ExpertShare | None) -> None:
    """StoreError unless the store holds every expert the process reads: a shard store
    (`convert --shard i/N`) serves only as rank i of a group of N."""
    if manifest.shard is None:
        return
    index, count = manifest.shard
    if share is None:
        raise StoreError(
            f"{store} is shard {index}/{count} of its model (`convert --shard`): it holds only the experts "
            f"e % {count} == {index}, for rank {index} of an expert-parallel group of {count} (--distributed); "
            "one process needs a whole store"
        )
    if (share.rank, share.size) != (index, count):
        raise StoreError(
            f"{store} is shard {index}/{count} of its model, but this is rank {share.rank} of {share.size}: each rank "
            f"needs its own shard (`convert --shard {share.rank}/{share.size}`) or a whole store"
        )


def load_stock_model(store_dir: str | Path) -> nn.Module:
    """The same model as stock mlx-lm holds it: every expert resident in the original
    `SwitchGLU`/`SwitchMLP`, no streaming layer. The baseline of the benchmarks."""
    store = Path(store_dir)
    manifest = load_manifest(store)
    check_shard(manifest, store, None)
    model, weights = _build_model(store, manifest)
    for layer in manifest.layers:
        _, _, module = _module_at(model, layer.module_path)
        _check_layout(module, layer, store, manifest.config)
        raw = np.fromfile(store / layer.file, dtype=np.uint8)
        if raw.size < layer.num_experts * layer.stride:
            raise StoreError(f"{store / layer.file} is truncated")
        blocks = raw[: layer.num_experts * layer.stride].reshape(layer.num_experts, layer.stride)
        for t in layer.tensors:
            part = np.ascontiguousarray(blocks[:, t.offset : t.offset + t.nbytes])
            stacked = mx.array(part).view(getattr(mx, t.dtype)).reshape(layer.num_experts, *t.shape)
            projection, param = t.name.rsplit(".", 1)
            getattr(module, projection)[param] = stacked
    _load_resident(model, weights, manifest, store)
    mx.eval(model.parameters())
    return model


def _check_layout(module: nn.Module, layer, store: Path, config: dict[str, Any]) -> None:
    """The store's per-expert tensors must be exactly the module's stacked tensors."""
    beside = set(beside_experts(module))
    params = {k: v for k, v in tree_flatten(module.parameters()) if k.split(".", 1)[0] not in beside}
    names = {t.name for t in layer.tensors}
    if set(params) != names:
        raise StoreError(
            f"{store}: layer {layer.module_path}: the store holds {sorted(names)}, "
            f"but the model expects {sorted(params)}"
        )
    for t in layer.tensors:
        p = params[t.name]
        if p.shape[0] != layer.num_experts:
            # The model is built from the manifest's config, the layer files hold what was
            # converted: a differing count means the config was edited or belongs elsewhere.
            scope = config.get("text_config") or config
            key = next((k for k in EXPERT_COUNT_KEYS if k in scope or k in config), None)
            says = f"gives {key} = {p.shape[0]}" if key else f"makes a model of {p.shape[0]} experts per layer"
            raise StoreError(
                f"{store}: layer {layer.module_path} holds {layer.num_experts} experts in {layer.file}, but the "
                f"manifest's config {says}: the config does not match the store's layer files "
                "(was it edited? convert the model again)"
            )
        # Dtypes are not compared: like stock loading, the file's dtype wins.
        if tuple(p.shape) != (layer.num_experts, *t.shape):
            raise StoreError(
                f"{store}: layer {layer.module_path}, tensor {t.name}: the store has shape {list(t.shape)} per "
                f"expert, the model built from its config expects {list(p.shape)[1:]}"
            )
