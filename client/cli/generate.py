"""`moestreamctl generate`: stream text from a model."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, Callable, TextIO

import click

from ...shared.kernel_cache import KernelCacheError, use_kernel_cache
from ...shared.settings import GENERATE, LOCAL, Settings, definition, demo_store_path, in_scope
from ...shared.status import RequestStats, Status
from ...shared.store_format import same_folder
from .daemon import diagnostics_lines, resolve_settings, runtime_paths, start_daemon
from .values import capacity_note, setting_options, store_option

# Settings of `generate` that a running daemon does not take from it: `model` is checked
# against the store it serves, `runtime_dir` picks the daemon, and `keep_alive` goes with
# the request (the protocol's per-request keep_alive).
_NOT_KEPT = ("model", "runtime_dir", "keep_alive")


def _read_source(spec: str, what: str) -> str:
    """The text of `spec`: a file's path, or `-` for standard input."""
    if spec == "-":
        if sys.stdin.isatty():
            click.echo(f"reading {what} from standard input (end with Ctrl-D)", err=True)
        return sys.stdin.read()
    try:
        with open(spec, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {spec}: {e}", param_hint=what) from None


def _parse_ids(text: str | None) -> list[int] | None:
    """Token ids given inline (1,2,3), in a file (@FILE) or on standard input (-);
    separated by commas, spaces or newlines."""
    if text is None:
        return None
    if text == "-" or text.startswith("@"):
        text = _read_source("-" if text == "-" else text[1:], "--prompt-ids")
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(
            "expected token ids separated by commas or spaces, e.g. 1,2,3", param_hint="--prompt-ids"
        ) from None
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--prompt-ids")
    return ids


def _prompt_text(prompt: str | None, prompt_file: str | None, prompt_ids: str | None) -> str | None:
    """The text prompt from PROMPT (`-`: standard input) or --prompt-file; None with --prompt-ids."""
    given = [
        name
        for name, value in (("PROMPT", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids))
        if value is not None
    ]
    if not given:
        raise click.UsageError("give a PROMPT (`-` reads it from standard input), --prompt-file FILE or --prompt-ids")
    if len(given) > 1:
        raise click.UsageError(f"give one prompt: {' and '.join(given)} were both given")
    if prompt_file is not None:
        return _read_source(prompt_file, "--prompt-file")
    if prompt == "-":
        return _read_source("-", "PROMPT")
    return prompt


class PrefillProgress:
    """`prefill 2048/3000 tokens (68%), 41 s` on a terminal while a long prompt is read,
    cleared when the first token comes; silent where the output is not a terminal."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.on = out.isatty()
        self.tic = time.monotonic()
        self.shown = False

    def update(self, done: int, total: int, stage: str | None = None) -> None:
        if not self.on or total < 2:
            return
        pct = 100 * done // total
        what = "loading the model: step" if stage == "load" else "prefill"
        unit = "" if stage == "load" else " tokens"
        self.out.write(f"\r\033[K{what} {done}/{total}{unit} ({pct}%), {time.monotonic() - self.tic:.0f} s")
        self.out.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.out.write("\r\033[K")
            self.out.flush()
            self.shown = False


def _exits_quietly_on_ctrl_c(command: Callable[..., None]) -> Callable[..., None]:
    """Ctrl-C ends `command` as a shell's own commands end: status 130, no traceback, no
    "Aborted!" (what was cancelled has been cancelled by then)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except KeyboardInterrupt:
            sys.exit(130)

    return run


@click.command()
@click.argument("prompt", required=False)
@click.option(
    "--prompt-file",
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Read the prompt from a file (`-`: standard input).",
)
@click.option("--prompt-ids", help="Token ids instead of a text prompt: 1,2,3, @FILE, or - (standard input).")
@click.option("--local", is_flag=True, help="Run in this process instead of through the daemon.")
@setting_options(GENERATE, LOCAL)
@click.option(
    "--max-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(1, None),
    help="Most tokens to generate (fewer when the context runs out).",
)
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, None),
    help="Sampling temperature; below 0.001 is greedy (the likeliest token every time).",
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Sample from the likeliest tokens whose probabilities add up to this (1: all); below 1e-6 is greedy.",
)
@click.option("--seed", type=int, help="Random seed for sampling.")
@click.option(
    "--speculative",
    type=click.Choice(["mtp", "draft"]),
    help="Speculative decoding: the model's MTP head, or a draft model.",
)
@click.option(
    "--draft-tokens", type=click.IntRange(1, 8), help="Tokens drafted per round with --speculative (default 2)."
)
@click.option(
    "--draft-model",
    type=click.Path(file_okay=False),
    help="Draft model (store or mlx-lm folder) for --speculative draft.",
)
@click.option(
    "--diagnostics",
    is_flag=True,
    help="Add hot-path diagnostics (segment times, predictor recall, miss attribution) to the stats; without --json, "
    "a summary on stderr.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens and stats.")
