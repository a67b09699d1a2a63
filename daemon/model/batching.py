"""Continuous batching: the daemon's active requests decode together, one forward per step,
each request's tokens the same as alone whatever its companions (batch-invariant).

Each request prefills its prompt but the last token on a cache of its own, as a request
alone does (daemon/model/prefill.py: layer by layer where that spares a partial pool
reads, else stock's chunks), in pieces between which the others' steps run. It then joins
the batch with that cache and its last token. A step feeds every member's pending token
through one forward (daemon/model/row_batch.py): the modules that keep a cache run per
request on that request's own cache with the lone token's call, the rest batched, every
dense matmul on the lone token's side of a kernel switch; then each member's logits go
through its own processors (given every token its cache holds, as `generate_step` gives
them), are normalised and sampled by its own sampler, as `generate_step` does. A member
alone is a batch of one: the plain forward of `generate_step`. So a request's tokens and
its seeded draws are those it would make alone, in any company (tests/test_row_batch.py,
tests/test_batching.py); on the CPU also stock mlx-lm's `generate_step` and
`BatchGenerator`'s. A model whose code cannot run per request (`RowBatch.probe`) decodes
its requests in turns.

Batching pays where a step of B requests costs less than B lone steps: a GPU's step of 4
costs 1.1-1.5x a lone one (tests/bench/RESULTS.md), a CPU's about 4x, where taking turns
makes the same tokens a second and the first in line is served sooner. So the session
times its own steps by size (`StepCosts`) and lets the batch grow only while a step costs
less a token than a lone one; a request that would not pay decodes alone, in turns with
the batch (as every request does with max_batch 1). A size not timed yet is tried, and a
verdict goes stale.

A step is one step ahead of what its members yield (as `generate_step` keeps one step
ahead): the token a member yields was sampled in the step before, and read back while
the next one runs on the device.

Each request looks like a generator of (token, logprobs) to `iter_generate`
(`BatchSession.steps`): when its own buffer is empty it advances the whole batch one
step, which fills every member's buffer; the engine loop's round robin then finds the
others' tokens waiting. A request that ends (its tokens, a stop string, a cancel, a
vanished client) leaves the batch before the next step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from ..mapped.row_gather import MAX_GATHERED
from .prefill import PREFILL_STEP, PrefillStats, prefill_pieces
from .row_batch import RowBatch
from .streaming_model import StreamingModel

if TYPE_CHECKING:
    from .generation import CacheUse


@dataclass
class BatchStats:
    """What the session's batch did, for `status` and each request's statistics."""

    # Steps (a member alone included), the tokens they made, and the largest batch seen.
    steps: int = 0
    tokens: int = 0
    max_size: int = 0
    # Requests that started in the session, and that left it.
    joined: int = 0
    left: int = 0
    # Where the session's time went, in seconds of the engine loop's wall: the steps, and
    # the prompts prefilled (each alone, between the steps). Each call also waits for the
    # device's work queued before it, so device time lands in whichever call waited for it.
    decode_s: float = 0.0
    prefill_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_size": self.tokens / self.steps if self.steps else None}


@dataclass
class _Member:
    """A request in the batch: its cache (which holds `brought` and `fed`), the token it
    feeds next (`pending`: sampled from its last step and not yielded yet, or its prompt's
    last token), and the tokens made and not yet taken, each with the log-probabilities
    its sampler took where the request wants them (else None)."""

    cache: list[Any]
    sampler: Callable[[mx.array], mx.array]
    max_tokens: int
    pending: mx.array
    # The prompt's tokens its cache held when it joined, and the tokens fed to it since.
    brought: list[int]
    fed: list[int] = field(default_factory=list)
    # Whether `pending` was sampled (to be yielded once read), not the prompt's last token.
    sampled: bool = False
    pending_logprobs: mx.array | None = None
    produced: int = 0
    # Its logits processors, and every token its cache holds and the pending one (what
    # `generate_step` shows them); None without processors.
    processors: Sequence[Any] = ()
    context: mx.array | None = None
    logprobs: bool = False
    tokens: deque[tuple[int, mx.array | None]] = field(default_factory=deque)
    finished: bool = False

    def sample(self, logits: mx.array) -> None:
        """The next pending token from this member's row of a step's logits [1, vocab]:
        its processors, normalised, its sampler (`generate_step`'s own order)."""
        if self.processors:
            self.context = mx.concatenate([self.context, self.pending.astype(mx.int32)])
            for processor in self.processors:
                logits = processor(self.context, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        self.pending = self.sampler(logprobs)
        self.pending_logprobs = logprobs.squeeze(0) if self.logprobs else None
        self.sampled = True

    def made(self, token: int, logprobs: mx.array | None, eos: frozenset[int]) -> None:
        """`token` (fed in the step just queued) is the request's next: into its buffer,
        the last at an end token or its max tokens."""
        self.produced += 1
        self.tokens.append((token, logprobs))
        self.finished = token in eos or self.produced >= self.max_tokens


class StepCosts:
    """Recent steps' seconds by batch size, and whether a size pays against lone steps."""

    # Steps timed per size before it is judged, and how many are kept.
    MIN_STEPS = 4
    WINDOW = 16
    # A size pays where its step costs below this share of its members' lone steps: a
    # tie is not worth a lone request's longer wait for its first token.
    MARGIN = 0.97
    # Steps after which a size's times are dropped and it is tried again (the costs move
    # with the context's length, and a size judged not to pay is never timed otherwise).
    STALE = 512

    def __init__(self) -> None:
        self.steps = 0
        self._times: dict[int, deque[tuple[int, float]]] = {}

    def record(self, size: int, seconds: float) -> None:
        self.steps += 1
        self._times.setdefault(size, deque(maxlen=self.WINDOW)).append((self.steps, seconds))

    def seconds(self, size: int) -> float | None:
        """The median step of `size` requests, None until MIN_STEPS recent ones."""
        times = self._times.get(size)
        while times and times[0][0] < self.steps - self.STALE:
            times.popleft()
        if not times or len(times) < self.MIN_STEPS:
            return None
        return statistics.median(t for _, t in times)

    def pays(self, size: int) -> bool:
        """Whether a step of `size` requests makes tokens faster than lone steps (True
        while either is not timed: it is tried)."""
        lone, at = self.seconds(1), self.seconds(size)
        return size <= 1 or lone is None or at is None or at < size * lone * self.MARGIN

    def to_dict(self) -> dict[str, float | None]:
        return {str(size): self.seconds(size) for size in sorted(self._times)}


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


# Tokens a member may hold untaken before it sits out the steps.
HELD_TOKENS = 2

# The most requests of a batch whose size the daemon chooses (max_batch 0): the most any
# serve run measured (tests/bench/RESULTS.md, "Serving several clients"; 8 clients on the
# H100 made 1.10x what 4 did).
AUTO_MAX_BATCH = 8


class BatchSession:
    """One model's batch of decoding requests (`max_batch` 0: up to AUTO_MAX_BATCH, while
    they pay)."""

    def __init__(self, sm: StreamingModel, max_batch: int, prefill_step: int = PREFILL_STEP) -> None:
        self.sm = sm
        self.auto = max_batch == 0
        self.requested = max_batch or AUTO_MAX_BATCH
        self.max_batch = batch_cap(sm, self.requested)
        self.prefill_step = prefill_step
        self._eos = frozenset(sm.tokenizer.eos_token_ids)
        self._members: list[_Member] = []
        self._rows = RowBatch(sm.model)
        if self.max_batch > 1:
            with sm.uncounted():
                if not self._rows.probe():
                    self.max_batch = 1  # its requests take turns
        self.stats = BatchStats()
        self.costs = StepCosts()
        # Whether the last call before the next step was a prefill's piece, whose device
        # work that step would wait for: such a step is not timed.
        self._after_prefill = False

    @property
    def size(self) -> int:
        return len(self._members)

    def decoding(self) -> int:
        """Members whose tokens are still being made."""
        return sum(not m.finished for m in self._members)

    def has_room(self, active: int) -> bool:
        """Whether a request may start beside `active` batched ones."""
        return active < self.max_batch

    def pays(self, active: int) -> bool:
        """Whether a request that starts beside `active` batched ones should join them
        (`StepCosts`, where the daemon chooses the size), rather than decode alone in turns
        with them."""
        return not self.auto or active == 0 or self.costs.pays(active + 1)

    def why_full(self) -> str:
        """Why no more requests join, for `status` while some wait."""
        if self.max_batch < self.requested:
            return (
                f"the batch is full: {self.max_batch} requests (max_batch {self.requested}, capped so that one "
                "step's experts fit the pool's slots or its gather)"
            )
        if self.max_batch == 1:
            return f"requests take turns: this model's code cannot decode them per request ({self._rows.why_not})"
        return f"the batch is full: {self.max_batch} requests (max_batch)"

    def to_dict(self) -> dict[str, Any]:
        """The batch for `status`: its bounds, its size now and its counts."""
        return {
            "auto": self.auto,
            "max_batch": self.max_batch,
            "requested": self.requested,
            "size": self.size,
            "step_seconds": self.costs.to_dict(),
            **self.stats.to_dict(),
        }

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
        log-probabilities where `logprobs`, else None), its `processors` applied: its
        prompt prefilled on its own cache, then its decode in the batch. While other
        members decode (or always, with `pieces`: the engine loop reads its commands
        there), its prefill yields (None, None) after each of its pieces, so that their
        steps come between them. With `cache_use`, the prompt starts from the prompt
        cache's best prefix, a copy of a cache of its own filled up to the prompt's last
        token is kept there, and so is the request's cache when it finishes."""
        n = len(prompt_ids)
        report = on_prompt_progress or (lambda done, total: None)
        reported = [-1]

        def progress(done: int, total: int) -> None:
            # Once each: the prefill's first piece reports where the cached prefix ended too.
            if done != reported[0]:
                reported[0] = done
                report(done, total)

        cache, m = cache_use.start(self.sm, prompt_ids) if cache_use is not None else (None, 0)
        progress(m, n)
        cache = yield from self._prefill(prompt_ids, m, cache, progress, prefill_stats, cache_use, pieces)
        if cache_use is not None:
            cache_use.keep_prompt(prompt_ids, cache)
        yield from self._wait_for_room()
        brought = [int(t) for t in prompt_ids[:-1]]
        member = _Member(
            cache,
            sampler,
            max_tokens,
            mx.array([int(prompt_ids[-1])]),
            brought,
            processors=processors,
            context=mx.array(brought, mx.int32) if processors else None,
            logprobs=logprobs,
        )
        self._members.append(member)
        self.stats.joined += 1
        first = True
        try:
            while True:
                while not member.tokens and not member.finished:
                    self._advance()
                if not member.tokens:
                    return
                if first:
                    progress(n, n)
                    first = False
                yield member.tokens.popleft()
        finally:
            if member in self._members:
                self._members.remove(member)
            self.stats.left += 1
            if cache_use is not None and member.finished:
                cache_use.prompt_cache.insert(
                    [*member.brought, *member.fed], member.cache, persist=True, scope=cache_use.scope
                )

    def _prefill(
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
            work = cache_use.prefilled(self.sm, prompt_ids, self.prefill_step, True, progress, stats, (cache, m))
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
                    self.stats.prefill_s += time.perf_counter() - tic
                    self._after_prefill = True
                if pieces or self.decoding():
                    # The others decode between this prompt's pieces (a layer, or a
                    # chunk), and the engine reads its commands: a turn with no token yet.
                    yield None, None
        finally:
            work.close()

    def _wait_for_room(self) -> Iterator[tuple[None, None]]:
        """The engine loop starts no more batched requests than the batch holds
        (`has_room`); a caller that does waits here for room, its step serving the
        batch meanwhile."""
        while self.decoding() >= self.max_batch:
            if not self._advance():
                # Every member holds tokens not taken yet: their takers' turns come first.
                yield None, None

    def _advance(self) -> bool:
        """One step: every member's pending token fed, its next sampled on the device;
        the tokens fed that were sampled go to their members' buffers once read (while
        the step runs). False where no member could step."""
        # A member whose tokens the engine is not taking (its client paused by an unread
        # stream) sits out the steps: its buffer stays short, and the others' steps lose
        # nothing (a row is the same in any company).
        members = [m for m in self._members if not m.finished and len(m.tokens) < HELD_TOKENS]
        if not members:
            return False
        tic = time.perf_counter()
        fed = [(m.pending, m.sampled, m.pending_logprobs) for m in members]
        with mx.stream(generation_stream):
            if len(members) == 1:
                # Alone: generate_step's own forward.
                logits = self.sm.model(members[0].pending[None], cache=members[0].cache)[:, -1, :]
            else:
                logits = self._rows.step(mx.concatenate([m.pending for m in members]), [m.cache for m in members])
            for i, m in enumerate(members):
                m.sample(logits[i : i + 1])
        mx.async_eval([m.pending for m in members] + [m.pending_logprobs for m in members if m.logprobs])
        made = 0
        for m, (token, sampled, logprobs) in zip(members, fed):
            value = int(token.item())
            m.fed.append(value)
            if sampled:
                m.made(value, logprobs, self._eos)
                made += 1
        seconds = time.perf_counter() - tic
        if not self._after_prefill:
            self.costs.record(len(members), seconds)
        self._after_prefill = False
        self.stats.decode_s += seconds
        self.stats.steps += 1
        self.stats.tokens += made
        self.stats.max_size = max(self.stats.max_size, len(members))
        return True

    def close(self) -> None:
        self._members.clear()
