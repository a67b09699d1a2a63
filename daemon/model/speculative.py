"""Speculative decoding over a streamed pool: draft K tokens, verify them in one forward.

Each round the drafter proposes K tokens after the last verified token y; the main
model runs [y, d_1..d_K] in one forward ("dual decode/verify"), samples a token t_i from
the logits at every position and accepts d_{i+1} while t_i == d_{i+1}; the first t_i
that differs (or t_K when all are accepted) is the main model's own next token. With
greedy sampling the output is the main model's greedy output; with temperature it is
sampled from the main model's distribution (each emitted token is a sample of the main
model given the tokens before it). Drafters:

- `MTPDrafter`: the store's multi-token-prediction head (daemon/model/mtp_head.py). It reads
  the main model's normed hidden state at position t and the embedding of token t+1 and
  predicts token t+2; drafts 2..K chain the head on its own output. Its KV cache holds
  one entry per verified position; chained entries are trimmed at the next round.
- `ModelDrafter`: a separate small model (`--speculative draft --draft-model PATH`).

Rejected tokens are taken out of the main model's cache. Attention caches are trimmed.
Recurrent state (Qwen3-Next's linear attention, `ArraysCache`) cannot be trimmed, so it
is snapshotted before the verify and, when a draft is rejected, restored and the
accepted tokens are forwarded again: one extra forward of n+1 tokens per such round
(mlx-lm's own `speculative_generate_step` refuses these caches instead).

A verify routes K+1 tokens, so each MoE layer reads the union of their experts. K is
shrunk until that union fits a partial pool even when the tokens share no expert
(top_k * (K+1) <= slots); a union that still does not fit would be served by the pool's
overflow path, correct but slow.

Whether speculation pays is measured, not assumed (`_Probe`): the first tokens
alternate speculative and plain blocks of `probe_tokens` in ABBA order (pairs
(S,P), (P,S), (S,P), ... cancel drift), each pair gives a speed ratio, and after
`probe_pairs` pairs (two when every ratio so far is clearly on one side) speculation is
kept only when the median ratio and the pooled speeds both favour it; otherwise the
request falls back to plain decode for good (`fell_back`). A probe's plain block runs
exactly what plain decode runs, pipelined, with nothing else hung on its graph (no MTP
head, no expert counting): the head catches up on the block's hidden states in one
forward when speculation resumes, and the block is timed from its first token on, as
plain decode runs in steady state. A speculative block is likewise timed from the end of
its first round (which carries that catch-up), and blocks hold at least three rounds'
tokens (3 (K+1)), since the first version, with 4-token blocks timed whole, read
speculation as 0.66-0.96x plain on an H200 where it ran 1.07-1.56x. Kept speculation
stays watched (`_Watch`): two windows in a row slower than the probe's plain decode
make the request fall back as well. Nothing ever switches plain decode back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from .decider import ABBA
from .kv_buckets import bucketed, default_key_bucket
from .streaming_model import StreamingModel

MODES = ("mtp", "draft")
MAX_DRAFT_TOKENS = 8
PREFILL_STEP = 2048


@dataclass(frozen=True)
class SpeculativeParams:
    """How one request speculates. `fallback=False` keeps speculating with K as given,
    whatever it costs: no shrinking of K to the pool, no probe (for benchmarks and
    tests; a verify that does not fit goes through the pool's overflow path).
    `probe_tokens` is the size of each probe block, `probe_pairs` the most (speculative,
    plain) pairs measured before deciding. `alternate=True` switches between speculative
    and plain blocks of `probe_tokens` for the whole request and never decides (tests of
    the switches; K still shrinks to the pool unless `fallback=False`)."""

    mode: str
    draft_tokens: int = 2
    draft_model: str | None = None
    fallback: bool = True
    probe_tokens: int = 4
    probe_pairs: int = 3
    alternate: bool = False
    # After the probe keeps speculation: tokens per window of the watch that falls back
    # when speculation keeps running slower than the probe's plain decode (0: no watch).
    watch_tokens: int = 32
    # Attention key lengths of short multi-token forwards (verify, the head's catch-up)
    # padded to multiples of this (daemon/model/kv_buckets.py); None: where it was measured to
    # pay (CUDA), 0: never.
    key_bucket: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS}, not {self.draft_tokens}")
        if (self.mode == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft needs --draft-model PATH, and only it takes one")
        if self.probe_tokens < 1 or self.probe_pairs < 1:
            raise ValueError(
                f"probe_tokens and probe_pairs must be >= 1, not {self.probe_tokens} and {self.probe_pairs}"
            )
        if self.watch_tokens < 0:
            raise ValueError(f"watch_tokens must be >= 0, not {self.watch_tokens}")
        if self.key_bucket is not None and self.key_bucket < 0:
            raise ValueError(f"key_bucket must be >= 0, not {self.key_bucket}")


@dataclass
class SpeculativeStats:
    """What speculation did for one request; `to_dict` goes into the request's stats."""

    mode: str
    draft_tokens_requested: int
    draft_tokens: int = 0
    key_bucket: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    spec_tokens: int = 0  # tokens emitted by speculative rounds (accepted + the verifier's own)
    spec_experts: int = 0  # experts read by those rounds' forwards, summed over MoE layers
    plain_tokens: int = 0
    plain_experts_per_token: int | None = None  # top_k per MoE layer: a token routes top_k distinct experts
    replays: int = 0  # rounds that re-forwarded accepted tokens (untrimmable caches)
    probe: dict[str, float] = field(
        default_factory=lambda: {"spec_tokens": 0, "spec_s": 0.0, "plain_tokens": 0, "plain_s": 0.0}
    )
    probe_ratios: list[float] = field(default_factory=list)  # speculative / plain tokens/s, per probe pair
    switches: int = 0  # changes between speculative and plain blocks
    fell_back: bool = False
    reason: str | None = None
    # (tokens, busy seconds) when the probe decided, and the latest such pair.
    decided_at: tuple[int, float] | None = None
    latest: tuple[int, float] = (0, 0.0)
    # The watch's windows after the probe kept speculation: speed / the probe's plain speed.
    watch_ratios: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        p = self.probe
        after = None
        if self.decided_at is not None and self.latest[1] > self.decided_at[1]:
            after = (self.latest[0] - self.decided_at[0]) / (self.latest[1] - self.decided_at[1])
        return {
            "mode": self.mode,
            "draft_tokens": self.draft_tokens,
            "draft_tokens_requested": self.draft_tokens_requested,
            "key_bucket": self.key_bucket,
            "rounds": self.rounds,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "tokens_per_round": self.spec_tokens / self.rounds if self.rounds else None,
            # Experts the MoE layers read (the union per layer of each forward, summed over
            # layers) per token a speculative round emitted; plain decode reads top_k per
            # layer per token, measured alongside.
            "experts_read_per_accepted_token": self.spec_experts / self.spec_tokens if self.spec_tokens else None,
            "plain_experts_read_per_token": self.plain_experts_per_token,
            "plain_tokens": self.plain_tokens,
            "probe_tokens_per_s_speculative": p["spec_tokens"] / p["spec_s"] if p["spec_s"] else None,
            "probe_tokens_per_s_plain": p["plain_tokens"] / p["plain_s"] if p["plain_s"] else None,
            "probe_speed_ratios": list(self.probe_ratios),
            "switches": self.switches,
            "replays": self.replays,
            # Tokens/s of the generator itself after the probe decided (speculative or plain).
            "tokens_per_s_after_decision": after,
            "watch_speed_ratios": list(self.watch_ratios),
            "fell_back": self.fell_back,
            "reason": self.reason,
        }


# ---- model pieces -------------------------------------------------------------------


def output_head(model: nn.Module, hidden: mx.array) -> mx.array:
    """The main model's output head on normed hidden states (what `Model.__call__` does)."""
    if getattr(model.args, "tie_word_embeddings", False):
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


def _forward(
    model: nn.Module, tokens: mx.array, cache: list[Any], need_hidden: bool
) -> tuple[mx.array | None, mx.array]:
    """(normed hidden [1, L, D] or None, logits [1, L, V]) of a forward of `tokens` [L].
    The hidden states come from `model.model`, which is what `Model.__call__` runs."""
    if not need_hidden:
        return None, model(tokens[None], cache=cache)
    hidden = model.model(tokens[None], cache)
    return hidden, output_head(model, hidden)


class _MainCache:
    """The main model's cache, with the rewind that a rejected draft needs."""

    def __init__(self, model: nn.Module, key_bucket: int = 0) -> None:
        self.layers = bucketed(make_prompt_cache(model), key_bucket)
        self.recurrent = [c for c in self.layers if not c.is_trimmable()]
        odd = [type(c).__name__ for c in self.recurrent if not isinstance(c, ArraysCache)]
        if odd:
            raise ValueError(f"speculative decoding cannot rewind caches of type {sorted(set(odd))}")

    def snapshot(self) -> list[list[Any]] | None:
        return [list(c.cache) for c in self.recurrent] if self.recurrent else None

    def rewind(self, snapshot: list[list[Any]] | None, forwarded: int, keep: int) -> bool:
        """Drop the last `forwarded - keep` tokens; True when the caller must forward the
        `keep` tokens again (recurrent state was restored to before all `forwarded`)."""
        if forwarded == keep:
            return False
        if snapshot is None:
            for c in self.layers:
                c.trim(forwarded - keep)
            return False
        for c, saved in zip(self.recurrent, snapshot):
            for i, arrays in enumerate(saved):  # an ArraysCache takes its entries by index
                c[i] = arrays
        for c in self.layers:
            if c.is_trimmable():
                c.trim(forwarded)
        return True


class MTPDrafter:
    """Drafts with the store's MTP head (see the module docstring)."""

    need_hidden = True

    def __init__(self, model: nn.Module, head: nn.Module, key_bucket: int = 0) -> None:
        if not hasattr(getattr(model, "model", None), "embed_tokens") or not hasattr(model, "args"):
            why = f"the model ({type(model).__module__}) has no model.embed_tokens / args"
            raise ValueError(f"--speculative mtp: {why}")
        self.model = model
        self.head = head
        self.cache = bucketed([KVCache()], key_bucket)[0]
        self.chained = 0  # cache entries of chained drafts, trimmed at the next observe
        self.last: mx.array | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        """Nothing to do: the head sees the prompt through `observe`."""

    def observe(self, hidden: mx.array, next_tokens: mx.array) -> None:
        """Verified positions: the main model's hidden states [1, n, D] there, and the
        tokens that follow each [n]."""
        if self.chained:
            self.cache.trim(self.chained)
            self.chained = 0
        emb = self.model.model.embed_tokens(next_tokens[None])
        out = self.head(hidden, emb, create_attention_mask(emb, self.cache), self.cache)
        self.last = out[:, -1:, :]

    def propose(self, k: int) -> mx.array:
        """k greedy draft tokens after the last observed position ([k] uint32, lazy)."""
        g = self.last
        drafts = []
        for i in range(k):
            t = mx.argmax(output_head(self.model, g)[0, -1], axis=-1, keepdims=True).astype(mx.uint32)
            drafts.append(t)
            if i + 1 < k:
                g = self.head(g, self.model.model.embed_tokens(t[None]), None, self.cache)
                self.chained += 1
        return mx.concatenate(drafts)


class ModelDrafter:
    """Drafts with a separate small model that shares the main model's vocabulary."""

    need_hidden = False

    def __init__(self, model: nn.Module, key_bucket: int = 0) -> None:
        self.model = model
        self.cache = bucketed(make_prompt_cache(model), key_bucket)
        if not all(c.is_trimmable() for c in self.cache):
            kinds = sorted({type(c).__name__ for c in self.cache if not c.is_trimmable()})
            raise ValueError(
                f"the draft model's cache ({kinds}) cannot be trimmed; choose a draft model with attention only"
            )
        self.pending: list[mx.array] = []
        self.chained = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.pending = [mx.array(list(prompt[:1]), mx.uint32)]

    def observe(self, hidden: mx.array | None, next_tokens: mx.array) -> None:
        if self.chained:
            for c in self.cache:
                c.trim(self.chained)
            self.chained = 0
        self.pending.append(next_tokens.astype(mx.uint32))

    def propose(self, k: int) -> mx.array:
        tokens = mx.concatenate(self.pending)
        self.pending = []
        while tokens.size > PREFILL_STEP:
            self.model(tokens[:PREFILL_STEP][None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            tokens = tokens[PREFILL_STEP:]
        logits = self.model(tokens[None], cache=self.cache)[0, -1]
        drafts = []
        for i in range(k):
            t = mx.argmax(logits, axis=-1, keepdims=True).astype(mx.uint32)
            drafts.append(t)
            if i + 1 < k:
                logits = self.model(t[None], cache=self.cache)[0, -1]
                self.chained += 1
        return mx.concatenate(drafts)


def load_draft_model(path: str | Path) -> nn.Module:
    """A draft model: an expert store (all experts resident) or an mlx-lm model folder."""
    from ...shared.store_format import MANIFEST_NAME
    from .streaming_model import load_stock_model

    p = Path(path)
    if (p / MANIFEST_NAME).is_file():
        return load_stock_model(p)
    if (p / "config.json").is_file():
        from mlx_lm.utils import load_model

        model, _ = load_model(p)
        mx.eval(mx.random.state)  # its initial draws (streaming_model.py `_build_model`)
        return model
    raise ValueError(f"draft model {path} is neither an expert store nor an mlx-lm model folder")


def make_drafter(sm: StreamingModel, spec: SpeculativeParams, key_bucket: int = 0) -> MTPDrafter | ModelDrafter:
    """The drafter of `spec` for `sm`, whose MTP head or draft model `sm` loads once."""
    if spec.mode == "mtp":
        return MTPDrafter(sm.model, sm.mtp_head(), key_bucket)

    def load(key: str) -> nn.Module:
        model = load_draft_model(key)
        main_vocab = sm.manifest.config.get("text_config", sm.manifest.config).get("vocab_size")
        args = getattr(model, "args", None)
        text = getattr(args, "text_config", None)
        draft_vocab = getattr(args, "vocab_size", None) or getattr(text, "vocab_size", None)
        if main_vocab is not None and draft_vocab is not None and draft_vocab != main_vocab:
            raise ValueError(
                f"draft model {spec.draft_model} has a vocabulary of {draft_vocab}, the model {main_vocab}"
            )
        return model

    return ModelDrafter(sm.draft_model(str(Path(spec.draft_model).resolve()), load), key_bucket)


def effective_draft_tokens(sm: StreamingModel, k: int) -> tuple[int, str | None]:
    """The largest K' <= k whose verify fits every partial pool even when the K'+1
    tokens share no expert, and why K was shrunk (None if not)."""
    partial = [p for p in sm.pools if not p.fully_resident]
    if not partial:
        return k, None
    # Pinned experts count: they are the hottest, so most likely part of the union.
    slots = min(p.capacity for p in partial)
    top_k = partial[0].top_k
    fit = min(k, slots // top_k - 1)
    if fit >= k:
        return k, None
    need = top_k * (k + 1)
    if fit < 1:
        return 0, (
            f"the pool holds {slots} experts per layer, fewer than the {2 * top_k} that verifying even one "
            f"draft token may route (top_k {top_k} x 2 tokens): speculation is off; raise --capacity to at least "
            f"{2 * top_k}"
        )
    return fit, (
        f"draft_tokens shrunk from {k} to {fit}: the pool holds {slots} experts per layer and a verify of "
        f"{k + 1} tokens may route {need} (top_k {top_k} x {k + 1}); raise --capacity to {need} for K={k}"
    )


# ---- counting the experts a forward reads ------------------------------------------


class _ExpertCounter:
    """Experts a verify reads, summed over MoE layers: from the pool's counters for
    partial pools (their ids are on the host anyway), on the device for fully resident
    pools (the ids they log while `route_log` is set). Plain steps are not counted: one
    token routes exactly top_k distinct experts per MoE layer.

    A routing read-back (a mapped pool's placement, daemon/mapped/mapped_pool.py, or a full
    pool's counts, daemon/pool/resident_routing.py) keeps `route_log` set and takes its
    entries at each tick; then only the entries a verify appends are read, and the list
    is left as it is."""

    def __init__(self, sm: StreamingModel) -> None:
        self.pools = sm.pools
        self.shared = sm.mapped_pool is not None or sm.resident_routing is not None
        self._host_before = 0
        self._marks = [0] * len(self.pools)

    def _host(self) -> int:
        return sum(
            p.stats.hits_prefill + p.stats.hits_decode + p.stats.misses_prefill + p.stats.misses_decode
            for p in self.pools
            if not p.fully_resident
        )

    def start(self) -> None:
        for i, p in enumerate(self.pools):
            if self.shared:
                self._marks[i] = len(p.route_log) if p.route_log is not None else 0
            elif p.fully_resident:
                p.start_route_log()
            else:
                p.stop_route_log()
        self._host_before = self._host()

    def stop(self) -> tuple[mx.array | None, int]:
        """Stop logging; return (the device count, lazy, to evaluate with the forward, or
        None; the host count, final: partial pools count while the forward is built)."""
        device = []
        for i, p in enumerate(self.pools):
            logged = p.route_log[self._marks[i] :] if self.shared and p.route_log is not None else p.route_log
            if logged:
                experts = mx.arange(p.layer.num_experts)
                for ids in logged:
                    device.append((ids.reshape(-1)[None, :] == experts[:, None]).any(axis=1).sum())
            if not self.shared:
                p.stop_route_log()
        return (mx.sum(mx.stack(device)) if device else None), self._host() - self._host_before


# ---- deciding whether speculation pays ----------------------------------------------


class _Clock:
    """Seconds spent inside the generator (not in the consumer between tokens)."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._since = time.perf_counter()

    def pause(self) -> float:
        now = time.perf_counter()
        self.busy += now - self._since
        self._since = now
        return self.busy

    def resume(self) -> None:
        self._since = time.perf_counter()


class _Probe:
    """Which kind of block runs next, and the decision.

    Blocks come in pairs, ABBA: (spec, plain), (plain, spec), (spec, plain), ... so a
    slow drift of the machine's speed favours neither side. Each pair gives one ratio of
    speculative to plain tokens/s; one noisy block spoils one ratio, not the decision,
    which takes the median. Speculation is kept only when the median ratio and the
    pooled speeds of all probe blocks both say it is faster: a tie or a split verdict
    falls back, since plain decode is exact and costs nothing to keep. After two pairs
    the probe stops early when every ratio is beyond `margin` on the same side.
    Invariant: once `probing` is False the probe's decision never changes; only the
    watch may still turn speculation off."""

    def __init__(self, spec: SpeculativeParams, margin: float = 1.25) -> None:
        self.pairs = spec.probe_pairs
        self.alternate = spec.alternate
        self.margin = margin
        self.order = ABBA("spec", "plain", alternate=spec.alternate)
        self.current: dict[str, float] = {}
        self.probing = True

    def block(self) -> str:
        return self.order.current()

    def record(self, kind: str, tokens: int, seconds: float, stats: SpeculativeStats) -> None:
        """A probe block of `kind` ran `tokens` in `seconds`; decide when the plan says so."""
        pair_ended = self.order.next()
        if self.alternate:
            return
        seconds = max(seconds, 1e-9)
        stats.probe[f"{kind}_tokens"] += tokens
        stats.probe[f"{kind}_s"] += seconds
        self.current[kind] = tokens / seconds
        if not pair_ended:
            return
        stats.probe_ratios.append(self.current["spec"] / self.current["plain"])
        self.current = {}
        ratios = stats.probe_ratios
        clear = len(ratios) >= 2 and (all(r > self.margin for r in ratios) or all(r < 1 / self.margin for r in ratios))
        if len(ratios) >= self.pairs or clear:
            self.probing = False
            _decide(stats)


class _Watch:
    """Speculation kept by the probe, checked window by window: the probe measured a
    short stretch, and a request can drift into text the drafter predicts badly, or the
    device into a slower regime. When `strikes` windows in a row run below `margin` times
    the probe's plain speed, the request falls back for good, as after a probe that lost.
    One slow window alone (a compile, a page fault storm) does not."""

    def __init__(self, plain_tps: float, margin: float = 0.9, strikes: int = 2) -> None:
        self.plain_tps = plain_tps
        self.margin = margin
        self.strikes = strikes
        self._slow = 0

    def record(self, tokens: int, seconds: float, stats: SpeculativeStats) -> None:
        ratio = tokens / max(seconds, 1e-9) / self.plain_tps
        stats.watch_ratios.append(ratio)
        self._slow = self._slow + 1 if ratio < self.margin else 0
        if self._slow >= self.strikes:
            stats.fell_back = True
            recent = ", ".join(f"{r:.2f}" for r in stats.watch_ratios[-self.strikes :])
            stats.reason = (
                f"speculation ran slower than plain decode after the probe kept it ({recent} of the probe's plain "
                f"{self.plain_tps:.1f} tokens/s in the last {self.strikes} windows): decoding without speculation"
            )


def _decide(stats: SpeculativeStats) -> None:
    p = stats.probe
    spec_tps, plain_tps = p["spec_tokens"] / p["spec_s"], p["plain_tokens"] / p["plain_s"]
    median = statistics.median(stats.probe_ratios)
    if median > 1.0 and spec_tps > plain_tps:
        return
    stats.fell_back = True
    stats.reason = (
        f"speculation was not faster over the probe (median speed ratio {median:.2f} over {len(stats.probe_ratios)} "
        f"pairs; {spec_tps:.1f} tokens/s speculative vs {plain_tps:.1f} plain, acceptance "
        f"{stats.accepted}/{stats.proposed}): decoding without speculation"
    )


# ---- the loop -------------------------------------------------------------------------


def _sample_one(sampler: Callable[[mx.array], mx.array], logits: mx.array) -> mx.array:
    """The token after a forward's last position, as mlx-lm's `generate_step` samples it."""
    logits = logits[:, -1, :]
    return sampler(logits - mx.logsumexp(logits, keepdims=True))


def speculative_steps(
    sm: StreamingModel,
    prompt: Sequence[int],
    *,
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    spec: SpeculativeParams,
    stats: SpeculativeStats,
    drafter: Any = None,
    on_prompt_progress: Callable[[int, int], None] | None = None,
    pieces: bool = False,
) -> Iterator[tuple[int | None, None]]:
    """Yield (token, None) like mlx-lm's `generate_step`, speculating per `spec` and
    recording what it did in `stats`; `on_prompt_progress(done, total)` follows the
    prompt's prefill, as `generate_step`'s `prompt_progress_callback` does. `drafter` replaces the one `spec` names (any
    object with `need_hidden`, `begin`, `observe` and `propose` as `MTPDrafter` has).
    `pieces`: yield (None, None) between two chunks of the prefill, as `plain_steps`
    does, so that the engine loop can stop the request (or step others) there."""
    model = sm.model
    bucket = spec.key_bucket if spec.key_bucket is not None else default_key_bucket()
    stats.key_bucket = bucket
    drafter = drafter if drafter is not None else make_drafter(sm, spec, bucket)
    k, stats.reason = effective_draft_tokens(sm, spec.draft_tokens) if spec.fallback else (spec.draft_tokens, None)
    stats.draft_tokens = k
    stats.plain_experts_per_token = sm.pools[0].top_k * len(sm.pools) if sm.pools else None
    if k == 0:
        stats.fell_back = True
    cache = _MainCache(model, bucket)
    counter = _ExpertCounter(sm)
    clock = _Clock()
    probe = _Probe(spec) if k and (spec.fallback or spec.alternate) else None

    with mx.stream(generation_stream):
        ids = mx.array(list(prompt), mx.uint32)
        drafter.begin(prompt)
        n_prompt = ids.size
        progress = on_prompt_progress or (lambda done, total: None)
        progress(0, n_prompt)
        for start in range(0, n_prompt - 1, PREFILL_STEP):
            if start and pieces:
                clock.pause()
                yield None, None
                clock.resume()
            end = min(start + PREFILL_STEP, n_prompt - 1)
            chunk = ids[start:end][None]
            hidden = model.model(chunk, cache.layers) if drafter.need_hidden else model(chunk, cache=cache.layers)
            drafter.observe(hidden, ids[start + 1 : end + 1])
            last = getattr(drafter, "last", None)  # bound the MTP head's lazy graph too
            mx.eval([c.state for c in cache.layers], [] if last is None else last)
            progress(end, n_prompt)
        hidden, logits = _forward(model, ids[-1:], cache.layers, drafter.need_hidden)
        y = _sample_one(sampler, logits)
        if not stats.fell_back:
            drafter.observe(hidden, y)
        mx.eval(y)
        emitted = 1
        clock.pause()
        yield int(y.item()), None
        clock.resume()

        # A plain block's (hidden states, next tokens) that the drafter has yet to see:
        # it catches up in one forward when speculation resumes, not at every plain step.
        pending: tuple[mx.array | None, mx.array] | None = None
        kind_before = "spec"
        watch: _Watch | None = None
        while emitted < max_tokens:
            measuring = probe is not None and probe.probing
            kind = "plain" if stats.fell_back else (probe.block() if measuring else "spec")
            budget = min(spec.probe_tokens, max_tokens - emitted) if measuring else max_tokens - emitted
            if watch is not None and kind == "spec":
                budget = min(max(spec.watch_tokens, 3 * (k + 1)), max_tokens - emitted)
            if kind != kind_before:
                stats.switches += 1
                kind_before = kind
            start_tokens, start_s = emitted, clock.busy
            # (tokens emitted, busy seconds) after each round of a speculative block, after
            # each token of a plain one.
            marks: list[tuple[int, float]] = []
            if measuring and not spec.alternate:
                # Blocks of at least three rounds' tokens, so that a speculative block
                # has two rounds timed in steady state, and a plain block as many tokens.
                budget = min(max(budget, 3 * (k + 1)), max_tokens - emitted)
            if kind == "spec":
                if pending is not None:
                    drafter.observe(*pending)
                    pending = None
                while emitted - start_tokens < budget and emitted < max_tokens:
                    kk = min(k, max_tokens - emitted - 1)
                    if kk == 0:
                        # One token left: no draft can be used; the drafter is done.
                        t = next(_plain_run(model, cache, sampler, y, 1, None))
                        stats.plain_tokens += 1
                        emitted += 1
                        stats.latest = (emitted, clock.pause())
                        yield t, None
                        clock.resume()
                        break
                    tokens = _spec_round(model, cache, drafter, counter, y, kk, sampler, stats)
                    y = mx.array(tokens[-1:], mx.uint32)
                    for t in tokens:
                        emitted += 1
                        stats.latest = (emitted, clock.pause())
                        yield t, None
                        clock.resume()
                        if emitted == max_tokens:
                            break
                    marks.append(stats.latest)
            else:
                # Hidden states are kept only while speculation may resume.
                keep = not stats.fell_back
                hiddens: list[mx.array] | None = [] if keep and drafter.need_hidden else None
                outs: list[int] = []
                for t in _plain_run(model, cache, sampler, y, budget, hiddens):
                    emitted += 1
                    outs.append(t)
                    stats.plain_tokens += 1
                    stats.latest = (emitted, clock.pause())
                    marks.append(stats.latest)
                    yield t, None
                    clock.resume()
                    y = mx.array([t], mx.uint32)
                if keep:
                    pending = (mx.concatenate(hiddens, axis=1) if hiddens else None, mx.array(outs, mx.uint32))
            # Steady state: a plain block from its first token on, as plain decode runs (the
            # first step of a block cannot overlap with a step before it); a speculative
            # block from the end of its first round on (that round also carries the
            # drafter's catch-up on the plain block before it, which steady speculation
            # never pays).
            if len(marks) >= 2:
                seconds, measured = marks[-1][1] - marks[0][1], marks[-1][0] - marks[0][0]
            else:
                seconds, measured = clock.busy - start_s, emitted - start_tokens
            if measuring:
                probe.record(kind, measured, seconds, stats)
                if not probe.probing:
                    stats.decided_at = (emitted, clock.busy)
                    p = stats.probe
                    if not stats.fell_back and spec.watch_tokens and p["plain_s"]:
                        watch = _Watch(p["plain_tokens"] / p["plain_s"])
            elif watch is not None and kind == "spec" and measured:
                watch.record(measured, seconds, stats)
                if stats.fell_back:
                    watch = None


def _spec_round(
    model: nn.Module,
    cache: _MainCache,
    drafter: MTPDrafter | ModelDrafter,
    counter: _ExpertCounter,
    y: mx.array,
    k: int,
    sampler: Callable[[mx.array], mx.array],
    stats: SpeculativeStats,
) -> list[int]:
    """One draft + verify round; returns the tokens it emits (1..k+1)."""
    drafts = drafter.propose(k)
    verify = mx.concatenate([y, drafts])
    snapshot = cache.snapshot()
    counter.start()
    hidden, logits = _forward(model, verify, cache.layers, drafter.need_hidden)
    device, host = counter.stop()
    rows = logits[0]
    targets = sampler(rows - mx.logsumexp(rows, axis=-1, keepdims=True))
    mx.eval(targets, drafts, [] if device is None else device)
    experts = host + (int(device.item()) if device is not None else 0)
    t, d = targets.tolist(), drafts.tolist()
    n = 0
    while n < k and t[n] == d[n]:
        n += 1
    if cache.rewind(snapshot, k + 1, n + 1):
        counter.start()
        replay = verify[None, : n + 1]
        hidden = model.model(replay, cache.layers) if drafter.need_hidden else model(replay, cache=cache.layers)
        device, host = counter.stop()
        experts += host + (int(device.item()) if device is not None else 0)
        stats.replays += 1
    emitted = t[: n + 1]
    drafter.observe(hidden[:, : n + 1] if hidden is not None else None, mx.array(emitted, mx.uint32))
    stats.rounds += 1
    stats.proposed += k
    stats.accepted += n
    stats.spec_tokens += n + 1
    stats.spec_experts += experts
    return emitted


def _plain_run(
    model: nn.Module,
    cache: _MainCache,
    sampler: Callable[[mx.array], mx.array],
    y: mx.array,
    count: int,
    hiddens: list[mx.array] | None,
) -> Iterator[int]:
    """`count` plain decode steps from the unforwarded token `y`, computed and pipelined
    as mlx-lm's `generate_step` does (step n+1 is queued before step n is read), never
    queuing past `count`. With `hiddens`, each forward's normed hidden states are
    appended to it: the same computation, split where `Model.__call__` applies the
    output head, and nothing else hung on the step's graph."""

    def step(token: mx.array) -> mx.array:
        if hiddens is None:
            logits = model(token[None], cache=cache.layers)
        else:
            hidden = model.model(token[None], cache.layers)
            hiddens.append(hidden)
            logits = output_head(model, hidden)
        nxt = _sample_one(sampler, logits)
        mx.async_eval(nxt)
        return nxt

    if count <= 0:
        return
    nxt = step(y)
    for i in range(count):
        queued = step(nxt) if i + 1 < count else None
        yield int(nxt.item())
        if queued is not None:
            nxt = queued
