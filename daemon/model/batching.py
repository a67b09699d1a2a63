"""Continuous batching: the daemon's active requests decode together, one forward per step.

Built on mlx-lm's own `BatchGenerator` (per-sequence samplers, max tokens and stop
tokens, left-padded batch caches, sequences joining and leaving between steps). Each
request first prefills its prompt but the last token on a cache of its own, as a request
alone does (daemon/model/prefill.py `prefill_cache`: layer by layer where that spares
a partial pool reads, else stock's chunks), then joins the batch with that cache and
its last token, which is how `BatchGenerator.insert` takes a prompt with a cache. So the
batched decode runs mlx-lm's code on the caches stock's prefill makes (exactness is
checked against stock's `BatchGenerator` fed the same way, tests/test_batching.py).

Each request brings its own sampler and logits processors (generation.py
`request_processors`), which `BatchGenerator` applies to its row of each step's logits
(given every token its cache holds, `all_tokens`, as `generate_step` gives them the
whole prompt), and its alone steps apply likewise.

A request whose prompt arrives while the batch decodes, and whose prompt (past any
prefix the prompt cache holds) is short (`JOINT_PREFILL_TOKENS`), is instead handed to
`BatchGenerator` whole, as stock's batching takes prompts: requests that arrive together
are prefilled together, in one forward (left-padded, by stock's code), between two of
the batch's steps. Eight short prompts arriving at once then cost about one prefill, not
eight in a row while the batch waits. A request alone (nothing decoding) is prefilled on
its own cache as above, so that it is served exactly as without batching.

A request alone decodes outside the batch, as `generate_step` decodes (`_Solo`): on the
H200 a lone request in mlx-lm's `BatchGenerator` made 0.60x the tokens a second of
`generate_step` at 100% and 0.62x at 25% + host (masked attention, per-row offsets and
the batch's bookkeeping at every layer; tests/bench/RESULTS.md, "Serving several
clients"). When another request joins, the lone one hands over: the token it has
sampled but not fed goes into the batch with its cache and its sampler, which is how a
request prefilled alone joins anyway, so its tokens and its seeded draws are the ones it
would have made alone.

Each request still looks like a generator of (token, logprobs) to `iter_generate`
(`BatchSession.steps`): when its own buffer is empty it advances the whole batch one
step, which fills every member's buffer; the engine loop's round robin then finds the
others' tokens waiting. A request that ends (its tokens, a stop string, a cancel, a
vanished client) leaves the batch before the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream

from ..mapped.row_gather import MAX_GATHERED
from .prefill import PREFILL_STEP, PrefillStats, prefill_pieces
from .streaming_model import StreamingModel

# The longest prompt (past a cached prefix) prefilled jointly with others: short prompts
# gain most (one forward instead of several, each routing nearly every expert of a
# layer), and a longer one goes layer by layer on its own, handing the batch back between
# pieces (a joint forward holds the batch until it ends).
JOINT_PREFILL_TOKENS = 256

if TYPE_CHECKING:
    from .generation import CacheUse


@dataclass
class BatchStats:
    """What the session's batch did, for `status` and each request's statistics."""

    steps: int = 0
    # Tokens made over all steps, and the largest batch seen.
    tokens: int = 0
    max_size: int = 0
    # Requests that started in the session (alone or in the batch), and that left it.
    joined: int = 0
    left: int = 0
    # Requests whose prompts the batch prefilled, together with any that arrived with them.
    joint_prefills: int = 0
    # Tokens made by a request decoding alone, outside the batch, and the lone requests
    # that handed over to the batch when another joined.
    solo_tokens: int = 0
    handoffs: int = 0
    # Where the session's time went, in seconds of the engine loop's wall: the batch's
    # decode steps, its joint prefills (stock's prompt processing), the rest of its steps
    # (a joiner's first step and its cache merged into the batch), prompts prefilled
    # alone, and the lone request's steps. Each call also waits for the device's work
    # queued before it, so device time lands in whichever call waited for it.
    decode_s: float = 0.0
    joint_prefill_s: float = 0.0
    join_s: float = 0.0
    prefill_alone_s: float = 0.0
    solo_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_size": self.tokens / self.steps if self.steps else None}


@dataclass
class _Member:
    """A request's tokens made by batch steps (or alone) and not yet taken, each with
    the log-probabilities its sampler took where the request wants them (else None)."""

    # Its id in the batch; None while it decodes alone.
    uid: int | None

    # The tokens its cache held when it joined: the prompt's tokens the batch does not
    # count among those it fed (`all_tokens`); the prompt cache keys the final cache by both.
    brought: Sequence[int] = ()
    tokens: deque[tuple[int, mx.array | None]] = field(default_factory=deque)
    logprobs: bool = False
    finished: bool = False
    # Once finished: its cache out of the batch, and the tokens it holds beyond those
    # the request brought in its own cache (its last prompt token and those it made).
    final: tuple[list[Any], list[int]] | None = None

    def add(self, token: int, last: bool, logprobs: mx.array | None = None) -> None:
        self.tokens.append((token, logprobs if self.logprobs else None))
        self.finished = self.finished or last

    def keep(self, cache: list[Any], tokens: list[int]) -> None:
        self.final = (cache, tokens)

    def handed_over(self, uid: int, fed: Sequence[int]) -> None:
        """It decoded alone and is now `uid` in the batch, on a cache that holds what it
        brought and the tokens it `fed` alone."""
        self.uid = uid
        self.brought = [*self.brought, *fed]


@dataclass
class _Solo:
    """A request decoding alone, as `generate_step` decodes: every token it yields has
    gone into `cache` (listed in `fed`), and `pending` is the token sampled from the last
    of them, neither fed nor yielded yet (computed while the caller takes the previous)."""

    member: _Member
    cache: list[Any]
    sampler: Callable[[mx.array], mx.array]
    max_tokens: int
    pending: mx.array
    fed: list[int] = field(default_factory=list)
    produced: int = 0
    # The request's logits processors, and every token its cache holds and the pending
    # one (what `generate_step` shows them); None without processors.
    processors: Sequence[Any] = ()
    context: mx.array | None = None
    # The log-probabilities `pending` was sampled from (kept where the request wants them).
    pending_logprobs: mx.array | None = None

    def feed(self, model: Any) -> None:
        """Feed the pending token into the cache and sample the next, lazily and started
        on the device: `generate_step`'s own step (its logits, the request's processors,
        normalized, then the request's sampler), so that a request alone makes stock's tokens."""
        with mx.stream(generation_stream):
            logits = model(self.pending[None], cache=self.cache)[:, -1, :]
            if self.processors:
                self.context = mx.concatenate([self.context, self.pending.astype(mx.int32)])
                for processor in self.processors:
                    logits = processor(self.context, logits)
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            sampled = self.sampler(logprobs)
        if self.member.logprobs:
            self.pending_logprobs = logprobs.squeeze(0)
            mx.async_eval(sampled, self.pending_logprobs)
        else:
            mx.async_eval(sampled)
        self.pending = sampled

    def step(self, model: Any, eos: frozenset[int]) -> None:
        """Make the next token: the pending one, fed while the one after it is sampled on
        the device (as `generate_step` keeps one step ahead)."""
        token, logprobs = self.pending, self.pending_logprobs
        self.feed(model)
        value = int(token.item())
        self.fed.append(value)
        self.made(value, eos, logprobs)

    def made(self, token: int, eos: frozenset[int], logprobs: mx.array | None) -> None:
        """`token` is the request's next: into its buffer, the last at an end token or
        its max tokens, and then its cache is the one the request keeps."""
        self.produced += 1
        self.member.add(token, token in eos or self.produced >= self.max_tokens, logprobs)
        if self.member.finished:
            self.member.keep(self.cache, self.fed)


def batch_cap(sm: StreamingModel, max_batch: int) -> int:
    """`max_batch`, capped where one step's routed experts would leave the pool's fast
    path: B requests route up to B x top-k experts per layer, which must fit a partial
    slot pool's slots (else every step would take the overflow path and read them all
    again); a mapped pool that gathers the routed experts' rows first gathers at most
    MAX_GATHERED ids (beyond them its kernels read host memory in place, several times
    slower: tests/bench/RESULTS.md, "Serving several clients"). A full pool, or a mapped one
    without the gather, takes any batch."""
    caps = [max_batch]
    for p in sm.pools:
        if not p.fully_resident:
            caps.append(p.capacity // p.top_k)
        elif p.host_memory and p.gather is not None:
            caps.append(MAX_GATHERED // p.top_k)
    return max(1, min(caps))


class BatchSession:
    """One model's batch of decoding requests."""

    def __init__(self, sm: StreamingModel, max_batch: int, prefill_step: int = PREFILL_STEP) -> None:
        self.sm = sm
        self.requested = max_batch
        self.max_batch = batch_cap(sm, max_batch)
        self.prefill_step = prefill_step
        eos = sorted(sm.tokenizer.eos_token_ids)
        self._gen = BatchGenerator(
            sm.model,
            stop_tokens=[[e] for e in eos],
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=prefill_step,
        )
        self._eos = frozenset(eos)
        self._members: dict[int, _Member] = {}
        # The request decoding alone, outside the batch (none while the batch decodes).
        self._solo: _Solo | None = None
        self.stats = BatchStats()

    @property
    def size(self) -> int:
        return len(self._members) + (self._solo is not None)

    def decoding(self) -> int:
        """Members whose tokens are still being made (the one decoding alone too)."""
        return sum(not m.finished for m in self._members.values()) + (self._solo is not None)

    def has_room(self, active: int) -> bool:
        """Whether a request may start beside `active` batched ones."""
        return active < self.max_batch

    def why_full(self) -> str:
        """Why no more requests join, for `status` while some wait."""
        if self.max_batch < self.requested:
            return (
                f"the batch is full: {self.max_batch} requests (max_batch {self.requested}, capped so that one "
                "step's experts fit the pool's slots or its gather)"
            )
        return f"the batch is full: {self.max_batch} requests (max_batch)"

    def to_dict(self) -> dict[str, Any]:
        """The batch for `status`: its bounds, its size now and its counts."""
        return {"max_batch": self.max_batch, "requested": self.requested, "size": self.size, **self.stats.to_dict()}

    def steps(
        self,
        prompt_ids: Sequence[int],
        sampler: Callable[[mx.array], mx.array],
        max_tokens: int,
        on_prompt_progress: Callable[[int, int], None] | None = None,
        prefill_stats: PrefillStats | None = None,
        cache_use: CacheUse | None = None,
        pieces: bool = False,
        *,
        processors: Sequence[Any] = (),
        logprobs: bool = False,
    ) -> Iterator[tuple[int | None, mx.array | None]]:
        """One request's tokens, as `generate_step` yields them (token, and its
        log-probabilities where `logprobs`, else None), its `processors` applied:
        its prompt prefilled (on its own cache, or jointly by the batch: see the module's
        note), then its decode in the batch. While other members decode (or always, with
        `pieces`: the engine loop reads its commands there), a prefill of its own yields
        (None, None) after each of its pieces, so that their turns come between them; a
        joint one yields once before the step that prefills it. With
        `cache_use`, the prompt starts from the prompt cache's best prefix, a copy of a
        cache of its own filled up to the prompt's last token is kept there, and so is
        the request's cache out of the batch when it finishes (with the tokens the batch
        fed it)."""
        n = len(prompt_ids)
        progress = on_prompt_progress or (lambda done, total: None)
        cache, m = cache_use.start(self.sm, prompt_ids) if cache_use is not None else (None, 0)
        progress(m, n)
        joint = self._joins_prefill(n - m)
        if joint:
            # The prompt past its cached prefix goes to the batch, which prefills it at its
            # next step together with the others inserted by then.
            self.stats.joint_prefills += 1
            rest = [int(t) for t in prompt_ids[m:]]
            member = self._join(rest, cache, sampler, max_tokens, prompt_ids[:m], processors, logprobs)
        else:
            cache = yield from self._prefill_alone(prompt_ids, m, cache, progress, prefill_stats, cache_use, pieces)
            if cache_use is not None:
                cache_use.keep_prompt(prompt_ids, cache)
            if self.decoding():
                last = [int(prompt_ids[-1])]
                member = self._join(last, cache, sampler, max_tokens, prompt_ids[:-1], processors, logprobs)
            else:
                last = int(prompt_ids[-1])
                member = self._start_solo(last, cache, sampler, max_tokens, prompt_ids[:-1], processors, logprobs)
        first = True
        try:
            if joint:
                # One turn back before the batch's next step, so that requests that
                # arrived with this one are inserted too and prefilled in the same forward.
                yield None, None
            while True:
                while not member.tokens and not member.finished:
                    if member.uid is None:
                        self._solo_step()
                    else:
                        self._advance()
                if not member.tokens:
                    return
                if first:
                    progress(n, n)
                    first = False
                yield member.tokens.popleft()
        finally:
            if self._solo is not None and self._solo.member is member:
                self._solo = None
            if member.uid is not None:
                del self._members[member.uid]
                if not member.finished:
                    self._gen.remove([member.uid])
            self.stats.left += 1
            if cache_use is not None and member.final is not None:
                cache, tokens = member.final
                cache_use.prompt_cache.insert([*member.brought, *tokens], cache, persist=True, scope=cache_use.scope)

    def _joins_prefill(self, remaining: int) -> bool:
        """Whether a prompt with `remaining` tokens past its cached prefix goes to the
        batch's joint prefill: it is short and the batch is decoding (a request alone
        is prefilled on its own, as without batching)."""
        return 1 < remaining <= JOINT_PREFILL_TOKENS and self.decoding() > 0

    def _prefill_alone(
        self,
        prompt_ids: Sequence[int],
        m: int,
        cache: list[Any] | None,
        progress: Callable[[int, int], None],
        prefill_stats: PrefillStats | None,
        cache_use: CacheUse | None,
        pieces: bool,
    ) -> Generator[tuple[None, None], None, list[Any]]:
        """Prefill the prompt but its last token on the request's own cache (from
        position `m`, past a cached prefix), and return that cache; with `cache_use`, as
        a prefill the same prompt's requests share (daemon/model/shared_prefill.py)."""
        prompt = mx.array(list(prompt_ids))
        n = int(prompt.size)
        stats = prefill_stats if prefill_stats is not None else PrefillStats()
        if cache_use is not None:
            work = cache_use.prefilled(
                self.sm, prompt_ids, self.prefill_step, True, progress, stats, fetched=(cache, m)
            )
        else:
            work = prefill_pieces(
                self.sm, prompt[m:-1], self.prefill_step, on_progress=lambda done: progress(m + done, n), stats=stats
            )
        try:
            while True:
                tic = time.perf_counter()
                try:
                    next(work)
                except StopIteration as end:
                    return end.value
                finally:
                    self.stats.prefill_alone_s += time.perf_counter() - tic
                if pieces or self.decoding():
                    # The others decode between this prompt's pieces (a layer, or a
                    # chunk), and the engine reads its commands: a turn with no token yet.
                    yield None, None
        finally:
            work.close()

    def _start_solo(
        self,
        last: int,
        cache: list[Any],
        sampler: Callable[[mx.array], mx.array],
        max_tokens: int,
        brought: Sequence[int],
        processors: Sequence[Any],
        logprobs: bool,
    ) -> _Member:
        """Decode alone from the prompt's `last` token on `cache` (which holds `brought`),
        as `generate_step` takes its prompt's last token, until another request joins."""
        member = _Member(None, brought=list(brought), logprobs=logprobs)
        context = mx.array(list(brought), mx.int32) if processors else None
        solo = _Solo(
            member, cache, sampler, max_tokens, mx.array([last]), [last], processors=processors, context=context
        )
        solo.feed(self.sm.model)
        self._solo = solo
        self.stats.joined += 1
        return member

    def _solo_step(self) -> None:
        """The request alone makes its next token."""
        solo = self._solo
        assert solo is not None
        tic = time.perf_counter()
        solo.step(self.sm.model, self._eos)
        self.stats.solo_s += time.perf_counter() - tic
        self.stats.solo_tokens += 1
        if solo.member.finished:
            self._solo = None

    def _hand_over(self) -> None:
        """Move the request decoding alone into the batch: its pending token (sampled by
        its own sampler, not fed) is its next token, and the batch feeds it on the
        request's cache, with the same sampler for the rest."""
        solo, self._solo = self._solo, None
        if solo is None:
            return
        member = solo.member
        solo.made(int(solo.pending.item()), self._eos, solo.pending_logprobs)
        self.stats.solo_tokens += 1
        if member.finished:
            # Its last token came with the handover (not fed: the cache kept holds what it fed).
            return
        (uid,) = self._gen.insert(
            [[member.tokens[-1][0]]],
            max_tokens=[solo.max_tokens - solo.produced],
            caches=[solo.cache],
            all_tokens=[[*member.brought, *solo.fed]],
            samplers=[solo.sampler],
            logits_processors=[list(solo.processors)],
        )
        member.handed_over(uid, solo.fed)
        self._members[uid] = member
        self.stats.handoffs += 1

    def _join(
        self,
        tokens: list[int],
        cache: list[Any] | None,
        sampler: Callable[[mx.array], mx.array],
        max_tokens: int,
        brought: Sequence[int],
        processors: Sequence[Any],
        logprobs: bool,
    ) -> _Member:
        """Insert `tokens` (what the batch still feeds, on `cache`, which holds `brought`)
        once the batch has room; the request's member. A request decoding alone goes
        into the batch first."""
        self._hand_over()
        self._wait_for_room()
        (uid,) = self._gen.insert(
            [tokens],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[[int(t) for t in brought]],
            samplers=[sampler],
            logits_processors=[list(processors)],
        )
        member = self._members[uid] = _Member(uid, brought=list(brought), logprobs=logprobs)
        self.stats.joined += 1
        return member

    def _wait_for_room(self) -> None:
        """The engine loop starts no more batched requests than the batch holds
        (`has_room`); a caller that does waits here for room, its step serving the
        batch meanwhile."""
        while self.decoding() >= self.max_batch:
            self._advance()

    def _advance(self) -> None:
        """One step of the batch: every member's next token into its buffer."""
        tic = time.perf_counter()
        with self._gen.stats() as took:
            _, responses = self._gen.next()
        self.stats.decode_s += took.decode_time
        self.stats.joint_prefill_s += took.prompt_time
        self.stats.join_s += time.perf_counter() - tic - took.decode_time - took.prompt_time
        if not responses:
            return
        self.stats.steps += 1
        self.stats.tokens += len(responses)
        self.stats.max_size = max(self.stats.max_size, len(responses))
        for r in responses:
            member = self._members.get(r.uid)
            if member is None:
                continue
            member.add(int(r.token), r.finish_reason is not None, r.logprobs)
            if r.finish_reason is not None and r.prompt_cache is not None:
                # `all_tokens` starts with what the member brought (given to `insert`).
                member.keep(r.prompt_cache, list(r.all_tokens)[len(member.brought) :])

    def close(self) -> None:
        self._gen.close()
