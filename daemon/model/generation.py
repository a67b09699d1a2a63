"""Generation over a streaming model, with the request's statistics."""

from __future__ import annotations

import dataclasses
import secrets
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

import mlx.core as mx
import psutil
from jinja2 import TemplateError
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

from ...shared.protocol import SamplingControls, TokenLogprob, TopLogprob
from ...shared.status import CacheUseStats, ConstraintStats, PhaseCounts, RequestStats
from .prefill import PREFILL_STEP, PrefillStats, prefill_pieces
from .shared_prefill import SharedPrefill, prefill_key
from .streaming_model import PLACEMENT_COUNTERS, POOL_COUNTERS, StreamingModel

if TYPE_CHECKING:
    from ..mapped.mapped_pool import MappedPool
    from ..pool.resident_routing import ResidentRouting
    from .batching import BatchSession
    from .constrain import Grammar, GrammarProcessor
    from .diagnostics import Recorder
    from .prompt_cache import PromptCache
    from .speculative import SpeculativeStats
    from .vision import PreparedImages


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    # The k likeliest tokens only (0: all), after top_p, as stock's `make_sampler` orders them.
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # min_p, the penalties, logit_bias and logprobs (shared/protocol.py).
    controls: SamplingControls = SamplingControls()
    # Speculative decoding (daemon/model/speculative.py): None, "mtp" or "draft".
    speculative: str | None = None
    draft_tokens: int = 2
    draft_model: str | None = None
    # Record hot-path diagnostics for this request (daemon/model/diagnostics.py); the daemon's
    # `--diagnostics` turns them on for every request.
    diagnostics: bool = False
    # A chat's end-of-turn text where the tokenizer does not end the answer on it itself
    # (`turn_end`): the answer ends there, as at an end token (no `stop_string`).
    turn_end: str | None = None


@dataclass
class GenerationResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stats: RequestStats = field(default_factory=RequestStats)
    stop_string: str | None = None  # the stop string that ended the answer, if one did
    # Each token's log-probability, where the request asked (`controls.logprobs`).
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class CacheUse:
    """One request's use of the prompt cache (daemon/model/prompt_cache.py)."""

    prompt_cache: PromptCache
    # Whose caches it may reuse (PromptCache.fetch's scope); "": the shared scope.
    scope: str = ""
    # Prompt tokens served from the cache, and whether from a file written before.
    reused: int = 0
    from_disk: bool = False
    # The request's own KV cache once made: kept in the prompt cache when it ends.
    kv: list[Any] | None = None
    # Time to find the prefix and copy its cache (a file's: to load it).
    fetch_seconds: float = 0.0
    # Its prompt's prefill was one another request had started (daemon/model/shared_prefill.py):
    # in flight (joined), or suspended when its requests had gone (resumed).
    joined: bool = False
    resumed: bool = False
    # That prefill's statistics (its own, where it ran it).
    shared_stats: PrefillStats | None = None

    def start(self, sm: StreamingModel, prompt_ids: Sequence[int]) -> tuple[list[Any], int]:
        """The cache the request starts from (a copy of the best cached prefix, or a
        fresh one) and how many prompt tokens it holds."""
        tic = time.perf_counter()
        reuse = self.prompt_cache.fetch(prompt_ids, self.scope)
        self.fetch_seconds = time.perf_counter() - tic
        if reuse is None:
            return make_prompt_cache(sm.model), 0
        self.reused, self.from_disk = reuse.tokens, reuse.from_disk
        return reuse.cache, reuse.tokens

    def prefilled(
        self,
        sm: StreamingModel,
        prompt_ids: Sequence[int],
        step: int,
        layer_major: bool,
        progress: Callable[[int, int], None],
        stats: PrefillStats,
        fetched: tuple[list[Any], int] | None = None,
    ) -> Generator[None, None, list[Any]]:
        """The request's cache, holding its prompt but the last token, yielding after each
        piece of the prefill it waits on (daemon/model/shared_prefill.py): one of the same
        prompt in flight or suspended (`joined`, `resumed`), else its own, started from
        `fetched` (a cache and the tokens it holds, fetched already) or else from the best
        cached prefix (`start`), and registered for others to join. `progress(done, total)`
        at the start and after each piece. A request closed while it waits leaves the
        prefill to the others, or suspended in the prompt cache where none is left."""
        n = len(prompt_ids)
        key = prefill_key(prompt_ids, layer_major, step, self.scope)
        shared, suspended = self.prompt_cache.prefill_of(key)
        if shared is not None:
            self.reused, self.joined, self.resumed = shared.start, not suspended, suspended
            self.shared_stats = shared.stats
        else:
            cache, start = fetched if fetched is not None else self.start(sm, prompt_ids)
            shared = SharedPrefill(
                sm, self.prompt_cache, key, prompt_ids, cache, start, step, layer_major, stats, self.scope
            )
            if start < n - 1:
                self.prompt_cache.prefill_started(shared)
        shared.join()
        try:
            reported = shared.done
            progress(reported, n)
            while not shared.finished:
                shared.advance()
                if shared.done != reported:  # the last piece's too
                    reported = shared.done
                    progress(reported, n)
                if not shared.finished:
                    yield
            self.kv = shared.take()
            return self.kv
        finally:
            if shared.leave():
                self.prompt_cache.suspend_prefill(shared)

    def hold(self, cache: list[Any]) -> None:
        """`cache` is the request's, kept at its end (`keep`): a prompt with images, whose
        cache is its own (daemon/model/vision.py), once it holds the whole prompt."""
        self.kv = cache

    def keep_prompt(self, prompt_ids: Sequence[int], cache: list[Any]) -> None:
        """Keep a copy of `cache`, which holds the prompt but its last token: a snapshot
        at the prompt's boundary, for a cache that cannot be trimmed back to it later or
        one that will not come back (a batch's)."""
        n = len(prompt_ids) - 1
        if n > self.reused:
            self.prompt_cache.insert(prompt_ids[:-1], cache, scope=self.scope)

    def keep(self, prompt_ids: Sequence[int], fed: Sequence[int]) -> None:
        """Keep the request's cache, which holds the prompt and every token it yielded
        (`fed`), for later prompts, and on disk where the prompt cache has a folder (a
        request stopped during its prefill has none: its prefill is kept suspended)."""
        if self.kv is not None:
            self.prompt_cache.insert([*prompt_ids, *fed], self.kv, persist=True, scope=self.scope)

    def stats(self) -> CacheUseStats:
        return CacheUseStats(self.reused, self.from_disk, self.fetch_seconds, self.joined, self.resumed)


