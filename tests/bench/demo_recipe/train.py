"""Train the built-in demo model: a small qwen3_moe with an MTP head, on the running
Python's standard library, within a wall-clock budget.

    python -m demo_recipe.train --out DIR [--minutes 7] [--steps N] [--seed 0] [--tiny]
        [--init-from STORE_OR_DIR] [--chat-fraction F] [--select {mixed,chat,last}]

DIR receives everything: `tokenizer/`, `model-f32/` (float weights), `model-4bit/`
(4-bit, what mlx-lm and `moestreamctl convert` load), `store/` (the expert store made
from model-4bit, with the MTP head beside it), `metrics.json` and, where matplotlib is
installed, `loss.png`. Each model folder keeps `mtp.safetensors` apart from the model
files, since stock mlx-lm does not load `mtp.*` weights.

Loss = CE(next token) + mtp_weight * CE(token after next) + aux_weight * load balance.
Adam with decoupled weight decay on matrices, linear warm-up, cosine decay. Without
`--steps`, the step count is planned after a short timed probe so that training ends
inside `--minutes`, capped at `--max-epochs` passes over the training tokens; the run
is reproduced exactly by passing the recorded step count as `--steps`. The weights kept
are those of the periodic evaluation with the lowest validation loss (`--select mixed`),
the lowest loss on the validation chat conversations alone (`chat`), or the last (`last`).

`--init-from` fine-tunes trained weights (an expert store, dequantized, or a float
model folder) with their tokenizer instead of starting afresh; `--chat-fraction` mixes
that share of synthetic chat conversations (`chat_data.py`) into the code tokens, so the
model learns the chat format and tool calls and still writes Python.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from demo_recipe.data import collect_corpus, encode_documents, reuse_tokenizer, tokenizer_file_names, train_tokenizer
from demo_recipe.evaluate import EvalResult, evaluate, mtp_logits, routing_summary, split_batch, windows
from demo_recipe.export import make_store, sample_text, save_float, save_quantized
from demo_recipe.finetune import chat_check, load_init
from demo_recipe.model import (
    FULL,
    TINY,
    DemoShape,
    build_model,
    forward_train,
    init_weights,
    over_budget,
    store_size_estimate,
)
from moestream.daemon.model.demo_mtp import MTP_FILE, MTPHead, load_mtp

# Steps timed before the plan is made (after three that include compilation).
_PROBE_STEPS = 20
_CURVE_FIELDS = ("step", "loss", "ce", "mtp_ce", "aux", "lr", "grad_norm")
# Which periodic evaluation's weights a run keeps: the lowest loss on the validation
# stream (code, then chat: its first eval_tokens), the lowest on the validation chat
# conversations alone, or the last step's.
SELECT_RULES = ("mixed", "chat", "last")


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides a run; recorded in metrics.json."""

    out: str
    tiny: bool = False
    minutes: float = 7.0
    steps: int | None = None  # fixed step count; None plans it from the time budget
    seed: int = 0
    batch_size: int = 32  # the corpus is small: more, smaller steps beat bigger batches
    seq_len: int = 512
    learning_rate: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    aux_weight: float = 0.01
    max_epochs: float = 16.0
    eval_every: int = 200
    eval_tokens: int = 131072  # validation tokens of each periodic evaluation
    log_every: int = 25
    compile: bool = True
    max_corpus_bytes: int = 64 * 2**20
    val_percent: int = 5
    include_tests: bool = False
    make_store: bool = True
    memory_limit_gib: float = 64.0
    init_from: str | None = None  # a store or model folder to fine-tune, with its tokenizer
    chat_fraction: float = 0.0  # share of the training and validation tokens that are chat
    chat_examples: int = 8000  # distinct training conversations (tiled up to chat_fraction)
    select: str = "mixed"  # one of SELECT_RULES

    @classmethod
    def tiny_preset(cls, out: str, **overrides: Any) -> "TrainSettings":
        """Seconds on a CPU: tiny dims, a small slice of the corpus, a fixed step count."""
        base = cls(
            out=out,
            tiny=True,
            steps=40,
            batch_size=8,
            seq_len=64,
            learning_rate=3e-3,
            warmup_steps=5,
            eval_every=20,
            eval_tokens=4096,
            log_every=5,
            compile=False,  # compiling for the CPU takes longer than the tiny run itself
            max_corpus_bytes=60_000,
            val_percent=10,
            chat_examples=60,
        )
        return replace(base, **overrides)

    @property
    def shape(self) -> DemoShape:
        return TINY if self.tiny else FULL


