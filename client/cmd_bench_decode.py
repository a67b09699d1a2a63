"""`moestreamctl bench decode`: stock mlx-lm vs moestream at each capacity vs naive reads."""

from __future__ import annotations

import json

import click


@click.command("decode")
@click.option("--model", "store", required=True, type=click.Path(file_okay=False), help="Expert store.")
@click.option("--capacity", "capacities", multiple=True, type=float, help="Pool fractions to measure (repeat); default 1.0 0.5 0.25.")
@click.option("--policy", default="lru", show_default=True)
@click.option("--prompt-tokens", default=32, show_default=True, type=click.IntRange(1, None))
@click.option("--decode-tokens", default=64, show_default=True, type=click.IntRange(1, None))
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(1, None), help="Interleaved timed runs; medians are reported.")
@click.option("--io-threads", default=4, show_default=True, type=click.IntRange(1, 256))
@click.option("--no-stock", is_flag=True, help="Skip stock mlx-lm (when all experts do not fit in memory).")
@click.option("--no-naive", is_flag=True, help="Skip the naive on-demand baseline.")
@click.option("--mlx-memory-limit", help="Cap MLX's memory (mx.set_memory_limit), e.g. 64G; advised on CUDA.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_decode(store, capacities, policy, prompt_tokens, decode_tokens, rounds, io_threads, no_stock, no_naive, mlx_memory_limit, as_json) -> None:
    """Decode tokens/s, hit rate, bytes read per token and the read-bandwidth bound,
    for stock mlx-lm, moestream at each capacity and the naive on-demand baseline."""
    from pathlib import Path

    from moestream.daemon.bench_decode import BenchDecodeSettings, format_report, run_bench_decode
    from moestream.daemon.expert_pool import PoolCapacityError
    from moestream.shared.settings import parse_size
    from moestream.shared.store_format import StoreError

    settings = BenchDecodeSettings(
        store=Path(store),
        capacities=tuple(capacities) or (1.0, 0.5, 0.25),
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        rounds=rounds,
        policy=policy,
        io_threads=io_threads,
        stock=not no_stock,
        naive=not no_naive,
        mlx_memory_limit=parse_size(mlx_memory_limit) if mlx_memory_limit else None,
    )
    try:
        report = run_bench_decode(settings)
    except (StoreError, PoolCapacityError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_report(report))
