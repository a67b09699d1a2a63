"""Prompt checks off the engine thread: tokenizing a request's prompt (or rendering its
chat) and checking it against the context (`max_context`, or the model's own bounded by
memory: daemon/pool/capacity.py `context_limit`): a prompt that fills it is refused, a
`max_tokens` past it is cut to the room left, so the answer ends there with finish reason
"length" (an agent asks for 32000 tokens beside a 30k-token prompt).

A 256K-character prompt takes a tenth of a second to a second to tokenize; on the
engine thread, one client queueing hundreds of prompts that are then refused as too
long held every other client's tokens up for minutes. Here one worker thread does it,
taking the waiting requests in turns by client (the client with the fewest checks done
goes first), so another client's request waits for at most one check in progress.

The worker never touches MLX (only the tokenizer, which the engine thread uses only to
detokenize); it posts each result back to the engine through `on_done`, which only
queues a command. What must stay true: a job's `checked` is set once, by this thread,
whole (one assignment of a finished `Checked`), before `on_done(job)` wakes the engine;
the engine activates or fails the job only once it sees it set. A prompt that passed is
announced by `on_accepted(job)` first (the engine sends the request's `accepted` event
from here, so that it leaves while the engine is busy with another request's prefill).

`count_tokens` requests (`CountRequest`) never reach the engine: the I/O thread hands
them here (`count`), and this thread answers them itself on a PUSH socket of its own to
the I/O thread's inproc endpoint, so that a count is answered in milliseconds while the
engine is inside a long prefill.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq

from ..shared import protocol as proto

# Added to the daemon's niceness for the checking thread (Linux: per thread).
CHECK_NICENESS = 10
# Clients whose last turn is remembered; past it, only those with prompts waiting are kept.
SERVED_CLIENTS_KEPT = 1024


@dataclass(frozen=True)
class Checked:
    """The outcome of one prompt's check: its token ids and the tokens it may make (its
    max_tokens, cut to the context's room), or the error to reply with."""

    ids: list[int] | None = None
    max_tokens: int = 0
    code: str = ""
    message: str = ""
    seconds: float = 0.0
    # A chat's answer starts inside a thinking block (daemon/model/reasoning.py); None: not
    # a chat, or a model without thinking markers.
    opens_thinking: bool | None = None
    # The answer's grammar (daemon/model/constrain.py `Grammar`), compiled here, off the
    # engine thread; None where nothing constrains it.
    grammar: Any = None
    # A chat's images through the model's processor (daemon/model/vision.py
    # `PreparedImages`), decoded here, off the engine thread; None: no images.
    images: Any = None


@dataclass(frozen=True)
class CountRequest:
    """A `count_tokens` request from the client `peer`: answered by this thread."""

    peer: bytes
    msg: proto.CountTokens

    @property
    def client(self) -> str:
        """Whose turn it takes among the checker's clients (as a job's `client`)."""
        return f"peer {self.peer.hex()}"