class Trainee(nn.Module):
    """The language model and its MTP head, trained as one parameter tree."""

    def __init__(self, lm: nn.Module, mtp: MTPHead):
        super().__init__()
        self.lm = lm
        self.mtp = mtp


@dataclass
class Curve:
    """Per-step training figures and the periodic validation points."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    mtp_ce: list[float] = field(default_factory=list)
    aux: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    chat_val: list[dict[str, float]] = field(default_factory=list)  # the chat conversations alone


@dataclass(frozen=True)
class Selection:
    """Which periodic evaluation's weights were kept, by which rule."""

    rule: str
    step: int
    loss: float  # the loss the rule ranked by (for `last`: the validation stream's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoopResult:
    curve: Curve
    steps: int
    selection: Selection
    train_s: float
    eval_s: float  # of train_s, spent in periodic evaluations

    @property
    def best_step(self) -> int:
        return self.selection.step


class BatchSampler:
    """Epochs over shuffled non-overlapping windows, each epoch at a random phase."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator):
        self.tokens = mx.array(tokens)
        self.n = len(tokens)
        self.seq_len, self.batch_size, self.rng = seq_len, batch_size, rng
        self.steps_per_epoch = len(windows(self.n, seq_len)) // batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"{self.n} training tokens give fewer than one batch of {batch_size} x {seq_len}; "
                "lower the batch size or sequence length, or raise the corpus cap"
            )
        self._queue = np.empty(0, dtype=np.int64)
        self._offsets = mx.arange(seq_len + 2)

    def next(self) -> mx.array:
        """The next [batch_size, seq_len + 2] batch of token ids."""
        if len(self._queue) < self.batch_size:
            self._queue = self.rng.permutation(windows(self.n, self.seq_len, int(self.rng.integers(0, self.seq_len))))
        starts, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        return self.tokens[mx.array(starts)[:, None] + self._offsets]


def make_loss(settings: TrainSettings) -> Callable[[Trainee, mx.array], tuple[mx.array, ...]]:
    """loss_fn(trainee, batch) -> (loss, next-token CE, MTP CE, load-balancing loss)."""

    def loss_fn(trainee: Trainee, batch: mx.array) -> tuple[mx.array, ...]:
        x, y1, y2 = split_batch(batch)
        out = forward_train(trainee.lm, x)
        ce = nn.losses.cross_entropy(out.logits, y1, reduction="mean")
        mtp_ce = nn.losses.cross_entropy(mtp_logits(trainee.lm, trainee.mtp, out.hidden, y1), y2, reduction="mean")
        loss = ce + settings.mtp_weight * mtp_ce + settings.aux_weight * out.aux_loss
        return loss, ce, mtp_ce, out.aux_loss

    return loss_fn


def learning_rate(step: int, total: int, settings: TrainSettings) -> float:
    """Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at `total`."""
    peak = settings.learning_rate
    if step < settings.warmup_steps:
        return peak * (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, total - settings.warmup_steps))
    floor = settings.min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def plan_steps(done: int, seconds_left: float, step_s: float, eval_s: float, settings: TrainSettings, cap: int) -> int:
    """Total steps that fit in `seconds_left` after `done`, periodic evaluations included."""
    per_step = step_s + eval_s / settings.eval_every
    return max(done + 1, min(cap, done + int(seconds_left / per_step)))


def _log(msg: str) -> None:
    print(msg, flush=True)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__}
    info.update({k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))})
    return info


def train_loop(
    trainee: Trainee,
    train_ids: np.ndarray,
    val_ids: np.ndarray,
    settings: TrainSettings,
    chat_val_ids: np.ndarray | None = None,
) -> LoopResult:
    """Train `trainee` in place; leave it holding the weights that `settings.select` picks
    among the periodic evaluations. `chat_val_ids` (the validation chat conversations) is
    evaluated at each of them too; `select="chat"` needs it."""
    if settings.select not in SELECT_RULES:
        raise ValueError(f"select must be one of {', '.join(SELECT_RULES)}, not {settings.select!r}")
    if settings.select == "chat" and chat_val_ids is None:
        raise ValueError("select='chat' needs validation chat conversations (a chat_fraction above 0)")
    rng = np.random.default_rng(settings.seed)
    optimizer = optim.Adam(learning_rate=0.0, betas=[0.9, 0.95], bias_correction=True)
    optimizer.init(trainee.trainable_parameters())
    loss_and_grad = nn.value_and_grad(trainee, make_loss(settings))
    state = [trainee.state, optimizer.state]

    def step_fn(batch: mx.array) -> tuple[mx.array, ...]:
        (loss, ce, mtp_ce, aux), grads = loss_and_grad(trainee, batch)
        grads, grad_norm = optim.clip_grad_norm(grads, settings.grad_clip)
        # Decoupled weight decay on matrices only: norm scales keep their value.
        shrink = 1.0 - optimizer.learning_rate * settings.weight_decay
        trainee.update(tree_map(lambda p: p * shrink if p.ndim >= 2 else p, trainee.trainable_parameters()))
        optimizer.update(trainee, grads)
        return loss, ce, mtp_ce, aux, grad_norm

    step = mx.compile(step_fn, inputs=state, outputs=state) if settings.compile else step_fn

    def validate(i: int) -> tuple[EvalResult, EvalResult | None]:
        def run(ids: np.ndarray) -> EvalResult:
            return evaluate(
                trainee.lm, trainee.mtp, ids, seq_len=settings.seq_len, batch_size=settings.batch_size,
                max_tokens=settings.eval_tokens,
            )  # fmt: skip

        val = run(val_ids)
        curve.val.append({"step": i, "loss": val.loss, "mtp_loss": val.mtp_loss})
        chat = None if chat_val_ids is None else run(chat_val_ids)
        if chat is not None:
            curve.chat_val.append({"step": i, "loss": chat.loss, "mtp_loss": chat.mtp_loss})
        return val, chat

    sampler = BatchSampler(train_ids, settings.seq_len, settings.batch_size, rng)
    cap = max(1, int(settings.max_epochs * sampler.steps_per_epoch))
    total = settings.steps if settings.steps is not None else cap
    tokens_per_step = settings.batch_size * settings.seq_len
    _log(f"{tokens_per_step:,} tokens/step, {sampler.steps_per_epoch} steps/epoch, at most {cap} steps")
    # Steps up to the probe run at warm-up rates, which do not depend on the total.
    probe_at = None if settings.steps is not None else max(5, min(_PROBE_STEPS + 3, settings.warmup_steps))

    curve = Curve()
    best: tuple[float, int, dict] | None = None
    t_loop = time.perf_counter()
    t_window, eval_s, i = t_loop, 0.0, 0
    while i < total:
        lr = learning_rate(i, total, settings)
        optimizer.learning_rate = lr
        outputs = step(sampler.next())
        mx.eval(state, outputs)
        loss, ce, mtp_ce, aux, gnorm = (o.item() for o in outputs)
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss became {loss} at step {i}; lower --lr")
        i += 1
        for name, value in zip(_CURVE_FIELDS, (i, loss, ce, mtp_ce, aux, lr, gnorm)):
            getattr(curve, name).append(value)
        if i == 3:  # the first steps include compilation
            t_window = time.perf_counter()

        if i == probe_at:
            step_s = (time.perf_counter() - t_window) / (i - 3)
            t_eval = time.perf_counter()
            validate(i)
            one_eval_s = time.perf_counter() - t_eval
            eval_s += one_eval_s
            left = settings.minutes * 60 - (time.perf_counter() - t_loop)
            total = plan_steps(i, left, step_s, one_eval_s, settings, cap)
            _log(
                f"plan: {step_s * 1000:.1f} ms/step, {one_eval_s:.1f} s/eval -> {total} steps "
                f"({total / sampler.steps_per_epoch:.1f} epochs)"
            )
        if i % settings.log_every == 0 or i == total:
            seconds = time.perf_counter() - t_loop - eval_s
            _log(
                f"step {i}/{total}  loss {loss:.3f}  ce {ce:.3f}  mtp {mtp_ce:.3f}  aux {aux:.3f}  "
                f"lr {lr:.2e}  |g| {gnorm:.2f}  {i * tokens_per_step / seconds:,.0f} tok/s"
            )
        if i % settings.eval_every == 0 or i == total:
            t_eval = time.perf_counter()
            val, chat = validate(i)
            eval_s += time.perf_counter() - t_eval
            chat_note = "" if chat is None else f"  chat {chat.loss:.3f} (mtp {chat.mtp_loss:.3f})"
            _log(f"  val loss {val.loss:.3f} (ppl {val.ppl:.1f})  mtp {val.mtp_loss:.3f}{chat_note}")
            score = chat.loss if settings.select == "chat" and chat is not None else val.loss
            if best is None or settings.select == "last" or score < best[0]:
                # MLX arrays are immutable: holding the tree keeps these weights.
                best = (score, i, trainee.parameters())
    train_s = time.perf_counter() - t_loop
    assert best is not None  # the last step always evaluates
    if best[1] != i:
        _log(f"keeping the weights of step {best[1]} (best {settings.select} validation loss {best[0]:.3f})")
        trainee.update(best[2])
    return LoopResult(curve, i, Selection(settings.select, best[1], best[0]), train_s, eval_s)


def train(settings: TrainSettings) -> dict[str, Any]:
    """Run the whole pipeline into settings.out; return the metrics it wrote."""
    t_start = time.perf_counter()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = settings.shape
    if mx.default_device().type == mx.gpu:
        mx.set_memory_limit(int(settings.memory_limit_gib * 2**30))
    mx.random.seed(settings.seed)

    corpus = collect_corpus(
        settings.max_corpus_bytes, val_percent=settings.val_percent, include_tests=settings.include_tests
    )
    tok_dir = out / "tokenizer"
    if settings.init_from:
        tokenizer = reuse_tokenizer(settings.init_from, tok_dir)
    else:
        tokenizer = train_tokenizer(corpus.train_texts, shape.vocab_size, tok_dir)
    train_ids = encode_documents(tokenizer, corpus.train_texts)
    val_ids = encode_documents(tokenizer, corpus.val_texts)
    corpus_info = corpus.summary() | {"train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids))}
    data_s = time.perf_counter() - t_start
    _log(
        f"corpus: {corpus_info['train_files']} train / {corpus_info['val_files']} val files, "
        f"{corpus.train_bytes / 1e6:.2f} MB -> {len(train_ids):,} train and {len(val_ids):,} val tokens "
        f"({corpus.train_bytes / len(train_ids):.2f} bytes/token); {data_s:.1f} s"
    )
    chat_val_ids = None
    if settings.chat_fraction > 0:
        train_ids, val_ids, chat_val_ids, corpus_info["chat"] = _mix_chat(
            tokenizer, tok_dir, train_ids, val_ids, settings
        )

    estimate = store_size_estimate(
        shape, tokenizer_bytes=sum((tok_dir / n).stat().st_size for n in tokenizer_file_names())
    )
    problem = over_budget(estimate["store"], estimate["mtp"])
    if problem:
        raise ValueError(f"before training: {problem}")
    _log(f"store estimate: {estimate['store'] / 2**20:.2f} MiB (+ MTP head {estimate['mtp'] / 2**20:.2f} MiB)")

    if settings.init_from:
        lm, mtp, config = load_init(settings.init_from, shape, seed=settings.seed)
        _log(f"initialised from {settings.init_from}")
    else:
        lm, config = build_model(shape, seed=settings.seed)
        mtp = MTPHead(lm.args, shape.mtp_intermediate_size)
        init_weights(mtp, seed=settings.seed + 1, num_layers=shape.num_hidden_layers)
    trainee = Trainee(lm, mtp)
    n_params = sum(v.size for _, v in tree_flatten(lm.parameters()))
    n_mtp = sum(v.size for _, v in tree_flatten(mtp.parameters()))
    _log(
        f"model: {n_params / 1e6:.2f} M parameters (+{n_mtp / 1e6:.2f} M MTP), {shape.num_experts} experts, "
        f"top-{shape.num_experts_per_tok}, on {mx.default_device()}"
    )

    loop = train_loop(trainee, train_ids, val_ids, settings, chat_val_ids)
    final = evaluate(lm, mtp, val_ids, seq_len=settings.seq_len, batch_size=settings.batch_size)
    _log(
        f"validation ({final.tokens:,} tokens): loss {final.loss:.4f}, ppl {final.ppl:.2f}, "
        f"next-token acc {final.next_token_acc:.3f}; MTP loss {final.mtp_loss:.4f}, "
        f"next-next-token acc {final.mtp_next_next_acc:.3f}"
    )
    final_chat = None
    if chat_val_ids is not None:
        final_chat = evaluate(lm, mtp, chat_val_ids, seq_len=settings.seq_len, batch_size=settings.batch_size)
        _log(f"validation chat ({final_chat.tokens:,} tokens): loss {final_chat.loss:.4f}")
    tokens_seen = loop.steps * settings.batch_size * settings.seq_len
    metrics: dict[str, Any] = {
        "settings": asdict(settings),
        "shape": shape.as_dict(),
        "config": config,
        "corpus": corpus_info,
        "device": _device(),
        "python": sys.version.split()[0],
        "seed": settings.seed,
        "steps": loop.steps,
        "best_step": loop.best_step,
        "selection": loop.selection.to_dict(),
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(train_ids),
        "parameters": {"model": int(n_params), "mtp": int(n_mtp)},
        "time_s": {"data": data_s, "train": loop.train_s, "periodic_eval": loop.eval_s},
        "tokens_per_s": tokens_seen / (loop.train_s - loop.eval_s),
        "train_curve": asdict(loop.curve),
        "validation": final.as_dict(),
        "validation_chat": None if final_chat is None else final_chat.as_dict(),
        "routing": routing_summary(final.load or []),
        "store_estimate_bytes": estimate,
    }
    _write_json(out / "metrics.json", metrics)

    save_float(lm, mtp, config, shape, tok_dir, out / "model-f32")
    q_dir = out / "model-4bit"
    save_quantized(lm, mtp, config, shape, tok_dir, q_dir)
    if settings.make_store:  # first: the store is what ships, whatever fails below
        metrics["store_bytes"] = sizes = make_store(q_dir, out / "store")
        _log(f"store: {sizes['store'] / 2**20:.2f} MiB + MTP head {sizes['mtp'] / 2**20:.2f} MiB in {out / 'store'}")
    # Before the 4-bit checks, which a backend without quantized expert kernels may fail.
    if settings.chat_fraction > 0 and not settings.tiny:
        metrics["chat_check_f32"] = _chat_check(out / "model-f32")
        _write_json(out / "metrics.json", metrics)
    metrics["validation_4bit"] = _evaluate_saved(q_dir, val_ids, settings)
    metrics["sample"] = _sample(q_dir, settings)
    metrics["time_s"]["total"] = time.perf_counter() - t_start
    _write_json(out / "metrics.json", metrics)
    _plot(metrics, out)
    return metrics


def _tiled(ids: np.ndarray, length: int) -> np.ndarray:
    return np.tile(ids, -(-length // len(ids)))[:length]


def _mix_chat(
    tokenizer, tok_dir: Path, train_ids: np.ndarray, val_ids: np.ndarray, settings: TrainSettings
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """(training stream, validation stream, validation chat alone, summary): code tokens
    followed by chat tokens so that chat is `chat_fraction` of each stream. Whichever part
    is short of its share is tiled, so every distinct conversation is in the stream. The
    validation conversations are drawn apart from training (held out of both: the chat
    evaluation's cities and questions)."""
    from demo_recipe.chat_data import chat_texts

    if not 0 < settings.chat_fraction < 1:
        raise ValueError(f"chat_fraction must be between 0 and 1, not {settings.chat_fraction}")
    t0 = time.perf_counter()
    texts, summary = chat_texts(tok_dir, settings.chat_examples, seed=settings.seed + 1000)
    val_texts, _ = chat_texts(tok_dir, max(8, settings.chat_examples // 20), seed=settings.seed + 2000)
    render_s = time.perf_counter() - t0
    ratio = settings.chat_fraction / (1 - settings.chat_fraction)

    def mixed(code: np.ndarray, chat: np.ndarray) -> tuple[np.ndarray, int]:
        code_len = max(len(code), math.ceil(len(chat) / ratio))
        return np.concatenate([_tiled(code, code_len), _tiled(chat, int(code_len * ratio))]), code_len

    chat_train, chat_val = encode_documents(tokenizer, texts), encode_documents(tokenizer, val_texts)
    mixed_train, code_train = mixed(train_ids, chat_train)
    mixed_val, code_val = mixed(val_ids, chat_val)
    info = summary | {
        "conversations": len(texts),
        "distinct_tokens": int(len(chat_train)),
        "train_tokens": int(len(mixed_train) - code_train),
        "val_conversations": len(val_texts),
        "val_distinct_tokens": int(len(chat_val)),
        "val_tokens": int(len(mixed_val) - code_val),
        "code_train_tokens_tiled": int(code_train),
        "render_s": render_s,
    }
    cities = summary["cities"]
    _log(
        f"chat: {len(texts)} conversations ({summary['qa']} stdlib questions, {summary['qa_weather_tool_only']} of "
        f"them offered get_weather alone; {summary['call']} tool calls, {summary['result']} with results; "
        f"cities {cities['real']} real, {cities['invented']} invented), {len(chat_train):,} tokens tiled to "
        f"{info['train_tokens']:,} beside {code_train:,} code; val {len(val_texts)} conversations, "
        f"{len(chat_val):,} tokens; {render_s:.1f} s rendering, {time.perf_counter() - t0:.1f} s in all"
    )
    return mixed_train, mixed_val, chat_val, info


def _chat_check(model_dir: Path) -> dict[str, Any]:
    try:
        result = chat_check(model_dir)
    except RuntimeError as e:  # as below: a backend without the kernels generation needs
        _log(f"the chat check of {model_dir.name} failed on {mx.default_device()}: {e}")
        return {"error": str(e)}
    _log(f"chat check ({model_dir.name}, stock mlx-lm, greedy): {result}")
    return result


def _evaluate_saved(model_dir: Path, val_ids: np.ndarray, settings: TrainSettings) -> dict[str, Any]:
    """Validation figures of a saved model folder as stock mlx-lm loads it."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    head, _ = load_mtp(model_dir / MTP_FILE)
    try:
        result = evaluate(model, head, val_ids, seq_len=settings.seq_len, batch_size=settings.batch_size, dense=False)
    except RuntimeError as e:  # a backend without batched quantized expert kernels
        _log(f"evaluating {model_dir.name} failed on {mx.default_device()}: {e}; the float figures stand alone")
        return {"error": str(e)}
    _log(
        f"{model_dir.name}: loss {result.loss:.4f}, ppl {result.ppl:.2f}; "
        f"MTP next-next-token acc {result.mtp_next_next_acc:.3f}"
    )
    return result.as_dict()


def _sample(model_dir: Path, settings: TrainSettings) -> dict[str, str]:
    try:
        sample = sample_text(model_dir, seed=settings.seed, max_tokens=24 if settings.tiny else 120)
    except RuntimeError as e:  # as above: a backend without quantized expert kernels
        _log(f"generating with {model_dir.name} failed on {mx.default_device()}: {e}")
        return {"error": str(e)}
    _log(f"sample (greedy, {model_dir.name}):\n{sample['prompt']}{sample['greedy']}")
    return sample


def _plot(metrics: dict[str, Any], out: Path) -> None:
    from demo_recipe.plot import plot_metrics

    try:
        plot_metrics(metrics, out / "loss.png")
    except ModuleNotFoundError as e:
        _log(
            f"loss.png skipped: {e.name} is not installed here; run "
            f"`python -m demo_recipe.plot {out / 'metrics.json'} {out / 'loss.png'}` where it is"
        )
    else:
        _log(f"wrote {out / 'loss.png'}")


def parse_args(argv: list[str] | None = None) -> TrainSettings:
    parser = argparse.ArgumentParser(
        prog="python -m demo_recipe.train", description="Train the built-in demo MoE model."
    )
    parser.add_argument("--out", required=True, help="folder for the tokenizer, models, store and metrics")
    parser.add_argument("--tiny", action="store_true", help="tiny dims and a few steps (tests, CPU)")
    parser.add_argument("--minutes", type=float, help="wall-clock budget of the training loop (default 7)")
    parser.add_argument("--steps", type=int, help="train exactly this many steps (overrides --minutes)")
    parser.add_argument("--seed", type=int, help="default 0")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--lr", dest="learning_rate", type=float)
    parser.add_argument("--max-epochs", type=float)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--eval-tokens", type=int, help="validation tokens of each periodic evaluation")
    parser.add_argument("--log-every", type=int)
    parser.add_argument("--max-corpus-bytes", type=int)
    parser.add_argument("--include-tests", action="store_true", default=None, help="also train on the stdlib's tests")
    parser.add_argument("--no-compile", dest="compile", action="store_false", default=None)
    parser.add_argument("--no-store", dest="make_store", action="store_false", default=None, help="skip the convert")
    parser.add_argument("--init-from", help="fine-tune this expert store or model folder (with its tokenizer)")
    parser.add_argument("--chat-fraction", type=float, help="share of chat conversations in the tokens (default 0)")
    parser.add_argument("--chat-examples", type=int, help="distinct training conversations (default 8000)")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument(
        "--select", choices=SELECT_RULES, help="weights kept: best validation loss (mixed, default), best on the "
        "validation chat alone (chat; needs --chat-fraction), or the last step's"
    )  # fmt: skip
    args = vars(parser.parse_args(argv))
    out, tiny = args.pop("out"), args.pop("tiny")
    overrides = {k: v for k, v in args.items() if v is not None}
    if not 0 <= overrides.get("chat_fraction", 0) < 1:
        parser.error("--chat-fraction must be at least 0 and below 1")
    if overrides.get("select") == "chat" and not overrides.get("chat_fraction"):
        parser.error("--select chat needs --chat-fraction above 0 (it ranks by the validation chat)")
    for name in (
        "steps",
        "batch_size",
        "seq_len",
        "eval_every",
        "eval_tokens",
        "log_every",
        "max_corpus_bytes",
        "chat_examples",
    ):
        if name in overrides and overrides[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return TrainSettings.tiny_preset(out, **overrides) if tiny else replace(TrainSettings(out=out), **overrides)


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    metrics = train(settings)
    sizes = metrics.get("store_bytes")
    problem = sizes and over_budget(sizes["store"], sizes["mtp"])
    if problem:
        print(f"error: the trained store is too big: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
