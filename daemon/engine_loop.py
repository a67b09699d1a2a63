"""The engine thread: it owns the model, the expert pool and the heat publisher.

Requests are served by fair interleaving: each active request is an `iter_generate`
generator with its own KV cache, and the loop advances them round-robin, one step each.
Every step reads the command queue first, so a cancel or a disconnect stops a request
before its next token. The pool waits for queued work before it overwrites a slot
(`ExpertPool._admit`, or the forward's own router sync where a stream runs in order:
`ExpertPool.ensure`), so interleaved requests get exactly the tokens they get alone
(greedy; with sampling, requests share MLX's global random state).

Only this thread touches MLX, and it is the process's main thread: with the CPU build
of MLX 0.32, a process whose non-main thread loaded or ran a model aborts at exit
("terminate called without an active exception"). It talks to the I/O thread through a
command queue (in) and an inproc PUSH socket (out: [peer, encoded event] frames, or
[b"", b"exit"] when it ends), and publishes a status snapshot that the I/O thread reads
without locking.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Iterator

import zmq

from ..shared import protocol as proto
from ..shared.settings import Settings, format_size
from ..shared.status import (
    ClientsStatus,
    MemoryStatus,
    PoolStatus,
    PrefillOrder,
    RecentRequest,
    RequestCounters,
    RequestInfo,
    RequestsStatus,
    RequestStats,
    RequestTotals,
    Stats,
    Status,
)
from .heat import Heat
from .keep_alive import KeepAlive, trim_heap
from .limits import FileLimit
from .pool.elastic import ElasticPool
from .pool.pressure import pressure_source
from .prompt_check import CountRequest

if TYPE_CHECKING:
    from ..shared.status import ContextLimit
    from ..shared.store_format import ManifestStamp
    from .model.batching import BatchSession
    from .model.expert_parallel import ExpertShare
    from .model.generation import GenerationResult, SamplingParams
    from .model.prompt_cache import PromptCache
    from .model.reasoning import ReasoningSplitter
    from .model.streaming_model import StreamingModel
    from .model.tool_calls import ToolCallSplitter
    from .prompt_check import Checked, PromptChecker

EXIT_FRAME = b"exit"
SNAPSHOT_SECONDS = 0.1
RECENT_REQUESTS = 32
# A client with no request running may start one past max_active (at most max_active //
# OVERFLOW_SHARE past it: 2 of the default 8, none below 4) while another client holds several.
OVERFLOW_SHARE = 4
# Queued requests listed one by one in `status` (all of them are counted).
LISTED_WAITING = 16


@dataclass(frozen=True)
class Snapshot:
    """What the engine last published, for the I/O thread's `status` and `stats` replies."""

    at: float  # time.monotonic() when published
    status: Status  # the engine's part; the I/O thread adds its own (daemon/server.py `Server.status`)
    stats: Stats  # the pool's and the reader's full counters, for `stats`
    # The store it serves (None: none loaded yet) and its manifest's stat at the load, which
    # `status` compares with the file's now.
    served: str | None
    store_stamp: ManifestStamp | None


@dataclass(frozen=True)
class Submit:
    peer: bytes
    msg: proto.Generate


@dataclass(frozen=True)
class CancelCmd:
    peer: bytes
    msg: proto.Cancel
    at: float


@dataclass(frozen=True)
class PeerGone:
    """A send to this peer failed: its socket is closed, stop its requests."""

    peer: bytes
    at: float


@dataclass(frozen=True)
class PeerPaused:
    """This peer's reply queue is full (paused: True) or has drained (False): its requests
    are not stepped while it reads nothing (daemon/server.py)."""

    peer: bytes
    paused: bool


@dataclass(frozen=True)
class LoadCmd:
    """A load request (Ollama's load, or its unload with keep_alive 0)."""

    peer: bytes
    msg: proto.Load


@dataclass(frozen=True)
class CheckDone:
    """The prompt checker (daemon/prompt_check.py) has set this job's `checked`."""

    job: Job


@dataclass(frozen=True)
class StopCmd:
    at: float


@dataclass(eq=False)
class Job:
    """One generate request, from the queue to its `done` event."""

    peer: bytes
    msg: proto.Generate
    received: float
    prompt_ids: list[int] = field(default_factory=list)
    # The prompt checker's outcome (daemon/prompt_check.py `Checked`); None until then.
    checked: Checked | None = None
    gen: Iterator[tuple[str, int | None]] | None = None
    result: GenerationResult | None = None
    started: float | None = None
    stop_reason: str | None = None  # cancelled | disconnected | shutdown
    stop_requested_at: float | None = None
    # (prompt tokens prefilled, of how many) until the first token; None before and after.
    prefill: tuple[int, int] | None = None
    # The upper estimate of its KV cache (prompt + max_tokens), once its prompt is encoded.
    kv_bytes: int = 0
    # When the last few tokens were made, to count those made after a stop was asked.
    token_times: deque = field(default_factory=lambda: deque(maxlen=8))
    # When its prefill began and each of its last pieces (a layer, or a chunk) ended, to
    # count the pieces begun after a stop was asked (none: a stop takes effect at the end
    # of the piece in flight).
    piece_times: deque = field(default_factory=lambda: deque(maxlen=64))
    # A request with tools: its answer's text split into text and parsed tool calls.
    tools: ToolCallSplitter | None = None
    # A chat with a thinking model: its text split into reasoning and answer (daemon/model/reasoning.py).
    reasoning: ReasoningSplitter | None = None
    # Of the result's log-probabilities (a request that asked), those sent in token events.
    logprobs_sent: int = 0
    # Why it has waited in the queue ("batch", "memory"), each counted once in `status`.
    waited: set[str] = field(default_factory=set)
    # The elastic pool's resizes before it started: its stats count those while it ran.
    resizes_before: int = 0
    # Decoding alone, in turns with the batch: joining it measured no faster (`_batch_full`).
    in_turns: bool = False

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.peer, self.msg.id)

    @property
    def client(self) -> str:
        """The client it counts against in the shares of queue and slots: the one the
        request names (the gateway's caller), else its connection."""
        return f"key {self.msg.client_key}" if self.msg.client_key is not None else f"peer {self.peer.hex()}"

    def decodes_alone(self) -> bool:
        """Whether it decodes on its own, outside the batch: speculative, constrained
        (daemon/model/generation.py `iter_generate`), or where joining the batch would
        not pay (`in_turns`)."""
        checked = self.checked
        return (
            self.in_turns
            or self.msg.speculates()
            or (checked is not None and (checked.grammar is not None or checked.images is not None))
        )

    def tokens_after_stop(self) -> int:
        if self.stop_requested_at is None:
            return 0
        return sum(1 for t in self.token_times if t > self.stop_requested_at)

    def pieces_after_stop(self) -> int:
        """Prefill pieces begun (their previous one ended) after the stop was asked."""
        if self.stop_requested_at is None:
            return 0
        return sum(1 for t in list(self.piece_times)[:-1] if t > self.stop_requested_at)


