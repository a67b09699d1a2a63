"""What the daemon reports, typed end to end: `Status` (the `status` reply) and
`RequestStats` (a request's statistics, in its `done` event). The engine fills them once
(daemon/engine_loop.py, daemon/model/generation.py); `moestreamctl status`, the dashboard
and the gateway read their fields, under the names the daemon gave them. On the socket
they travel as msgpack maps (`dataclasses.asdict`, shared/protocol.py `encode`) and come
back through `from_wire`, which checks each nested map's shape. A key a newer daemon adds
is left out, a field an older one lacks keeps its default. Imports no MLX.

Reports that a module keeps in its own shape (the heat keeper's health, autopin's
summary, the batch's, the prompt cache's, prefetch's, the diagnostics') travel as that
module's `to_dict`, a map of numbers and words, typed here as `Report`."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Mapping, TypeVar, Union

T = TypeVar("T")
# A module's own report (its `to_dict`): names and numbers the module documents.
Report = dict[str, Any]


def from_wire(cls: type[T], value: Any) -> T:
    """`value` (a map from msgpack or JSON) as `cls`, its nested dataclasses made too;
    ValueError where a nested map or list is not one."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{cls.__name__}: expected a map, got {type(value).__name__}")
    hints = _type_hints(cls)
    given = {f.name: _convert(hints[f.name], value[f.name], f.name) for f in fields(cls) if f.name in value}
    missing = [
        f.name for f in fields(cls) if f.name not in given and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ValueError(f"{cls.__name__}: missing {missing}")
    return cls(**given)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # costly: every reply and event a client reads comes through here


def _convert(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if is_dataclass(tp) and isinstance(tp, type):
        own = tp.__dict__.get("from_dict")  # one with its own normalizing (RequestInfo)
        return own.__get__(None, tp)(value) if own is not None else from_wire(tp, value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: expected a list, got {type(value).__name__}")
        items = [_convert(typing.get_args(tp)[0], v, name) for v in value]  # list[X], tuple[X, ...]
        return items if origin is list else tuple(items)
    return value


class _Wire:
    """`to_dict` for the dataclasses below (`from_wire` makes them again)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


# ---- a request's statistics (`done`) -------------------------------------------------


@dataclass(frozen=True)
class PhaseCounts(_Wire):
    """Counted by phase of the request: the prompt and the first token's forward, then the rest."""

    prefill: int = 0
    decode: int = 0


@dataclass(frozen=True)
class CacheUseStats(_Wire):
    """The request's use of the prompt cache (daemon/model/generation.py `CacheUse`)."""

    reused_tokens: int = 0
    from_disk: bool = False
    fetch_seconds: float = 0.0
    # Its prompt's prefill was another request's: in flight (joined), or suspended (resumed).
    joined: bool = False
    resumed: bool = False


@dataclass(frozen=True)
class ConstraintStats(_Wire):
    """A constrained request's grammar (daemon/model/constrain.py)."""

    kind: str
    tokens_checked: int
    # The host's milliseconds per token in the grammar's processor (excluding the wait for
    # the token it follows, which the mask needs before it can be built).
    mask_ms_per_token: float | None = None
    speculative: str | None = None  # "off": asked for, and dropped


@dataclass(frozen=True)
class RequestStats(_Wire):
    """One request's statistics, as `done` carries them."""

    prompt_tokens: int = 0
    # Of them, those served from the prompt cache (not prefilled again).
    cached_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    prompt_tokens_per_s: float | None = None
    decode_seconds: float = 0.0
    tokens_per_s: float | None = None
    hits: PhaseCounts = field(default_factory=PhaseCounts)
    misses: PhaseCounts = field(default_factory=PhaseCounts)
    hit_rate: float | None = None
    bytes_read: int = 0
    evictions: int = 0
    # Experts prefetch copied into the next layer's slots ahead of use, and those of them
    # routed (counted among the hits).
    prestaged: int = 0
    prestaged_used: int = 0
    # Routed (token, expert) pairs counted for heat (pool_usage.json), all layers.
    routed_experts: int = 0
    # Per decode token: the pool's syncs (one per MoE layer with a partial pool) plus the
    # one that reads the sampled token.
    host_syncs_per_token: float | None = None
    capacity: int | None = None
    mapped: bool = False
    policy: str | None = None
    peak_memory_bytes: int = 0
    rss_bytes: int = 0
    finish_reason: str = "length"
    stop_string: str | None = None
    # The prefill's order and work (daemon/model/prefill.py `PrefillStats`), with the bytes
    # read from the store and staged for it.
    prefill: Report = field(default_factory=dict)
    prompt_cache: CacheUseStats | None = None
    # The batch's totals when the request ended (daemon/model/batching.py).
    batch: Report | None = None
    # Its share of a mapped pool's placement work (`MappedPoolStats`'s names).
    mapped_pool: Report | None = None
    speculative: Report | None = None
    speculative_off: str | None = None  # why it decoded without the speculation it asked for
    constraint: ConstraintStats | None = None
    prefetch: Report | None = None
    diagnostics: Report | None = None
    # Filled by the engine: its wait in the queue, the prefill pieces begun after a stop was
    # asked (none: a stop takes effect at the end of the piece in flight; None: no stop),
    # and the elastic pool's resizes while it ran.
    queued_seconds: float | None = None
    prefill_pieces_after_stop: int | None = None
    pool_resizes: int | None = None


# ---- the daemon's status -------------------------------------------------------------


Phase = Literal["queued", "prefill", "decode", "paused"]
PHASES: tuple[Phase, ...] = ("queued", "prefill", "decode", "paused")


@dataclass(frozen=True)
class RequestInfo(_Wire):
    """One request as `status` lists it (requests.running, requests.waiting): what
    `moestreamctl status` and the dashboard's table of requests show."""

    id: str
    # Who sent it: the name a client gave (generate's `client`), else its connection as
    # the daemon's log names it.
    client: str
    # queued: waiting for its prompt's check or a turn; prefill: its prompt is being
    # processed (no token yet); decode: it has made its first token; paused: its client
    # reads none of its replies (not stepped until it does, cancelled after a while).
    phase: Phase
    # The prompt's tokens (None until its prompt is checked), and while it is prefilled,
    # how many of them are done of how many it prefills (a cached prefix is not prefilled).
    prompt_tokens: int | None
    prefilled_tokens: int | None
    prefill_total: int | None
    tokens: int  # made so far
    max_tokens: int
    seconds: float  # since the daemon received it

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestInfo:
        """From `status` (a daemon that predates a field leaves it None, or unknown)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = dict.fromkeys(known)
        values.update({k: v for k, v in d.items() if k in known})
        values["client"] = values["client"] or "unknown"
        values["tokens"] = int(values["tokens"] or 0)
        values["max_tokens"] = int(values["max_tokens"] or 0)
        values["seconds"] = float(values["seconds"] or 0.0)
        if values["phase"] not in PHASES:
            values["phase"] = "decode" if values["tokens"] else "prefill"
        return cls(**values)


# The elastic pool (daemon/pool/elastic.py makes these): its size now, the pressure it reads,
# and each resize with why.


@dataclass(frozen=True)
class ResizeEvent(_Wire):
    """One resize of the pool (and host tier), between two decode steps."""

    at: float  # wall-clock seconds (time.time()) when the pool reached its new size
    level: str  # the pressure read: normal, warn or critical
    reason: str  # why, in words: the level and what the source saw
    slots_from: int  # slots per MoE layer (the widest layer's)
    slots_to: int
    pool_bytes_from: int
    pool_bytes_to: int
    tier_bytes_from: int  # the host tier's (0: none)
    tier_bytes_to: int
    experts_moved: int  # given back (a shrink) or read back in (a grow), over every layer
    seconds: float  # from the reading to the pool at its new size


@dataclass(frozen=True)
class ElasticStatus(_Wire):
    """`status`'s `elastic`: off (with why) or the pool's size, bounds and last events."""

    source: str | None  # where the pressure is read; None: off
    note: str  # why off, or the rule in a few words
    level: str  # the last level read
    detail: str  # what the source saw then
    slots: int  # slots per MoE layer now (the widest layer's)
    configured_slots: int  # what the pool was made with (--capacity, --memory-budget)
    floor_slots: int  # the floor: top-k
    tier_bytes: int  # the host tier now (0: none)
    configured_tier_bytes: int
    # Below the floor: new requests are refused until the pressure passes.
    refusing: bool
    refused: int  # requests refused so far
    events: list[ResizeEvent] = field(default_factory=list)  # the last ones, oldest first


@dataclass(frozen=True)
class ContextLimit(_Wire):
    """A request's context (its prompt and the tokens it makes), and how it was found:
    `max_context` where set, else the model's own (`model_tokens`), at most what
    `kv_room_bytes` holds at `kv_bytes_per_token` (`bound` says which bound it)."""

    tokens: int
    model_tokens: int | None
    kv_bytes_per_token: int
    # The memory the budget (or the device) leaves for KV caches once the model holds its
    # share, and where that memory figure came from.
    kv_room_bytes: int | None
    memory: str
    # "max_context" (set), "model" (the model's own), or "memory" (what the room holds).
    bound: str


@dataclass(frozen=True)
class LayerStatus(_Wire):
    """One MoE layer's pool."""

    layer: int
    resident: int
    capacity: int
    pinned: int
    hit_rate: float | None
    # Routed (token, expert) pairs so far: the dashboard's routings per second.
    routed: int
    on_gpu: int | None = None  # a mapped pool's experts in GPU memory


@dataclass(frozen=True)
class PrefillOrder(_Wire):
    """The prefill's order (daemon/model/prefill.py) and what its layer stacks staged
    from the pool's memory (what they read from the store is in the pool's bytes_read)."""

    order: str | None = None
    stacked_layers: int = 0
    staged_bytes: int = 0


@dataclass(frozen=True)
class PoolStatus(_Wire):
    hit_rate: float | None = None
    evictions: int | None = None
    bytes_read: int | None = None
    # Experts prefetch copied into a layer's slots ahead of use, and of them those the
    # layer then routed to (counted among the hits).
    prestaged: int = 0
    prestaged_used: int = 0
    layers: list[LayerStatus] = field(default_factory=list)
    mapped: bool = False
    mapped_auto: str | None = None  # with `mapped = auto`: what it chose and why
    mapped_pool: Report | None = None  # the placement's counters (`MappedPoolStats`)
    prefill: PrefillOrder = field(default_factory=PrefillOrder)


@dataclass
class PoolCounters:
    """A pool's counters (daemon/pool/expert_pool.py `PoolStats` counts them per layer,
    `PoolTotals` carries their sums): counts over unique experts per forward."""

    hits_prefill: int = 0
    hits_decode: int = 0
    misses_prefill: int = 0
    misses_decode: int = 0
    evictions: int = 0
    bytes_read: int = 0
    host_syncs: int = 0
    # Waits for the model's streams before writing slots (`_quiesce`): each costs a
    # round trip to the device even when the streams are idle.
    quiesces: int = 0
    # Prefill forwards whose experts did not fit in the pool (served from scratch).
    overflow_forwards: int = 0
    # Layer-major prefills (daemon/model/prefill.py): layers staged into a transient
    # stack, and the bytes copied into those stacks from the pool's own memory (what
    # they read from the store is in bytes_read).
    stacked_layers: int = 0
    staged_bytes: int = 0
    # Experts copied in ahead of use from host memory (`prestage`), and how many of
    # them the next forward routed to (counted among the hits).
    prestaged: int = 0
    prestaged_used: int = 0
    # Routed (token, expert) pairs counted for heat: a partial pool's on its way, a fully
    # resident one's when they are read back (daemon/pool/resident_routing.py).
    routed_total: int = 0


@dataclass
class PoolTotals(PoolCounters, _Wire):
    """The pool's counters summed over its layers, its hit rate, each layer's occupancy,
    and the admission's and the placement's reports: `stats`' pool, built by
    `StreamingModel.pool_stats`."""

    hit_rate: float | None = None
    layers: list[LayerStatus] = field(default_factory=list)
    # The admission's own report (daemon/pool/admission.py: mode, host tier, gather).
    admission: Report = field(default_factory=dict)
    prefill_order: str | None = None
    mapped: bool = False
    mapped_pool: Report | None = None  # the placement's counters (`MappedPoolStats`) and gpu_slots


@dataclass(frozen=True)
class MemoryStatus(_Wire):
    rss_bytes: int | None = None
    mlx_active_bytes: int | None = None
    mlx_peak_bytes: int | None = None
    resident_weights_bytes: int | None = None
    pool_bytes: int | None = None
    host_tier_bytes: int | None = None  # None: no model loaded; 0: no tier
    kv_bytes: int | None = None
    mlx_cache_bytes: int | None = None


@dataclass
class ServerCounters(_Wire):
    """What the I/O thread refused or dropped (daemon/server.py counts them)."""

    refused_busy: int = 0  # requests of new clients past max_connections
    shut_near_file_limit: int = 0  # connections shut down at once, near the open-file limit
    paused_accepting: int = 0  # times the socket was renamed away, near the open-file limit
    dropped: int = 0  # clients gone, or not reading their replies
    dropped_not_reading: int = 0  # of them, clients that read nothing held for UNREAD_SECONDS
    paused: int = 0  # times a client's reply queue filled: its requests paused until it read
    ignored_messages: int = 0  # messages of dropped clients, not served


@dataclass
class ClientsStatus(ServerCounters):
    connected: int = 0
    with_requests: int = 0
    # The setting, at most what the open-file limit leaves (daemon/limits.py).
    max_connections: int = 0
    accepting: bool = True


@dataclass(frozen=True)
class RecentRequest(_Wire):
    """A request that ended, as `status` keeps the last ones: the prompt's figures too,
    so that a client of the gateway (which passes on only the cached share) finds each
    request's prefill seconds here (`bench session`)."""

    id: str
    finish_reason: str
    tokens: int
    tokens_after_stop: int = 0
    prefill_pieces_after_stop: int = 0
    seconds: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_seconds: float | None = None


@dataclass(frozen=True)
class RequestCounters(_Wire):
    """Requests since the start, by how they ended."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    disconnected: int = 0
    failed: int = 0
    tokens: int = 0
    busy: int = 0
    # Requests that waited in the queue for room in the batch, or under the memory budget:
    # counted once each, so a wait too short for a `status` poll still shows.
    waited_for_batch: int = 0
    decoded_in_turns: int = 0
    waited_for_memory: int = 0


@dataclass(frozen=True)
class RequestsStatus(RequestCounters):
    active: int = 0
    queued: int = 0
    why_queued: str | None = None  # why the first queued request waits
    # The active requests, and the first few queued ones (all are counted in `queued`).
    running: list[RequestInfo] = field(default_factory=list)
    waiting: list[RequestInfo] = field(default_factory=list)
    recent: list[RecentRequest] = field(default_factory=list)


@dataclass
class UnloadStats(_Wire):
    """The unloads and reloads so far, and what the last unload gave back."""

    unloads: int = 0
    reloads: int = 0
    last_load_seconds: float | None = None
    # The process's RSS and MLX's active memory just before and just after the last unload.
    rss_before_bytes: int | None = None
    rss_after_bytes: int | None = None
    mlx_active_before_bytes: int | None = None
    mlx_active_after_bytes: int | None = None


@dataclass
class KeepAliveStatus(UnloadStats):
    """The idle unload (daemon/keep_alive.py): the clock, and what the last unload gave back."""

    keep_alive_s: float = 0.0  # in force now (negative: never)
    setting_s: float = 0.0
    idle_s: float | None = None
    unload_in_s: float | None = None
    unloaded_s: float | None = None


@dataclass(frozen=True)
class Status(_Wire):
    """The `status` reply: the engine's snapshot (daemon/engine_loop.py `_publish`) with
    what the I/O thread adds when it answers (daemon/server.py `Server.status`)."""

    state: str  # loading | ready | unloaded | stopping | failed
    error: str | None = None
    pid: int = 0
    version: str = ""
    protocol: int = 0
    uptime_s: float = 0.0
    model: str | None = None
    store_id: str | None = None
    # Set when the model folder has gone or changed under the loaded model.
    store_problem: str | None = None
    # chat, tools, thinking, vision: what the model takes (None before its first load).
    capabilities: dict[str, bool] | None = None
    capacity: int | None = None
    policy: str | None = None
    moe_layers: int | None = None
    experts_per_layer: int | None = None
    # Every setting, as `restart` passes them back as flags.
    settings: dict[str, Any] = field(default_factory=dict)
    pool: PoolStatus = field(default_factory=PoolStatus)
    context: ContextLimit | None = None
    batch: Report | None = None  # continuous batching's size and totals (None: max_batch 1)
    prompt_cache: Report | None = None
    memory: MemoryStatus = field(default_factory=MemoryStatus)
    clients: ClientsStatus = field(default_factory=ClientsStatus)
    requests: RequestsStatus = field(default_factory=RequestsStatus)
    heat: Report = field(default_factory=dict)  # the heat keeper's health (daemon/heat.py)
    autopin: Report | None = None
    # `--distributed`: each rank's share, pool, hit rate and bytes (docs/scale-out.md).
    expert_parallel: Report | None = None
    keep_alive: KeepAliveStatus | None = None
    elastic: ElasticStatus | None = None
    snapshot_age_s: float = 0.0
    log: str = ""
    runtime_dir: str = ""
    socket: str = ""


# ---- the `stats` reply ---------------------------------------------------------------


@dataclass(frozen=True)
class RequestTotals(RequestCounters):
    """`stats`' request counters: the totals, the queue, and the clients with requests."""

    queued: int = 0
    why_queued: str | None = None  # why the first queued request waits
    clients: int = 0


@dataclass(frozen=True)
class Stats(_Wire):
    """The pool's and the read engine's full counters (`moestreamctl stats`); the reader,
    prefetch and diagnostics reports keep their modules' own shapes (nothing is loaded:
    empty or None)."""

    state: str
    requests: RequestTotals = field(default_factory=RequestTotals)
    model: str | None = None
    capacity: int | None = None
    policy: str | None = None
    pool: PoolTotals = field(default_factory=PoolTotals)
    reader: Report = field(default_factory=dict)  # the native read engine's counters
    prefetch: Report | None = None
    diagnostics: Report | None = None
    snapshot_age_s: float = 0.0
