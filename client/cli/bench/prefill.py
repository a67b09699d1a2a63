"""`moestreamctl bench prefill`: time to the first token of long prompts, stock vs moestream."""

from __future__ import annotations

import json
import sys

import click

from ....daemon.bench.common import default_of
from ..values import StorePath, store_option
from .options import size_option


@click.command("prefill")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option(
    "--prompt-tokens",
    "prompt_tokens",
    multiple=True,
    type=click.IntRange(2, None),
    help="Prompt lengths to time (repeat); default 512 2048 8192.",
)
@click.option(
    "--capacity",
    "capacities",
    multiple=True,
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="Partial pool fractions to measure besides 100% (repeat); default 0.25.",
)
@click.option(
    "--host-cache",
    help="Also each partial pool with a host-RAM tier of this size (e.g. 20G), made as the daemon makes it: a mapped "
    "pool on an NVIDIA GPU where the tier holds every expert.",
)
@click.option("--chunked", is_flag=True, help="Also each partial pool in stock's chunk order (prefill = chunk).")
@click.option("--no-stock", is_flag=True, help="Skip stock mlx-lm (then no bound is computed).")
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option(
    "--prefill-step",
    default=2048,
    show_default=True,
    type=click.IntRange(1, None),
    help="mlx-lm's prefill step for stock and moestream alike (smaller: a short prompt takes several chunks).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random prompts.")
@click.option("--mlx-memory-limit", help="mx.set_memory_limit for the run (e.g. 120G).")
@click.option(
    "--runs",
    default=1,
    show_default=True,
    type=click.IntRange(1, 20),
    help="Timed runs per prompt; the last is reported (a GPU may compile kernels in the first).",
)
@click.option(
    "--warmup-tokens",
    default=64,
    show_default=True,
    type=click.IntRange(2, None),
    help="Length of each configuration's untimed first prompt.",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False),
    help="Also write the JSON report here, after each configuration (a run cut short keeps what it measured).",
)
@click.option(
    "--forecast/--no-forecast",
    default=True,
    show_default=True,
    help="Print `moestreamctl plan`'s forecast time to first token beside each streaming measurement.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_prefill(
    store,
    prompt_tokens,
    capacities,
    host_cache,
    chunked,
    no_stock,
    io_threads,
    prefill_step,
    seed,
    mlx_memory_limit,
    runs,
    warmup_tokens,
    out_file,
    forecast,
    as_json,
) -> None:
    """Time to the first token of prompts of each length: stock mlx-lm, every expert
    resident, and each partial pool, side by side, with the bytes each read and the
    bound (stock's time plus the minimum bytes over the measured bandwidth)."""
    from pathlib import Path

    from ....daemon.bench.prefill import BenchPrefillSettings, format_report, run_bench_prefill

    store_option(store)
    settings = BenchPrefillSettings(
        store=Path(store),
        prompt_tokens=tuple(prompt_tokens) or BenchPrefillSettings.prompt_tokens,
        capacities=tuple(capacities) or BenchPrefillSettings.capacities,
        host_cache=size_option(host_cache, "--host-cache") or 0,
        chunked=chunked,
        stock=not no_stock,
        io_threads=io_threads,
        prefill_step=prefill_step,
        runs=runs,
        warmup_tokens=warmup_tokens,
        seed=seed,
        mlx_memory_limit=size_option(mlx_memory_limit, "--mlx-memory-limit"),
    )

    command = " ".join(["moestreamctl", *sys.argv[1:]])

    def save(report: dict) -> None:
        report.setdefault("command", command)
        if out_file:
            Path(out_file).write_text(json.dumps(report, indent=1))

    compute = None
    if forecast:
        from ....daemon.bench.decode import probe_store

        click.echo("probing compute for the forecast", err=True)
        compute, _ = probe_store(Path(store))
    report = run_bench_prefill(settings, progress=lambda line: click.echo(line, err=True), on_config=save)
    report.setdefault("command", command)
    text = format_report(report)
    if compute is not None:
        from ....daemon.bench.prefill import format_prefill_forecasts, prefill_forecasts

        report["forecast_compute"] = compute.to_dict()
        report["forecast"] = prefill_forecasts(report, compute)
        save(report)
        text += "\n" + format_prefill_forecasts(report["forecast"])
    click.echo(json.dumps(report) if as_json else text)