class EngineLoop:
    """`run()` serves until stopped; `submit`/`cancel`/`peer_gone`/`stop` may be called
    from any thread."""

    def __init__(
        self,
        settings: Settings,
        ctx: zmq.Context,
        events_endpoint: str,
        log: logging.Logger,
        *,
        file_limit: FileLimit | None = None,
        share: ExpertShare | None = None,
    ) -> None:
        """`share`: rank 0's share of an expert-parallel group (daemon/model/expert_parallel.py):
        the model is loaded on it, the other ranks follow its forwards; else None."""
        self.settings = settings
        self._file_limit = file_limit
        self._share = share
        self.log = log
        self._ctx = ctx
        self._events_endpoint = events_endpoint
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = threading.Event()
        self._events: zmq.Socket | None = None
        # Held around every send on `_events`: the prompt checker's thread sends `accepted`
        # on it too, so that it leaves at once (while a long prefill runs here) and in
        # order with the request's later events.
        self._send_lock = threading.Lock()
        self._sm: StreamingModel | None = None
        # Continuous batching (daemon/model/batching.py) unless max_batch is 1, else None.
        self._batch: BatchSession | None = None
        # The prompt cache (daemon/model/prompt_cache.py) where prompt_cache_bytes > 0, else None.
        self._prompt_cache: PromptCache | None = None
        # This process's heat (daemon/heat.py): rank 0's own experts' in a group.
        self._heat = Heat(settings, log, share)
        self._checker: PromptChecker | None = None
        # A request's context, found at load (daemon/pool/capacity.py `ContextLimit`).
        self._context: ContextLimit | None = None
        # The served manifest's stat when it was loaded: `status` compares it with the file's now.
        self._store_stamp: ManifestStamp | None = None
        # The served store's path, id and stamp, kept in `status` while the model is unloaded.
        self._identity: dict[str, Any] = {}
        self._pending: deque[Job] = deque()
        # count_tokens requests waiting for a model to be loaded (daemon/prompt_check.py answers them).
        self._counts: list[CountRequest] = []
        # Load requests, answered at the end of the loop's turn (once loaded, or unloaded).
        self._loads: list[LoadCmd] = []
        self._active: deque[Job] = deque()
        # The job stepped last, at the end of `_active` until the next step: a job started
        # meanwhile goes before it (a long prompt's prefill yields after each piece, and a
        # request that arrived during one takes its turn before the next).
        self._last_stepped: Job | None = None
        self._jobs: dict[tuple[bytes, str], Job] = {}
        # Peers whose reply queues are full: their requests wait, unstepped (PeerPaused).
        self._paused: set[bytes] = set()
        # When each client with requests last started one (a count of starts): of clients
        # with as many running, the one that started one longest ago goes first.
        self._started_at: dict[str, int] = {}
        self._starts = 0
        self._recent: deque[RecentRequest] = deque(maxlen=RECENT_REQUESTS)
        # By how requests ended, and those that waited in the queue for room in the batch, or
        # under the memory budget (shared/status.py `RequestCounters`).
        self._counters = dict.fromkeys((f.name for f in fields(RequestCounters)), 0)
        self._stopping = False
        self._prefetch_logged = False
        self._last_snapshot = 0.0
        self._keep_alive = KeepAlive(settings.keep_alive)
        # The pool's size under the machine's memory pressure (daemon/pool/elastic.py),
        # resized at this loop's turns, between steps.
        self._elastic = ElasticPool(pressure_source(settings.memory_pressure), log.getChild("elastic"))
        self.state = "loading"
        self.error: str | None = None
        # Replaced whole (never mutated) so the I/O thread can read it without a lock.
        self.snapshot = Snapshot(
            time.monotonic(),
            Status(state="loading", model=settings.model, policy=settings.policy),
            Stats(state="loading"),
            None,
            None,
        )

    # ---- called from the I/O thread ------------------------------------------------

    def submit(self, peer: bytes, msg: proto.Generate) -> None:
        self._commands.put(Submit(peer, msg))

    def count(self, peer: bytes, msg: proto.CountTokens) -> None:
        """A count_tokens request: straight to the prompt checker's thread, which answers
        it, never waiting on the engine; through the engine's queue only while there is no
        checker (the model unloaded or loading), which then loads the model for it."""
        checker = self._checker  # one read: the engine thread may replace it meanwhile
        request = CountRequest(peer, msg)
        if checker is None or not checker.count(request):
            self._commands.put(request)

    def cancel(self, peer: bytes, msg: proto.Cancel) -> None:
        self._commands.put(CancelCmd(peer, msg, time.monotonic()))

    def load(self, peer: bytes, msg: proto.Load) -> None:
        self._commands.put(LoadCmd(peer, msg))

    def peer_gone(self, peer: bytes) -> None:
        self._commands.put(PeerGone(peer, time.monotonic()))

    def peer_paused(self, peer: bytes, paused: bool) -> None:
        self._commands.put(PeerPaused(peer, paused))

    def stop(self) -> None:
        self._commands.put(StopCmd(time.monotonic()))

    # ---- the engine's own thread ----------------------------------------------------

    def run(self) -> None:
        """Load the model and serve until `stop()`; always ends with the exit frame."""
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.setsockopt(zmq.LINGER, 0)
        # Never block the model on the I/O thread; events are bounded by tokens made.
        self._events.setsockopt(zmq.SNDHWM, 0)
        self._events.connect(self._events_endpoint)
        try:
            if self._load():
                self._loop()
        except Exception as e:  # reported to the I/O thread; the process exits non-zero
            self.log.exception("the engine failed")
            self.state = "failed"
            self.error = f"{type(e).__name__}: {e}"
        finally:
            try:
                for job in list(self._active) + list(self._pending):
                    self._request_stop(job, "shutdown", time.monotonic())
                self._reject_waiting()
                self._publish(force=True)
            finally:
                try:
                    self._close_model()
                    # Counts the checker had not answered when it closed.
                    why = self.error or "the daemon is shutting down"
                    self._fail_counts(proto.SHUTTING_DOWN, why)
                    for cmd in self._loads:
                        self._send(cmd.peer, proto.Error(cmd.msg.id, proto.SHUTTING_DOWN, why))
                finally:
                    with self._send_lock:
                        self._events.send_multipart([b"", EXIT_FRAME])
                        self._events.close(linger=0)
                        self._events = None
                    self.finished.set()

    def _load(self) -> bool:
        tic = time.perf_counter()
        if not self._load_model():
            return False
        if self._share is not None:
            self.log.info("expert-parallel: waiting for the other %d ranks to load their shares", self._share.size - 1)
            self._share.barrier()
        self._heat.pin(self._sm)
        self._heat.start(self._sm)
        self._ready(time.perf_counter() - tic)
        return True

    def _ready(self, seconds: float) -> None:
        """Serve: the snapshot of the loaded model first, then the state, which `status`
        reads live, so that a client told "ready" finds the model's figures there too (an
        expert-parallel snapshot gathers every rank's, which takes a while)."""
        self._publish(force=True, state="ready")
        self.state = "ready"
        self.log.info(
            "model ready in %.2f s: %d MoE layers, %d %s per layer, policy %s",
            seconds,
            len(self._sm.pools),
            self._sm.capacity,
            "experts in GPU memory (mapped pool)" if self._sm.mapped_pool is not None else "slots",
            self.settings.policy,
        )

    def _load_model(self) -> bool:
        """The model, its pool and its batch session; False (state failed) when it cannot load."""
        from ..shared.store_format import manifest_stamp
        from .model.streaming_model import load_streaming_model

        if self._file_limit is not None:
            self._file_limit.raise_soft(self.log)  # importing mlx-lm (just now) lowered it
        s = self.settings
        if s.model is None:
            self.state, self.error = "failed", "no model: give --model STORE (made by `moestreamctl convert`)"
            self.log.error(self.error)
            return False
        self.log.info(
            "loading %s (capacity %s, memory budget %s, policy %s, mapped %s)",
            s.model,
            s.capacity,
            s.memory_budget,
            s.policy,
            "auto" if s.mapped is None else s.mapped,
        )
        try:
            # Before the load reads it, so a manifest replaced meanwhile differs from this.
            self._store_stamp = manifest_stamp(s.model)
        except OSError:
            self._store_stamp = None  # the load says what is wrong
        try:
            self._sm = load_streaming_model(s.model, s, max_tokens=None, share=self._share)
        except Exception as e:
            self.state, self.error = "failed", f"cannot load the model {s.model}: {e}"
            self.log.error(self.error)
            return False
        # Not in an expert-parallel group: its other ranks follow rank 0's MoE layers
        # (daemon/model/expert_parallel.py), and the batch's probe, a forward of rank 0's
        # at load, left them waiting (tests/test_expert_parallel.py): its requests take turns.
        if s.max_batch != 1 and self._share is None:
            from .model.batching import BatchSession

            self._batch = BatchSession(self._sm, s.max_batch)
            if self._batch.max_batch < self._batch.requested:
                self.log.info(
                    "batch: at most %d requests at once (max_batch %d): a step's experts must fit the pool",
                    self._batch.max_batch,
                    self._batch.requested,
                )
        self._start_prompt_cache()
        self._elastic.attach(self._sm)
        tok = self._sm.tokenizer
        self._identity = {
            "model": str(self._sm.store_dir),
            "store_id": self._sm.manifest.store_id,
            "store_stamp": self._store_stamp,
            # What the gateway's model listings say the model takes.
            "capabilities": {
                "chat": bool(tok.has_chat_template),
                "tools": bool(tok.has_tool_calling),
                "thinking": bool(tok.has_thinking),
                "vision": self._sm.vision is not None,
            },
        }

        from .prompt_check import PromptChecker

        self._context = self._context_limit()
        self.log.info(
            "context: %d tokens per request (%s; KV %s per token, %s left for KV caches of %s)",
            self._context.tokens,
            self._context.bound,
            format_size(self._context.kv_bytes_per_token),
            "?" if self._context.kv_room_bytes is None else format_size(self._context.kv_room_bytes),
            self._context.memory,
        )
        self._checker = PromptChecker(
            self._sm,
            self._context.tokens,
            lambda job: self._commands.put(CheckDone(job)),
            self.log,
            on_accepted=self._accepted,
            events=(self._ctx, self._events_endpoint),
        )
        for job in self._pending:  # those that arrived while the model was unloaded
            if job.checked is None:
                self._checker.submit(job)
        counts, self._counts = self._counts, []
        for request in counts:
            self._checker.count(request)
        if "mapped_auto" in self._sm.admission_note:
            self.log.info("mapped pool (auto): %s", self._sm.admission_note["mapped_auto"])
        return True

    def _start_prompt_cache(self) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        from .model.prompt_cache import PromptCache, cache_identity

        s = self.settings
        if s.prompt_cache_bytes <= 0 or s.prompt_cache_entries <= 0:
            return
        self._prompt_cache = PromptCache(
            cache_identity(self._sm.store_dir, self._sm.manifest.store_id),
            [type(c).__name__ for c in make_prompt_cache(self._sm.model)],
            max_bytes=s.prompt_cache_bytes,
            max_entries=s.prompt_cache_entries,
            disk_dir=s.prompt_cache_dir,
            disk_bytes=s.prompt_cache_disk_bytes,
            write_budget=s.prompt_cache_write_budget,
            log=self.log.getChild("prompt_cache"),
        )

    def _loop(self) -> None:
        while True:
            idle = not self._active and not self._pending
            if idle and self._prompt_cache is not None:
                # Off every request's path: finished caches go to the disk writer now.
                self._prompt_cache.idle()
            # Queued requests held while the elastic pool refuses wait for a command or the
            # next poll, as do those of clients that read nothing (paused).
            steppable = any(j.peer not in self._paused for j in self._active)
            startable = not self._elastic.refusing and any(
                j.checked is not None and j.peer not in self._paused for j in self._pending
            )
            self._drain(block=not steppable and not startable)
            if self._stopping:
                return
            loads = any(cmd.msg.keep_alive != 0 for cmd in self._loads)
            if (self._pending or self._counts or loads) and self._sm is None:
                self._reload()
            self._elastic_tick()
            self._activate_pending()
            # The next in turn whose client reads its replies; the job stays in the active
            # set while it steps, so that a status published meanwhile (a long prompt's
            # prefill) shows it.
            job = next((j for j in self._active if j.peer not in self._paused), None)
            if job is not None and self._step(job):
                self._active.remove(job)
                self._active.append(job)
                self._last_stepped = job
            self._publish()
            self._heat.tick(self._sm)
            self._idle_check()
            self._answer_loads()

    def _elastic_tick(self) -> None:
        """Between two steps (no forward in flight on the host): resize the pool where
        the machine's memory pressure says so (daemon/pool/elastic.py)."""
        try:
            resized = self._elastic.tick()
        except Exception:  # the pool stays as it is, and is resized again at the next poll
            self.log.exception("elastic pool: the resize failed")
            return
        if resized is not None:
            self._publish(force=True)

    def _drain(self, *, block: bool) -> None:
        """Apply every waiting command; wait for one (a while) when there is no work."""
        timeout = min(SNAPSHOT_SECONDS * 5, max(self.settings.heat_flush_seconds, 0.05))
        if self._elastic.watching:
            timeout = min(timeout, self._elastic.poll_seconds)  # an idle daemon reads the pressure as often
        while True:
            try:
                cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(cmd, Submit):
                self._on_submit(cmd)
            elif isinstance(cmd, CancelCmd):
                self._on_cancel(cmd)
            elif isinstance(cmd, CountRequest):
                if self._checker is None or not self._checker.count(cmd):
                    self._counts.append(cmd)  # the next load serves it
            elif isinstance(cmd, LoadCmd):
                # Its keep_alive counts from now, as a request's does; 0: the idle check
                # of this turn releases the model, once nothing is in flight.
                self._keep_alive.request(cmd.msg.keep_alive)
                self._loads.append(cmd)
            elif isinstance(cmd, PeerGone):
                self._paused.discard(cmd.peer)
                for job in [j for j in self._jobs.values() if j.peer == cmd.peer]:
                    self._request_stop(job, "disconnected", cmd.at)
            elif isinstance(cmd, PeerPaused):
                if cmd.paused:
                    self._paused.add(cmd.peer)
                else:
                    self._paused.discard(cmd.peer)
            elif isinstance(cmd, StopCmd):
                self._stopping = True
                self.state = "stopping"
                return

    def _on_submit(self, cmd: Submit) -> None:
        msg = cmd.msg
        if (cmd.peer, msg.id) in self._jobs:
            self._send(cmd.peer, proto.Error(msg.id, proto.DUPLICATE_ID, f"request id {msg.id!r} is already in flight"))
            return
        s = self.settings
        job = Job(cmd.peer, msg, time.monotonic())
        mine = sum(1 for j in self._jobs.values() if j.client == job.client)
        # One client's share: every active slot and a quarter of the queue, so others are never all busy.
        share = s.max_active + max(s.max_queued // 4, 1)
        if len(self._jobs) >= s.max_active + s.max_queued or mine >= share:
            self._counters["busy"] += 1
            why = (
                f"this client has {mine} requests queued or running (its share: a quarter of max_queued)"
                if mine >= share
                else f"the daemon has {len(self._pending)} requests waiting (max_queued)"
            )
            self._send(cmd.peer, proto.Error(msg.id, proto.BUSY, f"{why}; try again later"))
            return
        if self._elastic.refusing and self._sm is not None:
            self._send(cmd.peer, proto.Error(msg.id, proto.MEMORY_PRESSURE, self._elastic.refuse()))
            self._publish(force=True)
            return
        self._keep_alive.request(msg.keep_alive)
        self._jobs[job.key] = job
        self._pending.append(job)
        self._counters["requests"] += 1
        if self._checker is not None:  # else the next load checks it
            self._checker.submit(job)

    def _on_cancel(self, cmd: CancelCmd) -> None:
        job = self._jobs.get((cmd.peer, cmd.msg.target))
        self._send(cmd.peer, proto.Cancelled(cmd.msg.id, cmd.msg.target, job is not None))
        if job is not None:
            self._request_stop(job, "cancelled", cmd.at)

    def _request_stop(self, job: Job, reason: str, at: float) -> None:
        # The stop takes effect now, not at the job's next turn: no further token is made.
        if job.stop_reason is None:
            job.stop_reason, job.stop_requested_at = reason, at
        if job in self._pending:
            self._pending.remove(job)
            self._finish(job)
        elif job in self._active:
            self._active.remove(job)
            self._end_generator(job)
            self._finish(job)

    def _activate_pending(self) -> None:
        """Move waiting requests whose prompts are checked into the active set, the client
        with the fewest active requests first. A request that would not fit the batch, or
        whose KV cache would pass the memory budget, waits in the queue (`status` says why)."""
        from .model.generation import GenerationResult, SamplingParams
        from .model.reasoning import reasoning_splitter
        from .model.tool_calls import splitter_for

        while not self._elastic.refusing:
            job = self._next_checked()
            if job is None or not self._has_slot(job):
                return
            msg, checked = job.msg, job.checked
            if checked.ids is None:
                self._pending.remove(job)
                self._fail(job, checked.code, checked.message)
                continue
            if self._batch_full(job):
                self._count_wait(job, "batch")
                return
            if self._kv_full(job) is not None:
                self._count_wait(job, "memory")
                return
            self._pending.remove(job)
            self._starts += 1
            self._started_at[job.client] = self._starts
            job.prompt_ids = checked.ids
            job.tools = splitter_for(self._sm.tokenizer, msg.tools, msg.tool_choice)
            job.reasoning = reasoning_splitter(self._sm.tokenizer, checked.opens_thinking)
            params = SamplingParams(
                max_tokens=checked.max_tokens,
                temp=msg.temp,
                top_p=msg.top_p,
                top_k=msg.top_k or 0,
                seed=msg.seed,
                controls=msg.sampling or proto.SamplingControls(),
                stop=msg.stop,
                speculative=msg.speculative,
                draft_tokens=msg.draft_tokens or 2,
                draft_model=msg.draft_model,
                diagnostics=bool(msg.diagnostics),
                turn_end=self._sm.turn_end() if msg.messages is not None else None,
            )
            job.result = GenerationResult()
            job.resizes_before = self._elastic.resizes
            job.gen = self._make_generator(job, params)
            if self._active and self._active[-1] is self._last_stepped:
                self._active.insert(len(self._active) - 1, job)
            else:
                self._active.append(job)

    def _has_slot(self, job: Job) -> bool:
        """Whether `job` may start: below max_active, or, while another client holds
        several of the slots, one past it for a client with none running (at most a
        quarter of max_active past it): one client's long answers hold no other client
        off until they end (the KV budget and the batch's room still apply)."""
        n = self.settings.max_active
        if len(self._active) < n:
            return True
        if len(self._active) >= n + n // OVERFLOW_SHARE:
            return False
        running = [j.client for j in self._active]
        return job.client not in running and any(running.count(c) > 1 for c in running)

    def _count_wait(self, job: Job, why: str) -> None:
        if why not in job.waited:
            job.waited.add(why)
            self._counters[f"waited_for_{why}"] += 1

    def _batch_full(self, job: Job) -> bool:
        """Whether `job` would decode in the batch (not speculative) and it has no room:
        it then waits in the queue, where `status` says why, rather than in a step."""
        if self._batch is None or job.decodes_alone():
            return False
        active = sum(not j.decodes_alone() for j in self._active)
        if self._batch.has_room(active) and self._batch.pays(active):
            return False
        if not self._batch.auto:
            return True  # max_batch as set: it waits for room
        # The daemon's own batch size: the batch is full (its cap where the pool is
        # partial) or its steps say one more member would make tokens no faster: it decodes
        # alone, in turns with the batch's steps, as every request does with max_batch 1.
        job.in_turns = True
        self._counters["decoded_in_turns"] += 1
        return False

    def _kv_allowance(self) -> int | None:
        """The bytes the KV caches of the active requests may take under `memory_budget`
        (what the resident weights, the pool, a long prompt's transient stack and the
        prompt cache's bound leave;
        the pool was sized to leave at least one `max_context` cache), or None without
        a budget."""
        budget, sm = self.settings.memory_budget, self._sm
        if budget is None or sm is None:
            return None
        return budget - self._memory_held()

    def _memory_held(self) -> int:
        from .pool.capacity import memory_held

        sm = self._sm
        # The pool at the size it was made with: what an elastic pool gave back under memory
        # pressure is the system's, not room for more KV caches.
        pool_bytes = max(sm.pool_bytes, self._elastic.made_pool_bytes())
        return memory_held(sm.manifest, sm.resident_bytes, pool_bytes, sm.capacity, self.settings.prompt_cache_bytes)

    def _context_limit(self) -> ContextLimit:
        """A request's context (daemon/pool/capacity.py `context_limit`): `max_context`,
        else the model's own, at most what the memory budget (else the device's memory)
        leaves for KV caches."""
        from .pool.capacity import context_limit, device_memory

        s = self.settings
        return context_limit(
            self._sm.manifest.config, s.max_context, s.memory_budget, device_memory(), self._memory_held()
        )

    def _kv_full(self, job: Job) -> str | None:
        """Why `job` (its prompt checked) cannot start beside the active requests: their
        KV caches and its own would pass the memory budget; None where it can. A request
        alone always starts (its context was checked against max_context)."""
        if not job.kv_bytes:
            from .pool.capacity import kv_cache_bytes

            # Kept on the job: once it runs, the next request's check counts it.
            job.kv_bytes = kv_cache_bytes(self._sm.manifest.config, len(job.checked.ids) + job.checked.max_tokens)
        allowance = self._kv_allowance()
        if allowance is None or not self._active:
            return None
        held = sum(j.kv_bytes for j in self._active)
        if held + job.kv_bytes <= allowance:
            return None
        return (
            f"the KV caches would pass the memory budget: {format_size(held)} held by {len(self._active)} "
            f"request(s) + {format_size(job.kv_bytes)} for the next > {format_size(allowance)}"
        )

    def _next_checked(self) -> Job | None:
        """The queued request to start next: of those whose prompts are checked (and
        whose clients read their replies), the oldest of the client with the fewest
        requests running, and of clients with as many, the one that started one longest
        ago (a client that has waited goes before one just served); None while none is."""
        ready = [j for j in self._pending if j.checked is not None and j.peer not in self._paused]
        if not ready:
            return None
        running = [j.client for j in self._active]
        return min(ready, key=lambda j: (running.count(j.client), self._started_at.get(j.client, 0)))

    def _why_queued(self) -> str | None:
        """Why the next queued request has not started, for `status`."""
        if not self._pending:
            return None
        job = self._next_checked()
        if len(self._active) >= self.settings.max_active and (job is None or not self._has_slot(job)):
            return f"{len(self._active)} requests decode at once (max_active {self.settings.max_active})"
        if self._elastic.refusing:
            return self._elastic.why_refused()
        if job is None:
            return "its prompt is being checked (tokenized, its length against max_context)"
        if job.checked.ids is None:
            return None
        if self._batch_full(job):
            return self._batch.why_full()
        return self._kv_full(job)

    def _make_generator(self, job: Job, params: SamplingParams) -> Iterator[tuple[str, int | None]]:
        from .model.generation import iter_generate

        return iter_generate(
            self._sm,
            job.prompt_ids,
            params,
            job.result,
            should_stop=lambda: job.stop_reason is not None,
            on_prompt_progress=lambda done, total: self._on_prefill(job, done, total),
            batch=None if job.in_turns else self._batch,
            prompt_cache=self._prompt_cache,
            cache_scope=job.msg.cache_scope or "",
            grammar=job.checked.grammar,
            images=job.checked.images,
        )

    def _on_prefill(self, job: Job, done: int, total: int) -> None:
        """Called between prefill pieces, inside the request's step: `status` and a client
        that asked for progress see how far a long prompt has come."""
        job.piece_times.append(time.monotonic())
        started = job.prefill is None  # its first call: from 0, or from a cached prefix
        job.prefill = (done, total) if done < total else None
        if job.msg.progress:
            self._send(job.peer, proto.Progress(job.msg.id, done, total))
        # A snapshot at each of a prefill's layers cost about 1.8 ms each on the H200
        # (a 48-layer model: 0.09 s a prompt, a third of a cached chat turn): between
        # its start and end the prefill's progress is published at the usual rate.
        self._publish(force=started or job.prefill is None)

    def _step(self, job: Job) -> bool:
        """Advance one request by one step; False once it has ended."""
        from .pool.expert_reader import ExpertReadError

        if job.started is None:
            job.started = time.monotonic()
        try:
            segment, token = next(job.gen)
        except StopIteration:
            job.gen = None
            self._finish(job)
            return False
        except ExpertReadError as e:
            self.log.error("request %s: %s", job.msg.id, e)
            self._fail(job, proto.ENGINE, str(e))
            return False
        except Exception as e:  # this request fails with the reason; the daemon serves on
            self.log.exception("request %s failed", job.msg.id)
            self._fail(job, proto.INTERNAL, f"{type(e).__name__}: {e}")
            return False
        if token is None:
            return True  # a piece of its prompt, prefilled between the batch's steps
        job.token_times.append(time.monotonic())
        self._emit(job, segment, token)
        return True

    def _emit(self, job: Job, segment: str, token: int) -> None:
        """A step's text as token events: reasoning apart from the answer, and the answer's
        tool calls parsed out. Every token still gets an event (empty while a marker's or
        a call's text is held), so a client's cancel is answered within a token."""
        pieces = job.reasoning.feed(segment) if job.reasoning is not None else [(False, segment)]
        sent = False
        for thinking, text in pieces:
            if not thinking and job.tools is not None:
                text, calls = job.tools.feed(text)
                self._send_calls(job, calls)
            if text:
                lp = self._new_logprobs(job)
                self._send(job.peer, proto.Token(job.msg.id, text, token, True if thinking else None, lp))
                sent = True
        if not sent:
            self._send(job.peer, proto.Token(job.msg.id, "", token, logprobs=self._new_logprobs(job)))

    @staticmethod
    def _new_logprobs(job: Job) -> tuple[proto.TokenLogprob, ...] | None:
        """The log-probabilities of the tokens made since the last event that carried
        them (None where the request did not ask, or none is new)."""
        made = job.result.logprobs if job.result is not None else []
        if len(made) <= job.logprobs_sent:
            return None
        new = tuple(made[job.logprobs_sent :])
        job.logprobs_sent = len(made)
        return new

    def _send_calls(self, job: Job, calls: list[dict[str, str]]) -> None:
        first = len(job.tools.calls) - len(calls)
        for i, call in enumerate(calls, first):
            self._send(job.peer, proto.ToolCall(job.msg.id, i, call["name"], call["arguments"], call.get("text")))

    def _end_generator(self, job: Job) -> None:
        """Let a started generator see its stop flag and fill in its statistics."""
        if job.gen is None or job.started is None:
            return
        end = object()
        try:
            # The generator resumes after its last yield, sees `should_stop` and returns
            # without computing another token.
            if next(job.gen, end) is not end:
                self.log.error("request %s: the generator went on after a stop", job.msg.id)
        except Exception:
            self.log.exception("request %s: failed while stopping", job.msg.id)
        job.gen = None

    def _finish(self, job: Job) -> None:
        reason = job.stop_reason or (job.result.finish_reason if job.result is not None else "cancelled")
        result = job.result
        text, tokens = (result.text, list(result.tokens)) if result is not None else ("", [])
        stats = replace(
            result.stats if result is not None else RequestStats(),
            finish_reason=reason,
            queued_seconds=(job.started or time.monotonic()) - job.received,
            prefill_pieces_after_stop=job.pieces_after_stop() if job.stop_reason is not None else None,
            # Resizes of the pool under memory pressure while it ran (daemon/pool/elastic.py).
            pool_resizes=self._elastic.resizes - job.resizes_before if result is not None else None,
        )
        calls: list[dict[str, str]] = []
        reasoning = ""
        if job.reasoning is not None:
            # As for tool calls below: the rest the generator kept back, then held text.
            job.reasoning.feed(text[job.reasoning.fed :])
            job.reasoning.finish()
            text, reasoning = job.reasoning.answer_text, job.reasoning.reasoning_text
        if job.tools is not None:
            # What the generator kept back (a possible stop string when the answer ended)
            # is the rest of the text; then held text and a call left open.
            _, tail = job.tools.feed(text[job.tools.fed :])
            _, last = job.tools.finish()
            if reason != "disconnected":
                self._send_calls(job, tail + last)
            text, calls = job.tools.content, list(job.tools.calls)
        self._forget(job)
        counter = {"cancelled": "cancelled", "disconnected": "disconnected", "shutdown": "cancelled"}.get(
            reason, "completed"
        )
        self._counters[counter] += 1
        self._counters["tokens"] += len(tokens)
        self._remember(job, reason, len(tokens), stats if result is not None else None)
        # Publish first, so a client that asks for status on its done event sees this request.
        self._publish(force=True)
        if reason != "disconnected":
            asked = job.msg.sampling is not None and job.msg.sampling.logprobs is not None
            lp = tuple(result.logprobs) if asked and result is not None else None
            self._send(job.peer, proto.Done(job.msg.id, text, tokens, reason, stats, calls, reasoning, lp))
        self._heat.push(self._sm)
        self._log_prefetch_decision()

    def _log_prefetch_decision(self) -> None:
        """Say once what `prefetch = auto` decided (it is in `stats` too)."""
        pf = self._sm.prefetcher if self._sm is not None else None
        if self._prefetch_logged or pf is None or pf.governor is None or not pf.governor.decided:
            return
        self._prefetch_logged = True
        self.log.info("prefetch auto: %s", pf.governor.reason)

    def _fail(self, job: Job, code: str, message: str) -> None:
        self._forget(job)
        self._counters["failed"] += 1
        self._remember(job, f"error:{code}", len(job.result.tokens) if job.result is not None else 0)
        self._send(job.peer, proto.Error(job.msg.id, code, message))
        self._publish(force=True)

    def _forget(self, job: Job) -> None:
        self._jobs.pop(job.key, None)
        if job in self._active:
            self._active.remove(job)
        if job.client in self._started_at and not any(j.client == job.client for j in self._jobs.values()):
            del self._started_at[job.client]

    def _remember(self, job: Job, reason: str, tokens: int, stats: RequestStats | None = None) -> None:
        self._recent.append(
            RecentRequest(
                id=job.msg.id,
                finish_reason=reason,
                tokens=tokens,
                tokens_after_stop=job.tokens_after_stop(),
                prefill_pieces_after_stop=job.pieces_after_stop(),
                seconds=time.monotonic() - job.received,
                prompt_tokens=stats.prompt_tokens if stats is not None else None,
                cached_tokens=stats.cached_tokens if stats is not None else None,
                prompt_seconds=stats.prompt_seconds if stats is not None else None,
            )
        )

    def _reject_waiting(self) -> None:
        """Answer the commands nobody will serve now (sent while loading or stopping)."""
        why = self.error or "the daemon is shutting down"
        code = proto.ENGINE if self.state == "failed" else proto.SHUTTING_DOWN
        self._fail_counts(code, why)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (Submit, CountRequest)):
                self._send(cmd.peer, proto.Error(cmd.msg.id, code, why))
            elif isinstance(cmd, CancelCmd):
                self._send(cmd.peer, proto.Cancelled(cmd.msg.id, cmd.msg.target, False))

    def _fail_counts(self, code: str, why: str) -> None:
        """Answer the count_tokens requests waiting for a model that will not come."""
        counts, self._counts = self._counts, []
        for request in counts:
            self._send(request.peer, proto.Error(request.msg.id, code, why))

    def _send(self, peer: bytes, message: proto.Reply) -> None:
        data = proto.encode(message)
        with self._send_lock:
            self._events.send_multipart([peer, data], copy=False)

    def _accepted(self, job: Job) -> None:
        """On the prompt checker's thread, once `job`'s prompt has passed its checks: its
        `accepted` event, sent now, whatever the engine is computing. Under the send lock,
        so a job stopped meanwhile (its `done` sent) gets none after it."""
        data = proto.encode(proto.Accepted(job.msg.id, len(job.checked.ids)))
        with self._send_lock:
            if self._events is not None and job.stop_reason is None:
                self._events.send_multipart([job.peer, data], copy=False)

    # ---- keep-alive: idle unload and the load again --------------------------------------

    def _idle_check(self) -> None:
        """With nothing in flight, release the model once `keep_alive` has run out."""
        if self._jobs or self._sm is None:
            return
        now = time.monotonic()
        self._keep_alive.idle(now)
        if self._keep_alive.due(now):
            self._unload()

    def _answer_loads(self) -> None:
        """Answer the load requests of this turn: the model is loaded now (or failed to
        load), or released by the idle check just run (keep_alive 0, nothing in flight)."""
        loads, self._loads = self._loads, []
        for cmd in loads:
            if self._sm is None and cmd.msg.keep_alive != 0:
                why = self.error or "the model could not be loaded"
                self._send(cmd.peer, proto.Error(cmd.msg.id, proto.ENGINE, why))
            else:
                self._send(cmd.peer, proto.LoadReply(cmd.msg.id, self.state, len(self._jobs)))

    def _unload(self) -> None:
        """Release the model, its pool, host tier, reader and MLX's caches; the socket, the
        heat keeper and the idle clock stay. The heat is flushed first, so that the next
        load's autopin pins from every count up to now."""
        import mlx.core as mx
        import psutil

        stats = self._keep_alive.stats
        me = psutil.Process()
        stats.rss_before_bytes, stats.mlx_active_before_bytes = me.memory_info().rss, mx.get_active_memory()
        if not self._heat.flush(self._sm):
            self.log.error("heat: the flush before unloading did not complete; the next load pins from older counts")
        try:
            self._release_model()
        finally:
            gc.collect()  # the model's modules hold reference cycles; their arrays go with them
            mx.clear_cache()
            trim_heap()
            self._keep_alive.unloaded(time.monotonic())
            stats.rss_after_bytes, stats.mlx_active_after_bytes = me.memory_info().rss, mx.get_active_memory()
            self.state = "unloaded"
            self.log.info(
                "unloaded after %.0f s idle (keep_alive %s s): RSS %.1f -> %.1f MB, MLX active %.1f -> %.1f MB",
                time.monotonic() - (self._keep_alive.idle_since or time.monotonic()),
                self._keep_alive.seconds,
                stats.rss_before_bytes / 1e6,
                stats.rss_after_bytes / 1e6,
                stats.mlx_active_before_bytes / 1e6,
                stats.mlx_active_after_bytes / 1e6,
            )
            self._publish(force=True)

    def _release_model(self) -> None:
        prompt_cache, batch, sm, checker = self._prompt_cache, self._batch, self._sm, self._checker
        self._prompt_cache = self._batch = self._sm = self._checker = None
        self._elastic.detach()
        try:
            if checker is not None:
                # Its thread holds the model (the tokenizer, the store); the counts it had
                # not answered wait for the next load.
                self._counts += checker.close()
            if prompt_cache is not None:
                prompt_cache.close()  # what it keeps on disk stays, for the next load
            if batch is not None:
                batch.close()
        finally:
            if sm is not None:
                sm.close()

    def _reload(self) -> None:
        """Load the model again for the requests waiting; each that asked for progress sees
        the load's steps. A load that fails fails them, and the next request tries again."""
        steps = 2  # the model and its pool; the pins from the heat
        self.state = "loading"
        self._load_progress(0, steps)
        tic = time.perf_counter()
        if not self._load_model():
            why = self.error or "the model could not be loaded"
            self.state = "unloaded"
            for job in list(self._pending):
                self._pending.remove(job)
                self._fail(job, proto.ENGINE, why)
            self._fail_counts(proto.ENGINE, why)
            return
        self.error = None
        self._load_progress(1, steps)
        self._heat.pin(self._sm)
        self._load_progress(steps, steps)
        self._keep_alive.loaded(time.perf_counter() - tic)
        self._ready(time.perf_counter() - tic)

    def _load_progress(self, done: int, total: int) -> None:
        for job in self._pending:
            if job.msg.progress:
                self._send(job.peer, proto.Progress(job.msg.id, done, total, stage="load"))
        self._publish(force=True)

    # ---- status ----------------------------------------------------------------------

    def _publish(self, *, force: bool = False, state: str | None = None) -> None:
        """The snapshot `status` and `stats` read; `state`: the one it records, where not yet the engine's."""
        now = time.monotonic()
        if not force and now - self._last_snapshot < SNAPSHOT_SECONDS:
            return
        self._last_snapshot = now
        sm = self._sm
        totals = RequestTotals(
            queued=len(self._pending),
            why_queued=self._why_queued(),
            clients=len({j.peer for j in self._jobs.values()}),
            **self._counters,
        )
        status = Status(
            state=state or self.state,
            error=self.error,
            # Unloaded, which store it serves stays known (clients check it by its id).
            model=self._identity.get("model", self.settings.model),
            store_id=self._identity.get("store_id"),
            capabilities=self._identity.get("capabilities"),
            policy=self.settings.policy,
            requests=RequestsStatus(
                active=len(self._active),
                queued=len(self._pending),
                why_queued=totals.why_queued,
                running=[self._job_info(j, now) for j in self._active],
                waiting=[self._job_info(j, now) for j in itertools.islice(self._pending, LISTED_WAITING)],
                recent=list(self._recent),
                **self._counters,
            ),
            clients=ClientsStatus(with_requests=totals.clients),
            heat=self._heat.health(),
            autopin=self._heat.autopin,
            keep_alive=self._keep_alive.status(now),
            elastic=self._elastic.status(),
        )
        stats = Stats(state=status.state, requests=totals)
        if sm is not None:
            import mlx.core as mx

            pools = sm.pool_stats()
            admission = pools.admission
            status = replace(
                status,
                capacity=sm.capacity,
                moe_layers=len(sm.pools),
                experts_per_layer=max((p.layer.num_experts for p in sm.pools), default=0),
                pool=PoolStatus(
                    hit_rate=pools.hit_rate,
                    evictions=pools.evictions,
                    bytes_read=pools.bytes_read,
                    prestaged=pools.prestaged,
                    prestaged_used=pools.prestaged_used,
                    layers=pools.layers,
                    mapped=pools.mapped,
                    mapped_auto=admission.get("mapped_auto"),
                    mapped_pool=pools.mapped_pool,
                    prefill=PrefillOrder(pools.prefill_order, pools.stacked_layers, pools.staged_bytes),
                ),
                context=self._context,
                batch=self._batch.to_dict() if self._batch is not None else None,
                prompt_cache=self._prompt_cache.stats.to_dict() if self._prompt_cache is not None else None,
                memory=MemoryStatus(
                    mlx_active_bytes=mx.get_active_memory(),
                    mlx_peak_bytes=mx.get_peak_memory(),
                    resident_weights_bytes=sm.resident_bytes,
                    pool_bytes=sm.pool_bytes,
                    host_tier_bytes=admission.get("tier_bytes", 0) if admission.get("mode") == "host-tier" else 0,
                    kv_bytes=self._kv_bytes(),
                    mlx_cache_bytes=mx.get_cache_memory(),
                ),
                expert_parallel=self._ranks() if self._share is not None else None,
            )
            diagnostics = sm.diagnostics
            stats = replace(
                stats,
                model=status.model,
                capacity=sm.capacity,
                policy=status.policy,
                pool=pools,
                reader=sm.reader.stats(),
                prefetch=sm.prefetcher.stats() if sm.prefetcher is not None else None,
                diagnostics={"default": diagnostics.default, "totals": diagnostics.totals()}
                if diagnostics is not None
                else None,
            )
        served = self._identity.get("model") if sm is not None or self._store_stamp is not None else None
        self.snapshot = Snapshot(now, status, stats, served, self._store_stamp)

    def _ranks(self) -> dict[str, Any]:
        """Each rank's share, pool, hit rate, bytes read and heat (a collective: every rank
        answers), and the name of each rank's heat file in its heat folder."""
        from ..shared.heat_file import usage_name
        from .expert_worker import share_row
        from .heat import STATES
        from .model.expert_parallel import STAT_FIELDS, GroupError

        try:
            rows = self._share.gather_stats(share_row(self._sm, self._heat))
        except GroupError as e:
            if self.error is None:
                self.log.error("%s", e)
                self.state, self.error = "failed", str(e)
            return {**self._share.describe(), "ranks": []}
        ranks = []
        for rank, row in enumerate(rows):
            d = dict(zip(STAT_FIELDS, row))
            seen = d["hits"] + d["misses"]
            d["heat_state"] = STATES[d["heat_state"]] if 0 <= d["heat_state"] < len(STATES) else "unknown"
            d["heat_file"] = usage_name(rank, self._share.size)
            ranks.append({"rank": rank, **d, "hit_rate": d["hits"] / seen if seen else None})
        return {**self._share.describe(), "ranks": ranks}

    def _kv_bytes(self) -> int:
        """The active requests' KV caches, estimated from their tokens (upper bound)."""
        from .pool.capacity import kv_cache_bytes

        tokens = sum(len(j.prompt_ids) + (len(j.result.tokens) if j.result is not None else 0) for j in self._active)
        return kv_cache_bytes(self._sm.manifest.config, tokens)

    def _job_info(self, job: Job, now: float) -> RequestInfo:
        """The job as `status` lists it (shared/status.py `RequestInfo`)."""
        tokens = len(job.result.tokens) if job.result is not None else 0
        if job.prompt_ids:
            prompt: int | None = len(job.prompt_ids)
        else:  # still queued: its prompt's length once checked
            ids = job.checked.ids if job.checked is not None else None
            prompt = len(ids) if ids is not None else None
        phase = "queued" if job.started is None else "decode" if tokens or job.token_times else "prefill"
        if job.peer in self._paused and job.started is not None:
            phase = "paused"  # its client reads nothing: not stepped (daemon/server.py)
        return RequestInfo(
            id=job.msg.id,
            client=job.msg.client or job.peer.hex(),
            phase=phase,
            prompt_tokens=prompt,
            prefilled_tokens=job.prefill[0] if job.prefill is not None else None,
            prefill_total=job.prefill[1] if job.prefill is not None else None,
            tokens=tokens,
            max_tokens=job.checked.max_tokens if job.checked is not None else job.msg.max_tokens,
            seconds=now - job.received,
        )

    # ---- heat ------------------------------------------------------------------------

    def _close_model(self) -> None:
        try:
            self._heat.close(self._sm)
        finally:
            try:
                self._release_model()
            finally:
                if self._share is not None:
                    self._stop_followers()

    def _stop_followers(self) -> None:
        from .model.expert_parallel import GroupError

        try:
            self._share.stop()
        except GroupError as e:  # a rank died: nothing left to tell; mlx.launch ends the rest
            self.log.error("expert-parallel: could not stop the other ranks: %s", e)
        else:
            self.log.info("expert-parallel: the other ranks were told to stop")