def _add(bucket: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for key, value in after.items():
        bucket[key] = bucket.get(key, 0) + value - before[key]


def _placement_stats(counts: dict[str, float], gpu_slots: int) -> dict[str, Any]:
    """A request's share of the placement's work, as `MappedPoolStats.to_dict` names it."""
    out: dict[str, Any] = {key: counts.get("placement_" + key, 0) for key in PLACEMENT_COUNTERS}
    out["gpu_hit_rate"] = out["routed_on_gpu"] / out["routed"] if out["routed"] else None
    out["gpu_slots"] = gpu_slots
    return out


def _attributed(
    sm: StreamingModel,
    steps: Iterator,
    buckets: tuple[dict[str, float], dict[str, float]],
    rec: Any,
    readback: MappedPool | ResidentRouting | None,
) -> Iterator:
    """Pass `steps` through, adding the pool counters that moved while each step ran to
    buckets[0] (the prompt and the first token) or buckets[1] (every later token), and
    pointing the diagnostics at this request's recorder `rec` (None: off) meanwhile.
    The routing `readback` of the fully resident pools (a mapped pool's placement, or a
    full pool's counts) accounts the forwards queued for each step (`tick`) before its
    item is handed on, so that their work counts for the step that caused it.

    Requests interleaved on one thread only run between their own resume and yield, so
    this attributes the shared pools' work to the request that caused it. Decode steps
    are timed for the prefetch governor (`prefetch = auto`)."""
    phase = 0
    hub = sm.diagnostics
    governor = sm.prefetcher.governor if sm.prefetcher is not None else None
    while True:
        before = sm.counters()
        with hub.recording(rec) if hub is not None else nullcontext():
            tic = time.perf_counter()
            try:
                item = next(steps)
            except StopIteration:
                item = None
            if item is not None and readback is not None:
                readback.tick()
        if phase == 1 and item is not None and governor is not None and rec is None:
            governor.observe(time.perf_counter() - tic)
        _add(buckets[phase], before, sm.counters())
        if item is None:
            return
        if item[0] is not None:  # (None, None): a piece of the prompt, no token yet
            phase = 1
        yield item


def render_chat(
    tokenizer: Any,
    messages: Sequence[Any],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    thinking: bool | None = None,
) -> str:
    """A chat ({role, content} maps or protocol `ChatMessage`s) as the prompt text the
    model's chat template makes of it, ending where the assistant's answer starts. `tools`
    go to the template unless `tool_choice` is "none"; "required" or a named function
    then starts the answer with a tool call (daemon/model/tool_calls.py `forced_start`).
    `thinking` sets the template's thinking switch (`enable_thinking`, or the name
    mlx-lm's tokenizer wrapper finds for it); None leaves mlx-lm's default (on for a
    model with thinking markers).

    Raises ValueError when the tokenizer has no chat template or the template refuses
    the messages (e.g. roles that do not alternate)."""
    from .tool_calls import forced_start, render_call_texts

    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError(
            "the model's tokenizer has no chat template, so it cannot take chat messages; "
            "send a text prompt instead (POST /v1/completions, or `prompt`)"
        )
    chat = [m if isinstance(m, dict) else m.to_template() for m in messages]
    extra: dict[str, Any] = {"tools": list(tools)} if tools and tool_choice != "none" else {}
    if thinking is not None:
        extra["enable_thinking"] = thinking

    def render(chat: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **extra)

    # Calls the gateway kept the model's own text of (`ChatMessage.call_texts`).
    texts = {
        (i, j): t
        for i, m in enumerate(messages)
        for j, t in enumerate(getattr(m, "call_texts", None) or ())
        if t is not None
    }
    try:
        text = (render_call_texts(tokenizer, chat, texts, render) if texts else None) or render(chat)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"the model's chat template refused these messages: {type(e).__name__}: {e}") from None
    if tools and tool_choice not in (None, "auto", "none"):
        if not getattr(tokenizer, "has_tool_calling", False):
            raise ValueError(f"tool_choice {tool_choice!r}: the model's tokenizer has no tool-call parser")
        text += forced_start(tokenizer, tool_choice)
    return text


