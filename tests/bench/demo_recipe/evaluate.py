"""Validation figures of the demo model: loss, perplexity, next-token accuracy, and the
MTP head's loss and next-next-token accuracy, plus how evenly the router spreads tokens.

A token stream is cut into windows of `seq_len + 2` tokens (stride `seq_len`): the model
reads the first `seq_len`, predicts tokens 1..seq_len, and the MTP head predicts tokens
2..seq_len+1 from the model's hidden states and tokens 1..seq_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from demo_recipe.model import forward_train, output_head
from moestream.daemon.model.demo_mtp import MTPHead


def windows(length: int, seq_len: int, start: int = 0) -> np.ndarray:
    """Start offsets of consecutive windows of `seq_len + 2` tokens (stride `seq_len`)
    in a stream of `length` tokens, from `start`."""
    count = (length - start - 2) // seq_len
    if count < 1:
        raise ValueError(f"{length} tokens are too few for one window of {seq_len + 2}")
    return start + seq_len * np.arange(count)


def split_batch(batch: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """[B, T+2] -> inputs x_0..x_{T-1}, next tokens x_1..x_T, after-next x_2..x_{T+1}."""
    t = batch.shape[1] - 2
    return batch[:, :t], batch[:, 1 : t + 1], batch[:, 2:]


def mtp_logits(lm: nn.Module, head: MTPHead, hidden: mx.array, next_tokens: mx.array) -> mx.array:
    """The MTP head's logits for the tokens after `next_tokens`, via the shared head."""
    mask = "causal" if hidden.shape[1] > 1 else None
    return output_head(lm, head(hidden, lm.model.embed_tokens(next_tokens), mask))


@dataclass
class EvalResult:
    loss: float
    next_token_acc: float
    mtp_loss: float
    mtp_next_next_acc: float
    tokens: int
    load: list[list[float]] | None = None  # [moe layer][expert]: fraction of routed slots

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    def as_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "ppl": self.ppl,
            "next_token_acc": self.next_token_acc,
            "mtp_loss": self.mtp_loss,
            "mtp_ppl": math.exp(self.mtp_loss),
            "mtp_next_next_acc": self.mtp_next_next_acc,
            "tokens": self.tokens,
        }


def evaluate(
    lm: nn.Module,
    head: MTPHead,
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    max_tokens: int | None = None,
    dense: bool = True,
) -> EvalResult:
    """Figures over `tokens` (the first `max_tokens` of them if given).

    dense=True runs the training forward pass (float models; also gives the expert
    load); dense=False runs stock mlx-lm's `model.model`, as for a model returned by
    `mlx_lm.load` (e.g. the 4-bit one).
    """
    starts = windows(len(tokens), seq_len)
    if max_tokens is not None:
        starts = starts[: max(1, max_tokens // seq_len)]
    data, offsets = mx.array(tokens), mx.arange(seq_len + 2)
    sums = [mx.array(0.0)] * 4
    load = None
    for i in range(0, len(starts), batch_size):
        x, y1, y2 = split_batch(data[mx.array(starts[i : i + batch_size])[:, None] + offsets])
        if dense:
            out = forward_train(lm, x)
            logits, hidden = out.logits, out.hidden
            load = out.load * x.size if load is None else load + out.load * x.size
        else:
            hidden = lm.model(x)
            logits = output_head(lm, hidden)
        logits2 = mtp_logits(lm, head, hidden, y1)
        part = [
            nn.losses.cross_entropy(logits.astype(mx.float32), y1, reduction="sum"),
            (logits.argmax(-1) == y1).sum(),
            nn.losses.cross_entropy(logits2.astype(mx.float32), y2, reduction="sum"),
            (logits2.argmax(-1) == y2).sum(),
        ]
        sums = [s + p.astype(mx.float32) for s, p in zip(sums, part)]
        mx.eval(sums if load is None else [*sums, load])
    n = len(starts) * seq_len
    loss, acc, mtp_loss, mtp_acc = (s.item() / n for s in sums)
    return EvalResult(loss, acc, mtp_loss, mtp_acc, n, None if load is None else (load / n).tolist())


def routing_summary(load: list[list[float]]) -> dict[str, Any]:
    """Per MoE layer: how evenly the validation tokens spread over the experts."""
    layers = []
    for fractions in load:
        f = np.asarray(fractions, dtype=np.float64)
        p = f[f > 0]
        layers.append(
            {
                "normalized_entropy": float(-(p * np.log(p)).sum() / math.log(len(f))),
                "max_fraction": float(f.max()),
                "min_fraction": float(f.min()),
                "unused_experts": int((f < 1e-5).sum()),
                "fractions": [round(float(x), 6) for x in f],
            }
        )
    return {"layers": layers}
