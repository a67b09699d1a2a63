"""`moestreamctl bench chat`: a multi-turn conversation through the real daemon, with
the prompt cache off and on, side by side in one run.

The conversation is token ids: a random history of `history_tokens`, then each turn
resends everything so far (the previous prompt, its answer) plus `turn_tokens` new
ones, as a chat front end does. The run with the cache off goes first and fixes the
prompts (its greedy answers are what later turns resend); the run with the cache on
sends the same prompts to a fresh daemon. Reported per turn: time to the first token
(client side) with the cache off and on, their ratio, the prompt tokens and those the
daemon served from its cache (`cached_tokens`), and whether both runs answered alike.
Each daemon is first warmed up (`warmup`) with a conversation of its own, two turns of
the measured shape over a history of other tokens: kernels of a new shape are built at
their first use (a first 2048-token turn took 41 s on the H200, the next 2.2 s), and a
turn served from the cache has shapes of its own.

Imports no MLX: it drives real daemons through the client library.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ...client.cli.daemon import start_daemon, stop_daemon
from ...client.client import Client
from ...shared import protocol as proto
from ...shared.runtime_dir import RuntimePaths
from ...shared.settings import Settings
from ...shared.store_format import load_manifest
from .common import default_of, timed_progress


@dataclass(frozen=True)
class BenchChatSettings:
    store: Path
    turns: int = 4
    history_tokens: int = 2048
    # New tokens each turn adds (the user's next message).
    turn_tokens: int = 32
    max_tokens: int = 16
    seed: int = 0
    capacity: str | None = None
    host_cache: str | None = None
    # None: the daemon's own choice (mapped = auto).
    mapped: bool | None = None
    io_threads: int = default_of("io_threads")
    warmup: bool = True


def _warm_up(client: Client, settings: BenchChatSettings, vocab: int) -> None:
    """Two untimed turns shaped as the measured ones, over tokens of their own (a prefix
    the measured conversation never shares, so the cache cannot serve it from them)."""
    rng = random.Random(settings.seed + 1)
    prompt = [rng.randrange(vocab) for _ in range(settings.history_tokens)]
    out = _ask(client, prompt, settings.max_tokens)
    _ask(client, prompt + out["tokens"] + [rng.randrange(vocab) for _ in range(settings.turn_tokens)], 2)


def _ask(client: Client, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    tic = time.perf_counter()
    first = None
    done: proto.Done | None = None
    for event in client.generate(prompt_ids=prompt, max_tokens=max_tokens, temp=0.0):
        if isinstance(event, proto.Token) and first is None:
            first = time.perf_counter() - tic
        elif isinstance(event, proto.Done):
            done = event
    if done is None:
        raise RuntimeError("a turn ended without its result")
    return {
        "ttft_s": first,
        "tokens": list(done.tokens),
        "prompt_tokens": done.stats.prompt_tokens,
        "cached_tokens": done.stats.cached_tokens,
        "daemon_prompt_s": done.stats.prompt_seconds,
        # Where the daemon's prompt time went (layer-major phases, bytes read and staged).
        "prefill": done.stats.prefill,
        "prompt_cache": done.stats.prompt_cache.to_dict() if done.stats.prompt_cache is not None else None,
    }


def _conversation(
    settings: BenchChatSettings, cache_bytes: int | None, prompts: list[list[int]] | None, warm: list[int], say
) -> tuple[list[dict[str, Any]], list[list[int]], dict[str, Any]]:
    """One daemon, one conversation: (turns, the prompts sent, the daemon's prompt cache
    status). With `prompts` None they are made from this run's answers."""
    runtime = Path(tempfile.mkdtemp(dir="/tmp", prefix="mschat"))
    given: dict[str, Any] = {"model": str(settings.store), "io_threads": settings.io_threads}
    given["runtime_dir"] = str(runtime)
    if cache_bytes is not None:
        given["prompt_cache_bytes"] = cache_bytes
    for key in ("capacity", "host_cache", "mapped"):
        if getattr(settings, key) is not None:
            given[key] = getattr(settings, key)
    daemon_settings = Settings.resolve(given)
    paths = RuntimePaths.from_settings(daemon_settings)
    rng = random.Random(settings.seed)
    config = load_manifest(settings.store).config
    vocab = int(config.get("text_config", config)["vocab_size"])
    turns, sent = [], []
    try:
        start_daemon(daemon_settings, given, timeout=600.0, echo=False)
        with Client(paths, timeout=600.0) as client:
            _ask(client, warm, 2)
            if settings.warmup:
                say(f"cache {'on' if cache_bytes is None else 'off'}: warming up with an untimed two-turn conversation")
                _warm_up(client, settings, vocab)
            prompt = [rng.randrange(vocab) for _ in range(settings.history_tokens)]
            for i in range(settings.turns):
                if prompts is not None:
                    prompt = prompts[i]
                out = _ask(client, prompt, settings.max_tokens)
                mode = "on" if cache_bytes is None else "off"
                say(
                    f"cache {mode}, turn {i + 1}: {out['prompt_tokens']} prompt tokens, {out['cached_tokens']} cached, "
                    f"TTFT {out['ttft_s']:.3f} s"
                )
                turns.append(out)
                sent.append(prompt)
                prompt = prompt + out["tokens"] + [rng.randrange(vocab) for _ in range(settings.turn_tokens)]
            status = client.status().prompt_cache
    finally:
        stop_daemon(paths, timeout=60.0)
        shutil.rmtree(runtime, ignore_errors=True)
    return turns, sent, status


