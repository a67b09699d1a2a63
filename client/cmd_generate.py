"""`moestreamctl generate`: stream text from a model."""

from __future__ import annotations

import json
import os
import sys

import click

from moestream.client.cli_values import store_option
from moestream.shared.settings import Settings, SettingsError


def _parse_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise click.BadParameter("expected comma-separated token ids, e.g. 1,2,3", param_hint="--prompt-ids") from None


@click.command()
@click.argument("prompt", required=False)
@click.option("--model", "model", type=click.Path(file_okay=False), help="Expert store (made by `moestreamctl convert`).")
@click.option("--local", is_flag=True, help="Run in this process instead of through the daemon.")
@click.option("--prompt-ids", help="Token ids instead of a text prompt, e.g. 1,2,3.")
@click.option("--capacity", help="Pool slots per MoE layer (16) or a fraction of its experts (0.25, 25%).")
@click.option("--memory-budget", help="Size the pool so that weights + pool + KV cache fit, e.g. 24G.")
@click.option("--policy", help="Eviction policy (see `moestreamctl bench policy`).")
@click.option("--host-cache", help="Host RAM that caches experts between the store and the pool, e.g. 32G.")
@click.option("--mapped/--no-mapped", default=None, help="A mapped pool: every expert in host RAM, --capacity/--memory-budget of them per layer in GPU memory (NVIDIA GPUs). Default auto: mapped where host RAM holds every expert and no --host-cache is given.")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1, None))
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0.0, None), help="Sampling temperature; 0 is greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0))
@click.option("--seed", type=int, help="Random seed for sampling.")
@click.option("--io-threads", type=int, help="Threads of the native read engine.")
@click.option("--speculative", type=click.Choice(["mtp", "draft"]), help="Speculative decoding: the model's MTP head, or a draft model.")
@click.option("--draft-tokens", type=click.IntRange(1, 8), help="Tokens drafted per round with --speculative (default 2).")
@click.option("--draft-model", type=click.Path(file_okay=False), help="Draft model (store or mlx-lm folder) for --speculative draft.")
@click.option("--diagnostics", is_flag=True, help="Add hot-path diagnostics (segment times, predictor recall, miss attribution) to the stats.")
@click.option("--prefetch", type=click.Choice(["on", "off", "auto"]), help="Prefetch of predicted experts (--local; a daemon keeps its own).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, tokens and stats.")
def generate(prompt, model, local, prompt_ids, capacity, memory_budget, policy, host_cache, mapped, max_tokens, temp, top_p, seed, io_threads,
             speculative, draft_tokens, draft_model, diagnostics, prefetch, as_json) -> None:
    """Generate text for PROMPT, streaming it to stdout."""
    ids = _parse_ids(prompt_ids)
    if prompt is None and ids is None:
        raise click.UsageError("give a PROMPT or --prompt-ids")
    if (speculative == "draft") != (draft_model is not None):
        raise click.UsageError("--speculative draft needs --draft-model PATH, and only it takes one")
    if draft_tokens is not None and speculative is None:
        raise click.UsageError("--draft-tokens needs --speculative")
    spec = dict(speculative=speculative, draft_tokens=draft_tokens,
                draft_model=os.path.abspath(draft_model) if draft_model else None)
    try:
        settings = Settings.resolve(
            {"model": model, "capacity": capacity, "memory_budget": memory_budget, "policy": policy, "host_cache": host_cache, "mapped": mapped,
             "io_threads": io_threads, "prefetch": prefetch}
        )
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    if not local:
        given = {"model": model, "capacity": capacity, "memory_budget": memory_budget, "policy": policy, "host_cache": host_cache, "mapped": mapped,
                 "io_threads": io_threads}
        _generate_via_daemon(settings, given, prompt, ids, as_json,
                             dict(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed, diagnostics=diagnostics, **spec))
        return
    if settings.model is None:
        raise click.UsageError("no built-in demo model yet: give --model STORE")

    from moestream.daemon.expert_pool import PoolCapacityError
    from moestream.daemon.expert_reader import ExpertReadError
    from moestream.daemon.generation import SamplingParams, encode_prompt, generate as run
    from moestream.daemon.store.loader import load_streaming_model
    from moestream.shared.store_format import StoreError

    params = SamplingParams(max_tokens=max_tokens, temp=temp, top_p=top_p, seed=seed, diagnostics=diagnostics,
                            **{**spec, "draft_tokens": draft_tokens or 2})
    try:
        sm = load_streaming_model(settings.model, settings, max_tokens=max_tokens + 4096)
    except (StoreError, PoolCapacityError, ExpertReadError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    try:
        prompt_tokens = encode_prompt(sm, prompt, ids)

        def show(segment: str, _token: int) -> None:
            sys.stdout.write(segment)
            sys.stdout.flush()

        result = run(sm, prompt_tokens, params, on_text=None if as_json else show)
    except (ValueError, ExpertReadError, StoreError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        sm.close()
    if as_json:
        click.echo(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats}))
    else:
        sys.stdout.write("\n")


