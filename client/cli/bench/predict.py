"""`moestreamctl bench predict`: predictor recall and decode speed with prefetch off/on."""

from __future__ import annotations

import json

import click

from ....daemon.bench.common import default_of
from ..values import StorePath
from .options import knob_option, size_option


@click.command("predict")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option(
    "--capacity",
    "capacities",
    multiple=True,
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="Pool fractions to measure (repeat); default 0.25 0.5.",
)
@knob_option("policy")
@click.option("--prompt-tokens", default=32, show_default=True, type=click.IntRange(1, None))
@click.option("--decode-tokens", default=64, show_default=True, type=click.IntRange(1, None))
@click.option(
    "--rounds",
    default=3,
    show_default=True,
    type=click.IntRange(1, None),
    help="Blocks of four decodes, prefetch off / on / on / off (one round: a single off and on); medians and the "
    "ratio per block are reported.",
)
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option("--host-cache", help="Size of a host-RAM tier (e.g. 20G) under the pool; default none.")
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, None),
    help="0 decodes greedily; > 0 samples (same seed everywhere).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--depth",
    default=default_of("prefetch_depth"),
    show_default=True,
    type=click.IntRange(1, 4),
    help="MoE layers ahead whose predicted experts the slot pool's prefetch reads (setting prefetch_depth).",
)
@click.option(
    "--prefetch-buffer",
    help="Host memory for the slot pool's prefetch buffer, e.g. 4G (setting prefetch_buffer); default 16 x top-k "
    "experts per layer of depth.",
)
@click.option("--mlx-memory-limit", help="Cap MLX's memory (mx.set_memory_limit), e.g. 64G; advised on CUDA.")
@knob_option("copy_kernel")
@knob_option("prefetch_copy_blocks")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_predict(
    store,
    capacities,
    policy,
    prompt_tokens,
    decode_tokens,
    rounds,
    io_threads,
    host_cache,
    temp,
    seed,
    depth,
    prefetch_buffer,
    mlx_memory_limit,
    copy_kernel,
    prefetch_copy_blocks,
    as_json,
) -> None:
    """Recall of the next-layer predictor at top-k, 2k and 4k, and decode tokens/s with
    prefetch off and on (and what `--prefetch auto` decides) at each capacity."""
    from pathlib import Path

    from ....daemon.bench.predict import BenchPredictSettings, format_report, run_bench_predict
    from ....daemon.pool.expert_pool import PoolCapacityError
    from ....shared.settings import SettingsError
    from ....shared.store_format import StoreError

    memory_limit = size_option(mlx_memory_limit, "--mlx-memory-limit")
    host_bytes = size_option(host_cache, "--host-cache") or 0
    buffer_bytes = size_option(prefetch_buffer, "--prefetch-buffer") or 0
    settings = BenchPredictSettings(
        store=Path(store),
        capacities=tuple(capacities) or (0.25, 0.5),
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        rounds=rounds,
        policy=policy,
        io_threads=io_threads,
        host_cache=host_bytes,
        temp=temp,
        seed=seed,
        depth=depth,
        prefetch_buffer=buffer_bytes,
        mlx_memory_limit=memory_limit,
        copy_kernel=copy_kernel,
        prefetch_copy_blocks=prefetch_copy_blocks,
    )
    try:
        report = run_bench_predict(settings, progress=lambda line: click.echo(line, err=True))
    except (StoreError, PoolCapacityError, SettingsError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
