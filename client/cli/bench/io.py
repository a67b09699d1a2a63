"""`moestreamctl bench io`: the native read engine against fio."""

from __future__ import annotations

import json

import click

from ..values import StorePath


@click.command("io")
@click.option("--store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option("--threads", default=4, show_default=True, type=int, help="Engine threads = fio jobs.")
@click.option("--samples", default=256, show_default=True, type=int, help="Expert reads per run.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random expert choice.")
@click.option("--rounds", default=3, show_default=True, type=int, help="Interleaved runs of each side.")
@click.option(
    "--huge-pages/--no-huge-pages",
    default=True,
    show_default=True,
    help="Engine staging buffers on transparent huge pages (Linux); off is like fio.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_io(store: str, threads: int, samples: int, seed: int, rounds: int, huge_pages: bool, as_json: bool) -> None:
    """Read a random sample of experts through the engine and through fio.

    Both read whole experts at random expert offsets with direct I/O: the engine with
    THREADS threads, fio with THREADS psync jobs and the same block size. Reports the
    medians of interleaved runs: GB/s of each, engine/fio, read latency percentiles.
    Needs fio (`apt-get install fio` / `brew install fio`).
    """
    from pathlib import Path

    from ....daemon.bench.io import BenchIOError, BenchIOSettings, format_report, run_bench_io
    from ....shared.store_format import StoreError

    settings = BenchIOSettings(
        store=Path(store), threads=threads, samples=samples, seed=seed, rounds=rounds, huge_pages=huge_pages
    )
    try:
        report = run_bench_io(settings)
    except (BenchIOError, StoreError) as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:
        raise click.ClickException(f"cannot read the store: {e}") from e
    click.echo(json.dumps(report) if as_json else format_report(report))