def _check_served_store(model: str, status: dict) -> None:
    """Refuse when the daemon serves another store than `model`. Stores are compared by
    their ids, not their paths: two copies of a store (the demo installed twice) are one."""
    served = status.get("model")
    if not served:
        return
    wanted = store_option(model).store_id
    served_id = status.get("store_id")
    if served_id is None:  # a daemon still loading does not know its store's id yet
        same = os.path.realpath(model) == os.path.realpath(served)
    else:
        same = served_id == wanted
    if not same:
        why = f" ({status['store_problem']})" if status.get("store_problem") else ""
        raise click.ClickException(
            f"the daemon serves the store {served} (id {served_id or 'not known yet'}), not {model} "
            f"(id {wanted}){why}: stop it (`moestreamctl stop`) or use --local"
        )


def _generate_via_daemon(settings: Settings, given: dict, prompt: str | None, ids: list[int] | None, as_json: bool, sampling: dict) -> None:
    """Stream from the daemon, starting it first when none runs."""
    from moestream.client.client import Client, ClientError, DaemonNotRunning, Token
    from moestream.client.cmd_daemon import start_daemon
    from moestream.shared.runtime_dir import RuntimeDirError, RuntimePaths

    try:
        paths = RuntimePaths.from_settings(settings)
        paths.check_socket_path()
    except RuntimeDirError as e:
        raise click.ClickException(str(e)) from None
    try:
        client = Client(paths)
    except DaemonNotRunning:
        if settings.model is None:
            raise click.UsageError("no daemon is running: give --model STORE to start one, or use --local") from None
        click.echo(f"moestream: no daemon running; starting one for {settings.model}", err=True)
        start_daemon(settings, given)
        client = Client(paths)
    with client:
        try:
            status = client.status()
        except ClientError as e:
            raise click.ClickException(str(e)) from None
        if settings.model is not None:
            _check_served_store(settings.model, status)
        if status.get("store_problem"):
            click.echo(f"warning: {status['store_problem']}", err=True)
        ignored = [f"--{k.replace('_', '-')}" for k in ("capacity", "memory_budget", "policy", "host_cache", "mapped", "io_threads")
                   if given.get(k) is not None and status.get("settings", {}).get(k) != getattr(settings, k)]
        if ignored:
            click.echo(f"note: {', '.join(ignored)} ignored: the running daemon keeps its pool settings "
                       "(`moestreamctl restart` with new flags changes them)", err=True)
        stream = None
        shown = 0
        try:
            stream = client.generate(prompt, prompt_ids=ids, **sampling)
            for event in stream:
                if isinstance(event, Token) and not as_json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                    shown += len(event.text)
        except KeyboardInterrupt:
            if stream is not None and stream.done is None:
                stream.close()
            raise
        except ClientError as e:
            raise click.ClickException(str(e)) from None
    done = stream.done
    if as_json:
        click.echo(json.dumps({"text": done.text, "tokens": done.tokens, "stats": done.stats}))
    else:
        # Text held back for stop strings never came as a token event.
        sys.stdout.write(done.text[shown:] + "\n")