def encode_prompt(
    sm: StreamingModel,
    prompt: str | None,
    prompt_ids: Sequence[int] | None,
    messages: Sequence[Any] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    thinking: bool | None = None,
) -> list[int]:
    """Token ids of a text prompt, of token ids (checked against the vocabulary), or of a
    chat rendered with the model's chat template (its special tokens are in the template,
    so none are added, as mlx-lm's generate does)."""
    if messages is not None:
        text = render_chat(sm.tokenizer, messages, tools, tool_choice, thinking)
        ids = sm.tokenizer.encode(text, add_special_tokens=False)
    elif prompt_ids is not None:
        ids = [int(t) for t in prompt_ids]
        vocab = sm.manifest.config.get("text_config", sm.manifest.config).get("vocab_size")
        bad = [t for t in ids if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ValueError(f"prompt ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
    else:
        ids = sm.tokenizer.encode(prompt or "")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def generate(
    sm: StreamingModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    on_text: Callable[[str, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_prompt_progress: Callable[[int, int], None] | None = None,
    batch: BatchSession | None = None,
    grammar: Grammar | None = None,
) -> GenerationResult:
    """Run one request to the end; `on_text(segment, token)` gets text as it appears."""
    result = GenerationResult()
    steps = iter_generate(
        sm,
        prompt_ids,
        params,
        result,
        should_stop=should_stop,
        on_prompt_progress=on_prompt_progress,
        batch=batch,
        grammar=grammar,
    )
    for segment, token in steps:
        if on_text is not None and token is not None:
            on_text(segment, token)
    return result


LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """The request's logits processors, mlx-lm's own (`make_logits_processors`: logit_bias,
    then the repetition, presence and frequency penalties over `penalty_window` tokens),
    applied to the model's logits before they are normalized for the sampler, in
    `generate_step`, in the batch and in a lone batched request's steps alike. Empty
    (nothing runs) for a request that sets none. Each is called with every token before
    the position (the prompt's too), as stock's `generate_step` calls them."""
    c = params.controls
    if not c.has_processors():
        return []
    window = c.penalty_window
    return make_logits_processors(
        logit_bias=dict(c.logit_bias) or None,
        repetition_penalty=c.repetition_penalty if c.repetition_penalty != 1.0 else None,
        repetition_context_size=window,
        presence_penalty=c.presence_penalty or None,
        presence_context_size=window,
        frequency_penalty=c.frequency_penalty or None,
        frequency_context_size=window,
    )


def with_history(processors: Sequence[LogitsProcessor], history: Sequence[int]) -> list[LogitsProcessor]:
    """`processors` as one, given `history` (tokens a cache holds before the tokens the
    caller passes: a prompt prefilled apart from `generate_step`) ahead of those, so that
    they see what stock's `generate_step` given the whole prompt shows them."""
    if not processors:
        return []
    before = mx.array(list(history), mx.int32)

    def run(tokens: mx.array, logits: mx.array) -> mx.array:
        seen = mx.concatenate([before, tokens.astype(mx.int32)]) if before.size else tokens
        for processor in processors:
            logits = processor(seen, logits)
        return logits

    return [run]


def token_logprob(tokenizer: Any, token: int, logprobs: mx.array, k: int, text: str) -> TokenLogprob:
    """`token`'s entry from `logprobs` (the normalized logits its sampler took): its
    log-probability and the `k` likeliest tokens, best first."""
    lp = logprobs.reshape(-1).astype(mx.float32)
    k = min(k, lp.size)
    top: tuple[TopLogprob, ...] = ()
    if k:
        ids = mx.argpartition(-lp, kth=k - 1)[:k]
        ranked = sorted(zip(lp[ids].tolist(), ids.tolist()), key=lambda x: (-x[0], x[1]))
        top = tuple(TopLogprob(int(i), tokenizer.decode([int(i)]), float(v)) for v, i in ranked)
    return TokenLogprob(token, text, float(lp[token].item()), top)


def _cut_logprobs(entries: list[TokenLogprob], length: int) -> list[TokenLogprob]:
    """`entries` covering only the text's first `length` characters (an answer cut at a
    stop string): the entry across the cut keeps its part, those after it go."""
    out, at = [], 0
    for e in entries:
        if at >= length:
            break
        if at + len(e.text) > length:
            e = dataclasses.replace(e, text=e.text[: length - at])
        out.append(e)
        at += len(e.text)
    return out


class _AnswerText:
    """A request's answer as its tokens come: detokenized, held back where it may be the
    start of a stop string and cut at one, each token's log-probability kept where the
    request asked; fills `result`'s tokens, text, log-probabilities and stop string."""

    def __init__(self, tokenizer: Any, params: SamplingParams, result: GenerationResult) -> None:
        self.tokenizer, self.result = tokenizer, result
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.want_logprobs = params.controls.logprobs
        self.asked_stops = params.stop
        self.stops = (*params.stop, params.turn_end) if params.turn_end else params.stop
        self.hold = max((len(s) for s in self.stops), default=0)
        self.emitted = 0

    def add(self, token: int, logprobs: mx.array) -> tuple[str, bool]:
        """The text `token` lets out (empty while held back), and whether the answer
        ended at a stop string with it."""
        result = self.result
        result.tokens.append(token)
        before = len(self.detok.text) if self.want_logprobs is not None else 0
        self.detok.add_token(token)
        text = self.detok.text
        if self.want_logprobs is not None:
            result.logprobs.append(token_logprob(self.tokenizer, token, logprobs, self.want_logprobs, text[before:]))
        safe = len(text)
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                hit, found = min(hits)
                result.stop_string = found if found in self.asked_stops else None
                result.text = text[:hit]
                if self.want_logprobs is not None:
                    result.logprobs = _cut_logprobs(result.logprobs, hit)
                return text[self.emitted : hit], True
            # Hold back text that might be the start of a stop string.
            safe = max(self.emitted, len(text) - self.hold)
        out = text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        result.text = text
        return out, False

    def finish(self) -> str:
        """The rest of the text once every token came (what the detokenizer and the stop
        strings held back)."""
        before = len(self.detok.text)
        self.detok.finalize()
        text = self.detok.text
        if self.result.logprobs and len(text) > before:
            last = self.result.logprobs[-1]
            self.result.logprobs[-1] = dataclasses.replace(last, text=last.text + text[before:])
        self.result.text = text
        return text[self.emitted :]


def request_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampling (temperature, top-p, min-p, top-k, in `make_sampler`'s order)
    drawing from the request's own key.

    MLX's global random state is shared by every request the daemon interleaves, so a
    seeded request would give different text when another request runs beside it; a
    key per request (split once per token) makes its draws its own."""
    if params.temp == 0:
        return make_sampler(temp=0.0)
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    state = [mx.random.key(seed)]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.controls.min_p != 0.0:
            logprobs = apply_min_p(logprobs, params.controls.min_p)
        # A k of the vocabulary or more keeps every token (stock's apply_top_k refuses it).
        if 0 < params.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, params.top_k)
        state[0], key = mx.random.split(state[0])
        return mx.random.categorical(logprobs * (1 / params.temp), key=key)

    return sample


def plain_steps(
    sm: StreamingModel,
    prompt_ids: Sequence[int],
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    on_prompt_progress: Callable[[int, int], None] | None = None,
    prefill_stats: PrefillStats | None = None,
    prefill_step: int = PREFILL_STEP,
    *,
    layer_major: bool = True,
    cache_use: CacheUse | None = None,
    pieces: bool = False,
    processors: Sequence[LogitsProcessor] = (),
) -> Iterator[tuple[mx.array | None, mx.array | None]]:
    """mlx-lm's `generate_step`, with the prompt prefilled layer by layer where that
    spares a partial pool reads (daemon/model/prefill.py): all of it but the last token,
    in stock's chunks; `generate_step` then takes the last token as its prompt, over the
    filled cache, exactly as stock's does after its own chunks (a model the layer-major
    prefill refuses is prefilled in stock's chunks there, `prefill_pieces`). `prefill_step` is
    `generate_step`'s `prefill_step_size`; `layer_major=False` keeps stock's order.

    With `cache_use` the prompt starts from the prompt cache's best prefix and only the
    rest is prefilled, as stock's `generate_step` given that cache would; every token
    yielded has gone into the request's cache (`generate_step` feeds each token before
    it yields it), which the caller keeps for later prompts; and a request whose prompt
    another one is prefilling waits on that prefill (daemon/model/shared_prefill.py).

    `pieces`: yield (None, None) after each piece of the prefill (a layer of the
    layer-major order, a chunk of stock's), so that the caller may do other work, or stop
    the request, between them (the daemon's engine loop); closed there, a prefill of the
    prompt cache's is left to the requests that share it, or kept suspended.

    `processors` (a constrained request's grammar, daemon/model/constrain.py, then
    `request_processors`) see the whole prompt and the tokens made, as they do in
    stock's `generate_step`, however the prompt was prefilled."""
    prompt = mx.array(list(prompt_ids))
    n = prompt.size
    lm = sm.layer_major
    wanted = lm is not None and layer_major and lm.wanted(n, prefill_step)
    if not pieces and cache_use is None and not wanted:
        yield from generate_step(
            prompt,
            sm.model,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=list(processors),
            prompt_progress_callback=on_prompt_progress,
            prefill_step_size=prefill_step,
        )
        return
    progress = on_prompt_progress or (lambda done, total: None)
    stats = prefill_stats if prefill_stats is not None else PrefillStats()
    if cache_use is not None:
        work = cache_use.prefilled(sm, prompt_ids, prefill_step, layer_major, progress, stats)
    else:
        progress(0, n)
        work = prefill_pieces(
            sm,
            prompt[:-1],
            prefill_step,
            on_progress=lambda done: progress(done, n),
            stats=stats,
            layer_major=layer_major,
        )
    cache = yield from _turns(work, pieces)
    yield from generate_step(
        prompt[-1:],
        sm.model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=with_history(processors, prompt_ids[:-1]),
        prompt_cache=cache,
        prompt_progress_callback=lambda done, total: progress(n - 1 + done, n) if done else None,
    )


def image_steps(
    sm: StreamingModel,
    prompt_ids: Sequence[int],
    images: PreparedImages,
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    on_prompt_progress: Callable[[int, int], None] | None = None,
    *,
    cache_use: CacheUse | None = None,
    processors: Sequence[LogitsProcessor] = (),
    prefill_step: int = PREFILL_STEP,
) -> Iterator[tuple[mx.array | None, mx.array | None]]:
    """A prompt with images (daemon/model/vision.py `vision_steps`): mlx-vlm's steps on
    the model's vision side, (None, None) after each prefill chunk. With `cache_use` it
    starts from the prompt cache's best prefix of the images' key (a resent image is
    part of it), and its cache is the request's, kept at its end under that key."""
    from .vision import vision_steps

    # The key holds the images' content hashes: a resent image is part of the prefix.
    cache, start = cache_use.start(sm, images.cache_key) if cache_use is not None else (make_prompt_cache(sm.model), 0)
    cache = sm.vision.request_cache(cache, fresh=start == 0)
    steps = vision_steps(
        sm.vision,
        prompt_ids,
        images,
        cache,
        start,
        sampler,
        max_tokens,
        processors,
        prefill_step=prefill_step,
        on_progress=on_prompt_progress,
        on_prefilled=None if cache_use is None else lambda c: cache_use.keep_prompt(images.cache_key, c),
    )
    for token, logprobs in steps:
        if token is not None and cache_use is not None:
            # Kept once it holds the whole prompt (a request stopped in its prefill keeps none).
            cache_use.hold(cache)
        yield token, logprobs


def _turns(work: Generator[None, None, Any], pieces: bool) -> Generator[tuple[None, None], None, Any]:
    """`work` run to its end, its value; with `pieces`, its pieces as turns of a request's
    steps, (None, None) after each. Closed between two, it closes `work` there (a shared
    prefill is left to its others)."""
    try:
        while True:
            try:
                next(work)
            except StopIteration as end:
                return end.value
            if pieces:
                yield None, None
    finally:
        work.close()


def _prefill_summary(stats: PrefillStats, counted: dict[str, float]) -> dict[str, Any]:
    """The request's prefill: its order, and the bytes read from the store and staged
    for it (with the first token's forward, which is counted with the prompt)."""
    out: dict[str, Any] = stats.to_dict() if stats.chunks else {"mode": "chunked"}
    out["read_bytes"] = counted["bytes_read"]
    out["staged_bytes"] = counted["staged_bytes"]
    return out


def iter_generate(
    sm: StreamingModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    result: GenerationResult,
    *,
    should_stop: Callable[[], bool] | None = None,
    on_prompt_progress: Callable[[int, int], None] | None = None,
    batch: BatchSession | None = None,
    prompt_cache: PromptCache | None = None,
    cache_scope: str = "",
    grammar: Grammar | None = None,
    images: PreparedImages | None = None,
) -> Iterator[tuple[str, int | None]]:
    """Yield (text segment, token id) pairs; fill `result` as it goes. With a `batch`
    (daemon/model/batching.py) the request decodes in it, beside the others (and while
    its prompt is prefilled beside them, it yields ("", None) between the prefill's
    pieces: no token, only the turn); a speculative request decodes on its own. With a
    `prompt_cache` the prompt starts from its best cached prefix, and the request's cache
    is kept there at the end (a speculative request keeps caches of its own and does
    neither).

    `on_prompt_progress(done, total)` is called as the prompt is prefilled: at its start
    and after each prefill chunk (mlx-lm's prefill step), on this thread.

    A `grammar` (daemon/model/constrain.py, compiled for this request) masks each step's
    logits before sampling: the request then decodes on its own (as `generate_step`, with
    the grammar among its logits processors), outside any batch and without speculation,
    and its statistics say so (`constraint`).

    `images` (a chat's, daemon/model/vision.py): the request decodes on its own through
    the model's vision side (`image_steps`), without speculation."""
    tokenizer = sm.tokenizer
    answer = _AnswerText(tokenizer, params, result)
    sampler = request_sampler(params)
    processors = request_processors(params)
    speculative_off = None
    if params.speculative and params.controls.needs_logits():
        # Speculation verifies drafts against the model's own logits and yields no
        # log-probabilities; such a request decodes without it (its statistics say so).
        speculative_off = "penalties, logit_bias or logprobs asked: decoded without speculation"
        params = dataclasses.replace(params, speculative=None)
    if params.speculative and images is not None:
        speculative_off = "a prompt with images: decoded without speculation"
        params = dataclasses.replace(params, speculative=None)
    mx.reset_peak_memory()
    prefill, decode = dict.fromkeys(POOL_COUNTERS, 0), dict.fromkeys(POOL_COUNTERS, 0)
    tic = time.perf_counter()
    prompt_seconds = 0.0
    n = 0
    prefill_stats = PrefillStats()
    rec = sm.diagnostics.new_recorder(params.diagnostics) if sm.diagnostics is not None else None
    use = CacheUse(prompt_cache, cache_scope) if prompt_cache is not None and prompt_cache.enabled else None
    # Every token the steps yield (an end token too): what went into the request's cache.
    fed: list[int] = []
    # The grammar masks first: the penalties and biases then see only what it allows.
    constrained = grammar.processor() if grammar is not None else None
    if constrained is not None:
        processors = [constrained, *processors]
    # Speculation verifies drafts from logits the grammar has not masked, and a batch
    # step samples every member at once: a constrained request decodes alone, unbatched.
    speculative = params.speculative if grammar is None else None
    if speculative or grammar is not None or images is not None:
        batch = None  # it decodes alone
    if speculative:
        use = None  # a speculative request keeps caches of its own
    steps, spec_stats = _step_source(
        sm,
        prompt_ids,
        params,
        sampler,
        processors,
        on_prompt_progress,
        prefill_stats,
        use,
        batch=batch,
        images=images,
        speculative=speculative,
        layer_major=rec is None,
    )
    readback = sm.routing_readback()
    for token, logprobs in _attributed(sm, steps, (prefill, decode), rec, readback):
        if token is None:
            # The prompt between two pieces of its prefill: the turn goes back to the
            # engine loop, which reads its commands and steps the others meanwhile; a
            # stop asked then takes effect before the next piece.
            if should_stop is not None and should_stop():
                result.finish_reason = "cancelled"
                break
            yield "", None
            if should_stop is not None and should_stop():
                result.finish_reason = "cancelled"
                break
            continue
        n += 1
        token = int(token)
        fed.append(token)
        if n == 1:
            prompt_seconds = time.perf_counter() - tic
            tic = time.perf_counter()
        if token in tokenizer.eos_token_ids:
            result.finish_reason = "stop"
            n -= 1
            break
        text, stopped = answer.add(token, logprobs)
        if text:
            yield text, token
        if stopped:
            result.finish_reason = "stop"
            break
        if should_stop is not None and should_stop():
            result.finish_reason = "cancelled"
            break
    else:
        rest = answer.finish()
        if rest:
            yield rest, result.tokens[-1] if result.tokens else -1
    decode_seconds = time.perf_counter() - tic
    if use is not None and batch is None:
        use.keep(images.cache_key if images is not None else prompt_ids, fed)
    # A request that broke off (a stop, a cancel) leaves the batch now, not when this
    # generator is collected.
    steps.close()
    if readback is not None and (batch is None or not batch.decoding()):
        # Account what is still pending (this request's last forwards, and those of
        # requests interleaved with it), so that its statistics and the heat include it.
        # Not while others decode in the batch: that waits for the forward in flight (and
        # for a placement's moves), and every one of them would wait too; their own
        # turns account the rest as it comes back.
        before = sm.counters()
        readback.settle()
        _add(decode, before, sm.counters())
    if rec is not None:
        sm.diagnostics.finish(rec)
    result.stats = _request_stats(
        sm,
        len(prompt_ids),
        result,
        (prefill, decode),
        (prompt_seconds, decode_seconds),
        max(n - 1, 0),
        use,
        prefill_stats,
        batch=batch,
        speculative=(spec_stats, speculative_off),
        constraint=_constraint_stats(grammar, constrained, params),
        diagnostics=rec,
    )


def _step_source(
    sm: StreamingModel,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    sampler: Callable[[mx.array], mx.array],
    processors: Sequence[Any],
    on_prompt_progress: Callable[[int, int], None] | None,
    prefill_stats: PrefillStats,
    use: CacheUse | None,
    *,
    batch: BatchSession | None,
    images: PreparedImages | None,
    speculative: str | None,
    layer_major: bool,
) -> tuple[Iterator, SpeculativeStats | None]:
    """The request's steps (`(token, logprobs)`, None between prefill pieces), and the
    speculative statistics they fill (None unless speculative): through the vision side,
    speculation, the `batch`, or alone."""
    if images is not None:
        steps = image_steps(
            sm,
            prompt_ids,
            images,
            sampler,
            params.max_tokens,
            on_prompt_progress,
            cache_use=use,
            processors=processors,
        )
        return steps, None
    if speculative:
        from .speculative import SpeculativeParams, SpeculativeStats, speculative_steps

        spec = SpeculativeParams(mode=speculative, draft_tokens=params.draft_tokens, draft_model=params.draft_model)
        spec_stats = SpeculativeStats(mode=spec.mode, draft_tokens_requested=spec.draft_tokens)
        steps = speculative_steps(
            sm,
            prompt_ids,
            sampler=sampler,
            max_tokens=params.max_tokens,
            spec=spec,
            stats=spec_stats,
            on_prompt_progress=on_prompt_progress,
            pieces=True,
        )
        return steps, spec_stats
    if batch is not None:
        steps = batch.steps(
            prompt_ids,
            sampler,
            params.max_tokens,
            on_prompt_progress,
            prefill_stats,
            use,
            True,
            processors=processors,
            logprobs=params.controls.logprobs is not None,
        )
        return steps, None
    # A request with diagnostics keeps stock's prefill order (`layer_major` False): they
    # time and attribute each forward's own path (slots, overflow), and the next layer's
    # prediction that the layer-major order has no use for.
    steps = plain_steps(
        sm,
        prompt_ids,
        sampler,
        params.max_tokens,
        on_prompt_progress,
        prefill_stats,
        layer_major=layer_major,
        cache_use=use,
        pieces=True,
        processors=processors,
    )
    return steps, None


def _constraint_stats(
    grammar: Grammar | None, constrained: GrammarProcessor | None, params: SamplingParams
) -> ConstraintStats | None:
    """What a constrained request's grammar checked and cost (None: unconstrained)."""
    if constrained is None or grammar is None:
        return None
    return ConstraintStats(
        kind=grammar.what,
        tokens_checked=constrained.consumed,
        mask_ms_per_token=1e3 * constrained.seconds / constrained.calls if constrained.calls else None,
        speculative="off" if params.speculative else None,
    )


def _request_stats(
    sm: StreamingModel,
    prompt_tokens: int,
    result: GenerationResult,
    counted: tuple[dict[str, float], dict[str, float]],
    seconds: tuple[float, float],
    decode_tokens: int,
    use: CacheUse | None,
    prefill_stats: PrefillStats,
    *,
    batch: BatchSession | None,
    speculative: tuple[SpeculativeStats | None, str | None],
    constraint: ConstraintStats | None,
    diagnostics: Recorder | None,
) -> RequestStats:
    """A request's statistics once it has ended: the pool's counters during its prefill
    and its decode (`counted`), its seconds of each, the cache it reused, the totals of
    the batch it decoded in, speculation's and the grammar's figures."""
    prefill, decode = counted
    prompt_seconds, decode_seconds = seconds
    spec_stats, speculative_off = speculative
    total = {k: prefill.get(k, 0) + decode.get(k, 0) for k in prefill.keys() | decode.keys()}
    routed_hits = total["hits_prefill"] + total["hits_decode"]
    routed_misses = total["misses_prefill"] + total["misses_decode"]
    shared = use.shared_stats if use is not None else None
    return RequestStats(
        prompt_tokens=prompt_tokens,
        cached_tokens=use.reused if use is not None else 0,
        generated_tokens=len(result.tokens),
        prompt_seconds=prompt_seconds,
        prompt_tokens_per_s=prompt_tokens / prompt_seconds if prompt_seconds else None,
        decode_seconds=decode_seconds,
        tokens_per_s=decode_tokens / decode_seconds if decode_seconds and decode_tokens else None,
        hits=PhaseCounts(
            prefill["hits_prefill"] + prefill["hits_decode"], decode["hits_prefill"] + decode["hits_decode"]
        ),
        misses=PhaseCounts(
            prefill["misses_prefill"] + prefill["misses_decode"], decode["misses_prefill"] + decode["misses_decode"]
        ),
        hit_rate=routed_hits / (routed_hits + routed_misses) if routed_hits + routed_misses else None,
        bytes_read=total["bytes_read"],
        evictions=total["evictions"],
        prestaged=total["prestaged"],
        prestaged_used=total["prestaged_used"],
        routed_experts=total["routed_total"],
        host_syncs_per_token=(decode["host_syncs"] / decode_tokens + 1.0) if decode_tokens else None,
        capacity=sm.capacity,
        mapped=sm.mapped_pool is not None,
        policy=sm.pools[0].policy.name if sm.pools else None,
        peak_memory_bytes=mx.get_peak_memory(),
        rss_bytes=psutil.Process().memory_info().rss,
        finish_reason=result.finish_reason,
        stop_string=result.stop_string,
        prefill=_prefill_summary(shared or prefill_stats, prefill),
        prompt_cache=use.stats() if use is not None else None,
        # The batch's totals when this request ended (its hits and misses above are the
        # pool's during the steps this request ran, which served the whole batch).
        batch=batch.to_dict() if batch is not None else None,
        mapped_pool=_placement_stats(total, sm.mapped_pool.gpu_slots) if sm.mapped_pool is not None else None,
        speculative=spec_stats.to_dict() if spec_stats is not None else None,
        speculative_off=speculative_off,
        constraint=constraint,
        prefetch=sm.prefetcher.stats() if sm.prefetcher is not None else None,
        diagnostics=diagnostics.to_dict() if diagnostics is not None else None,
    )