@_exits_quietly_on_ctrl_c
def generate(
    prompt,
    prompt_file,
    prompt_ids,
    local,
    given,
    max_tokens,
    temp,
    top_p,
    seed,
    speculative,
    draft_tokens,
    draft_model,
    diagnostics,
    as_json,
) -> None:
    """Generate text for PROMPT, streaming it to stdout.

    PROMPT `-` reads the prompt from standard input (`cat notes.txt | moestreamctl
    generate -`), as does `--prompt-file -`; a long prompt shows its prefill's progress
    on a terminal. Ctrl-C cancels the request (the daemon stops it within a layer or a
    chunk of its prefill) and exits with status 130.
    """
    text = _prompt_text(prompt, prompt_file, prompt_ids)
    ids = _parse_ids(prompt_ids)
    if (speculative == "draft") != (draft_model is not None):
        raise click.UsageError("--speculative draft needs --draft-model PATH, and only it takes one")
    if draft_tokens is not None and speculative is None:
        raise click.UsageError("--draft-tokens needs --speculative")
    spec = dict(
        speculative=speculative,
        draft_tokens=draft_tokens,
        draft_model=os.path.abspath(draft_model) if draft_model else None,
    )
    settings = resolve_settings(given)
    capacity_note(settings)
    progress = PrefillProgress(sys.stderr)
    if not local:
        done = _generate_via_daemon(
            settings,
            given,
            text,
            ids,
            as_json,
            progress,
            dict(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed, diagnostics=diagnostics, **spec),
        )
        _report(done.text, done.tokens, done.stats, as_json, diagnostics)
        return
    if settings.model is None:
        raise click.UsageError("no built-in demo model: give --model STORE")
    store_option(settings.model)  # a wrong folder is a usage error naming --model
    try:
        use_kernel_cache(settings.kernel_cache_dir, os.environ, lambda why: click.echo(f"warning: {why}", err=True))
    except KernelCacheError as e:
        raise click.ClickException(str(e)) from None

    from ...daemon.model.generation import SamplingParams, encode_prompt
    from ...daemon.model.generation import generate as run
    from ...daemon.model.streaming_model import load_streaming_model
    from ...daemon.pool.expert_pool import PoolCapacityError
    from ...daemon.pool.expert_reader import ExpertReadError
    from ...shared.store_format import StoreError

    params = SamplingParams(
        max_tokens=max_tokens,
        temp=temp,
        top_p=top_p,
        seed=seed,
        diagnostics=diagnostics,
        **{**spec, "draft_tokens": draft_tokens or 2},
    )
    try:
        sm = load_streaming_model(settings.model, settings, max_tokens=max_tokens + 4096)
    except (StoreError, PoolCapacityError, ExpertReadError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    try:
        prompt_tokens = encode_prompt(sm, text, ids)

        def show(segment: str, _token: int) -> None:
            progress.clear()
            sys.stdout.write(segment)
            sys.stdout.flush()

        result = run(sm, prompt_tokens, params, on_text=None if as_json else show, on_prompt_progress=progress.update)
    except (ValueError, ExpertReadError, StoreError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        progress.clear()
        sm.close()
    if not as_json:
        sys.stdout.write("\n")
    _report(result.text, result.tokens, result.stats, as_json, diagnostics)


def _report(text: str, tokens: list[int], stats: RequestStats, as_json: bool, diagnostics: bool) -> None:
    """The JSON object, or (text already streamed) a diagnostics summary on stderr."""
    if as_json:
        click.echo(json.dumps({"text": text, "tokens": tokens, "stats": stats.to_dict()}))
        return
    if diagnostics:
        d = stats.diagnostics
        lines = diagnostics_lines(d) if d else ["diagnostics: none recorded for this request"]
        for line in lines:
            click.echo(line, err=True)


def _check_served_store(model: str, status: Status) -> None:
    """Refuse when the daemon serves another store than `model`. Stores are compared by
    their ids, not their paths: two copies of a store (the demo installed twice) are one."""
    served = status.model
    if not served:
        return
    wanted = store_option(model).store_id
    served_id = status.store_id
    if served_id is None:  # a daemon still loading does not know its store's id yet
        same = same_folder(model, served)  # by device and inode: ~/Models/X is ~/models/x on APFS
    else:
        same = served_id == wanted
    if not same:
        why = f" ({status.store_problem})" if status.store_problem else ""
        raise click.ClickException(
            f"the daemon serves the store {served} (id {served_id or 'not known yet'}), not {model} "
            f"(id {wanted}){why}: stop it (`moestreamctl stop`) or use --local"
        )


def _model_chosen(settings: Settings, given: dict) -> bool:
    """Whether the user chose the model (a flag, a variable, the config file): the built-in
    demo, the default when nothing is chosen, gives way to whatever a running daemon
    serves, so `start --model X` then a plain `generate` asks X."""
    if settings.model is None:
        return False
    return given.get("model") is not None or not same_folder(settings.model, demo_store_path())


def _generate_via_daemon(
    settings: Settings,
    given: dict,
    prompt: str | None,
    ids: list[int] | None,
    as_json: bool,
    progress: PrefillProgress,
    sampling: dict,
) -> Any:
    """Stream from the daemon, starting it first when none runs; returns the `Done` event.
    `given`: the settings given as options; a daemon started here gets those of its
    scope (GENERATE), not the --local ones."""
    from ..client import Client, ClientError, DaemonNotRunning, Progress, Token

    paths = runtime_paths(settings)
    try:
        client = Client(paths)
    except DaemonNotRunning:
        if settings.model is None:
            raise click.UsageError("no daemon is running: give --model STORE to start one, or use --local") from None
        store_option(settings.model)
        click.echo(f"moestream: no daemon running; starting one for {settings.model}", err=True)
        # Another invocation may be starting one this moment: then this one waits for it.
        start_daemon(settings, {d.name: given[d.name] for d in in_scope(GENERATE)}, join=True)
        client = Client(paths)
    with client:
        try:
            status = client.status()
        except ClientError as e:
            raise click.ClickException(str(e)) from None
        if _model_chosen(settings, given):
            _check_served_store(settings.model, status)
        if status.store_problem:
            click.echo(f"warning: {status.store_problem}", err=True)
        running = status.settings
        ignored = [
            definition(k).flag
            for k, v in given.items()
            if v is not None and k not in _NOT_KEPT and running.get(k) != definition(k).flag_value(getattr(settings, k))
        ]
        if ignored:
            click.echo(
                f"note: {', '.join(ignored)} ignored: the running daemon keeps its pool settings "
                "(`moestreamctl restart` with new flags changes them)",
                err=True,
            )
        stream = None
        shown = 0
        try:
            keep_alive = settings.keep_alive if given.get("keep_alive") is not None else None
            stream = client.generate(
                prompt,
                prompt_ids=ids,
                progress=progress.on,
                keep_alive=keep_alive,
                client="moestreamctl generate",
                **sampling,
            )
            for event in stream:
                if isinstance(event, Progress):
                    progress.update(event.done, event.total, event.stage)
                elif isinstance(event, Token) and not as_json:
                    progress.clear()
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                    shown += len(event.text)
        except KeyboardInterrupt:
            progress.clear()
            if shown and not as_json:
                sys.stdout.write("\n")
            if stream is not None and stream.done is None:
                try:
                    stream.abandon()  # the daemon has the cancel; its engine applies it
                except (ClientError, KeyboardInterrupt):
                    pass  # gone, or a second Ctrl-C: leave anyway
            raise
        except ClientError as e:
            raise click.ClickException(str(e)) from None
        finally:
            progress.clear()
    done = stream.done
    if not as_json:
        # Text held back for stop strings never came as a token event.
        sys.stdout.write(done.text[shown:] + "\n")
    return done