def run_bench_chat(settings: BenchChatSettings, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = timed_progress(progress)
    warm = [1 + i for i in range(16)]
    off, prompts, _ = _conversation(settings, 0, None, warm, say)
    on, _, status = _conversation(settings, None, prompts, warm, say)
    turns = []
    for i, (a, b) in enumerate(zip(off, on)):
        turns.append(
            {
                "turn": i + 1,
                "prompt_tokens": b["prompt_tokens"],
                "cached_tokens": b["cached_tokens"],
                "ttft_off_s": a["ttft_s"],
                "ttft_on_s": b["ttft_s"],
                "ttft_ratio": b["ttft_s"] / a["ttft_s"] if a["ttft_s"] and b["ttft_s"] is not None else None,
                "daemon_prompt_off_s": a["daemon_prompt_s"],
                "daemon_prompt_on_s": b["daemon_prompt_s"],
                "same_tokens": a["tokens"] == b["tokens"],
                "prefill_off": a["prefill"],
                "prefill_on": b["prefill"],
                "prompt_cache_on": b["prompt_cache"],
            }
        )
    later = [t["ttft_ratio"] for t in turns[1:] if t["ttft_ratio"] is not None]
    return {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
        "turns": turns,
        "later_turns_ttft_ratio_max": max(later) if later else None,
        "later_turns_ttft_ratio_mean": sum(later) / len(later) if later else None,
        "tokens_reused": sum(t["cached_tokens"] for t in turns),
        "same_tokens": all(t["same_tokens"] for t in turns),
        "prompt_cache": status,
    }


def format_report(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"bench chat: {s['turns']} turns over a {s['history_tokens']}-token history, {s['turn_tokens']} new tokens "
        f"and {s['max_tokens']} answered per turn; time to first token with the prompt cache off and on",
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT off':>9} {'TTFT on':>9} {'on/off':>7} {'same':>5}",
    ]
    for t in r["turns"]:
        ratio = f"{t['ttft_ratio']:.3f}" if t["ttft_ratio"] is not None else "n/a"
        lines.append(
            f"{t['turn']:>4} {t['prompt_tokens']:>7} {t['cached_tokens']:>7} {t['ttft_off_s']:>8.3f}s "
            f"{t['ttft_on_s']:>8.3f}s {ratio:>7} {str(t['same_tokens']):>5}"
        )
    worst = r["later_turns_ttft_ratio_max"]
    lines.append(
        f"from turn 2: at most {worst:.3f}x the uncached time to first token; {r['tokens_reused']} tokens reused"
        if worst is not None
        else f"{r['tokens_reused']} tokens reused"
    )
    return "\n".join(lines)
