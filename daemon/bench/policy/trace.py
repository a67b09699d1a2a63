"""Routing traces: one JSON object per token, in order, with the top-k experts of every
traced layer (format: the traces README; `meta.json` lies beside `trace.jsonl`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("prefill", "decode")


class TraceError(ValueError):
    """A trace file cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Trace:
    path: Path  # the trace.jsonl
    meta: dict[str, Any]
    num_experts: int
    top_k: int
    layer_ids: tuple[int, ...]  # the model's own layer ids, one per traced layer
    requests: tuple[int, ...]  # per step
    phases: tuple[str, ...]  # per step
    steps: tuple[tuple[tuple[int, ...], ...], ...]  # [step][traced layer] -> experts

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def layer(self, index: int) -> list[tuple[int, ...]]:
        """The experts of every step at traced layer `index`."""
        return [step[index] for step in self.steps]


def _files(path: Path) -> tuple[Path, Path]:
    trace = path / "trace.jsonl" if path.is_dir() else path
    if not trace.is_file():
        raise TraceError(f"no trace at {trace}: give a trace.jsonl or the folder holding it")
    meta = trace.parent / "meta.json"
    if not meta.is_file():
        raise TraceError(f"no meta.json beside {trace}: it gives the expert count and top-k")
    return trace, meta


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace (a trace.jsonl, or the folder holding it and meta.json)."""
    trace_path, meta_path = _files(Path(path))
    try:
        meta = json.loads(meta_path.read_text())
        num_experts, top_k = int(meta["num_experts"]), int(meta["top_k"])
    except (ValueError, KeyError, TypeError) as err:
        raise TraceError(f"{meta_path}: needs num_experts and top_k ({err})") from None
    requests: list[int] = []
    phases: list[str] = []
    steps: list[tuple[tuple[int, ...], ...]] = []
    with trace_path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{trace_path}:{lineno}"
            try:
                rec = json.loads(line)
                req, phase, layers = int(rec["req"]), rec["phase"], rec["layers"]
            except (ValueError, KeyError, TypeError) as err:
                raise TraceError(f"{where}: not a trace record ({err})") from None
            if phase not in PHASES:
                raise TraceError(f"{where}: phase {phase!r} is not one of {PHASES}")
            if steps and len(layers) != len(steps[0]):
                raise TraceError(f"{where}: {len(layers)} layers, earlier records have {len(steps[0])}")
            step = []
            for i, experts in enumerate(layers):
                ids = tuple(int(e) for e in experts)
                if len(set(ids)) != len(ids) or not all(0 <= e < num_experts for e in ids):
                    raise TraceError(
                        f"{where}: layer {i} experts {list(ids)} must be distinct ids in [0, {num_experts})"
                    )
                step.append(ids)
            requests.append(req)
            phases.append(phase)
            steps.append(tuple(step))
    if not steps:
        raise TraceError(f"{trace_path}: no records")
    layer_ids = tuple(meta.get("layer_ids_in_model", range(len(steps[0]))))
    if len(layer_ids) != len(steps[0]):
        raise TraceError(
            f"{meta_path}: layer_ids_in_model names {len(layer_ids)} layers, the records have {len(steps[0])}"
        )
    return Trace(
        path=trace_path,
        meta=meta,
        num_experts=num_experts,
        top_k=top_k,
        layer_ids=layer_ids,
        requests=tuple(requests),
        phases=tuple(phases),
        steps=tuple(steps),
    )