class PromptChecker:
    """One worker thread that checks the prompts of queued jobs, fairly by client, and
    answers `count_tokens` requests (on `events`: the I/O thread's inproc endpoint)."""

    def __init__(
        self,
        sm: Any,
        max_context: int,
        on_done: Callable[[Any], None],
        log: logging.Logger | None = None,
        on_accepted: Callable[[Any], None] | None = None,
        *,
        events: tuple[zmq.Context, str] | None = None,
    ) -> None:
        self._sm = sm
        self._log = log
        self._max_context = max_context
        self._on_done = on_done
        self._on_accepted = on_accepted
        self._events = events
        self._cond = threading.Condition()
        self._waiting: deque[Any] = deque()
        # When each client was last served (a count of turns): the one served longest ago goes next.
        self._served_at: dict[str, int] = {}
        self._turns = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prompt-check", daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()

    def count(self, request: CountRequest) -> bool:
        """Queue a count (from any thread); False when this checker is closed or has no
        socket to answer on: the caller finds it another way."""
        with self._cond:
            if self._closed or self._events is None:
                return False
            self._waiting.append(request)
            self._cond.notify()
        return True

    def close(self) -> list[CountRequest]:
        """Stop the thread; the counts it had not answered are returned, to be served by
        the next checker."""
        with self._cond:
            self._closed = True
            counts = [r for r in self._waiting if isinstance(r, CountRequest)]
            self._waiting.clear()
            self._cond.notify()
        self._thread.join(timeout=10.0)
        return counts

    def _next(self) -> Any | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            # By the client the engine's shares count (a gateway's requests come from many
            # connections but name their client): 32 streams of one client checked before
            # another client's one request kept it waiting 20x its time alone.
            job = min(self._waiting, key=lambda j: self._served_at.get(j.client, 0))
            self._waiting.remove(job)
            self._turns += 1
            self._served_at[job.client] = self._turns
            if len(self._served_at) > SERVED_CLIENTS_KEPT:
                waiting = {j.client for j in self._waiting}
                self._served_at = {c: t for c, t in self._served_at.items() if c in waiting}
            return job

    def _run(self) -> None:
        if sys.platform == "linux":
            # Tokenizing releases the GIL and takes a core: where cores are scarce the engine
            # thread (this thread's niceness is its own on Linux) goes first.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECK_NICENESS)
            except OSError as e:
                if self._log is not None:
                    self._log.warning(f"cannot lower the prompt check's priority: {e}")
        sock = None
        if self._events is not None:
            ctx, endpoint = self._events
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # as the engine's: never blocks, bounded by the requests
            sock.connect(endpoint)
        try:
            while (job := self._next()) is not None:
                if isinstance(job, CountRequest):
                    sock.send_multipart([job.peer, proto.encode(self.count_reply(job.msg))], copy=False)
                    continue
                if job.stop_reason is None:  # a job stopped meanwhile needs no check
                    job.checked = self.check(job.msg)
                    if job.checked.ids is not None and self._on_accepted is not None:
                        self._on_accepted(job)
                self._on_done(job)
        finally:
            if sock is not None:
                sock.close(linger=0)

    def _encode(self, msg: proto.Generate | proto.CountTokens) -> tuple[list[int], Any]:
        """The prompt's ids, and its images as the model's processor made them (None: none)."""
        from .model.generation import encode_prompt, render_chat
        from .model.vision import ImageError, prepare

        images = [im for m in msg.messages or () for im in m.images or ()]
        if not images:
            ids = encode_prompt(
                self._sm, msg.prompt, msg.prompt_ids, msg.messages, msg.tools, msg.tool_choice, msg.thinking
            )
            return ids, None
        if self._sm.vision is None:
            raise ImageError(
                f"the loaded model ({Path(self._sm.store_dir).name}) takes no images: its store holds no vision "
                "tower (convert a vision-language model to send images)"
            )
        text = render_chat(self._sm.tokenizer, msg.messages, msg.tools, msg.tool_choice, msg.thinking)
        return prepare(self._sm.vision, text, images)

    def count_reply(self, msg: proto.CountTokens) -> proto.TokenCount | proto.Error:
        from .model.vision import ImageError

        try:
            return proto.TokenCount(msg.id, len(self._encode(msg)[0]))
        except ImageError as e:
            return proto.Error(msg.id, proto.BAD_IMAGE, str(e))
        except ValueError as e:
            return proto.Error(msg.id, proto.BAD_MESSAGE, str(e))
        except Exception as e:  # this count fails with the reason; the thread serves on
            if self._log is not None:
                self._log.exception("count_tokens %s failed", msg.id)
            return proto.Error(msg.id, proto.INTERNAL, f"{type(e).__name__}: {e}")

    def check(self, msg: proto.Generate) -> Checked:
        from .model.reasoning import opens_thinking
        from .model.vision import ImageError

        tic = time.perf_counter()
        problem = self._speculative_problem(msg)
        if problem:
            return Checked(code=proto.BAD_MESSAGE, message=problem)
        try:
            ids, images = self._encode(msg)
            grammar = self._grammar(msg)
        except ImageError as e:
            return Checked(code=proto.BAD_IMAGE, message=str(e), seconds=time.perf_counter() - tic)
        except ValueError as e:
            return Checked(code=proto.BAD_MESSAGE, message=str(e), seconds=time.perf_counter() - tic)
        if len(ids) >= self._max_context:
            return Checked(
                code=proto.TOO_LONG,
                message=f"prompt of {len(ids)} tokens leaves no room in the daemon's context of "
                f"{self._max_context} tokens (setting max_context; `moestreamctl status` says how it was found)",
                seconds=time.perf_counter() - tic,
            )
        room = self._max_context - len(ids)
        opens = opens_thinking(self._sm.tokenizer, ids) if msg.messages is not None else None
        return Checked(
            ids=ids,
            max_tokens=min(msg.max_tokens, room),
            seconds=time.perf_counter() - tic,
            opens_thinking=opens,
            grammar=grammar,
            images=images,
        )

    def _grammar(self, msg: proto.Generate) -> Any:
        from .model.constrain import grammar_for

        tools = msg.tools if msg.messages is not None else None
        return grammar_for(self._sm.tokenizer, msg.constraint, tools, msg.tool_choice)

    def _speculative_problem(self, msg: proto.Generate) -> str:
        """What makes the request's speculative decoding impossible here (only file checks)."""
        from ..shared.store_format import MANIFEST_NAME
        from .model.demo_mtp import MTP_FILE

        if msg.speculative == "mtp" and not (Path(self._sm.store_dir) / MTP_FILE).is_file():
            return (
                f"{self._sm.store_dir} has no MTP head ({MTP_FILE}); speculative 'mtp' needs one "
                "(convert a checkpoint that carries mtp.* tensors, or use speculative 'draft')"
            )
        if msg.speculative == "draft" and msg.draft_model is not None:
            draft = Path(msg.draft_model)
            if not ((draft / MANIFEST_NAME).is_file() or (draft / "config.json").is_file()):
                return f"draft model {msg.draft_model} is neither an expert store nor an mlx-lm model folder"
        return ""
