"""`moestreamctl bench decode`: stock mlx-lm vs moestream at each capacity vs naive reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from ....daemon.bench.common import default_of
from ..values import StorePath
from .options import knob_option, size_option


@click.command("decode")
@click.option("--model", "store", required=True, type=StorePath(), help=StorePath.HELP)
@click.option(
    "--capacity",
    "capacities",
    multiple=True,
    type=float,
    help="Pool fractions to measure (repeat); default 1.0 0.5 0.25.",
)
@knob_option("policy")
@click.option("--prompt-tokens", default=32, show_default=True, type=click.IntRange(1, None))
@click.option("--decode-tokens", default=64, show_default=True, type=click.IntRange(1, None))
@click.option(
    "--rounds",
    default=3,
    show_default=True,
    type=click.IntRange(1, None),
    help="Interleaved timed runs; medians are reported.",
)
@click.option(
    "--warmup-rounds",
    default=1,
    show_default=True,
    type=click.IntRange(1, None),
    help="Untimed runs of every configuration first (more let a mapped pool rebalance before timing).",
)
@click.option(
    "--min-round-seconds",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, 600),
    help="Repeat each configuration's decode within a round until this many seconds of decoding have passed (0: "
    "once); steadies the fast configurations on a noisy machine.",
)
@click.option(
    "--paired-blocks",
    default=0,
    show_default=True,
    type=click.IntRange(0, 1000),
    help="After the rounds, time stock against each 100% configuration in this many blocks of four decodes, A B B A, "
    "which cancel a drift of the machine's speed; reports the ratio's median and 95% interval (0: off, else at "
    "least 2).",
)
@click.option(
    "--checksums",
    is_flag=True,
    help="Also time each partial slot pool with every expert read verified against its checksum (the bench knob "
    "verify_checksums, '+crc'), and with --paired-blocks against the same pool without, A B B A.",
)
@click.option(
    "--per-layer",
    is_flag=True,
    help="Also time each partial slot pool with a host sync at every MoE layer (':per-layer') instead of a check "
    "every few layers, and with --paired-blocks against the same pool checking every few, A B B A.",
)
@click.option(
    "--generation-loop",
    is_flag=True,
    help="Also time each streaming configuration through the daemon's own generation loop (in process): what a "
    "client of the daemon gets, against the bench's tight loop.",
)
@click.option(
    "--constrained",
    is_flag=True,
    help="Also time each streaming configuration's cost of structured output: a json_schema request against the "
    "same request unconstrained, through the daemon's generation loop, side by side in every round.",
)
@click.option("--io-threads", default=default_of("io_threads"), show_default=True, type=click.IntRange(1, 256))
@click.option("--no-stock", is_flag=True, help="Skip stock mlx-lm (when all experts do not fit in memory).")
@click.option("--no-naive", is_flag=True, help="Skip the naive on-demand baseline.")
@click.option(
    "--no-slot-pool",
    is_flag=True,
    help="Skip the plain slot pool at each capacity (keep its '+host' and '+mapped' variants).",
)
@click.option("--mlx-memory-limit", help="Cap MLX's memory (mx.set_memory_limit), e.g. 64G; advised on CUDA.")
@click.option(
    "--host-cache",
    help="Size of a host-RAM tier (e.g. 20G): adds a '+host' run per partial capacity, made as the daemon makes it "
    "(a tier that holds every expert is a mapped pool on NVIDIA GPUs, with the slot pool's tier beside it as "
    "'+host:slots').",
)
@click.option(
    "--host-tier",
    type=click.Choice(["auto", "mapped", "slots"]),
    default="auto",
    show_default=True,
    help="With --host-cache: make the '+host' runs as the daemon would (auto), as mapped pools (the tier must hold "
    "every expert; '+host:slots' beside them), or as slot pools with the tier.",
)
@click.option(
    "--temp",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0, None),
    help="0 decodes greedily; > 0 samples (same seed for every configuration).",
)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--fresh-text",
    is_flag=True,
    help="With --temp > 0: every decode samples new text (the n-th decode of a round seeds with the round's seed + "
    "n, the same for every configuration), so that a partial pool meets routing it has not seen, as `plan` "
    "forecasts; without it every decode repeats one text, whose experts a pool keeps.",
)
@click.option(
    "--mapped",
    is_flag=True,
    help="Also run a '+mapped' configuration per partial capacity: every expert addressable, the hottest in GPU "
    "memory, the rest read over the link (NVIDIA GPUs).",
)
@click.option(
    "--mapped-rebalance-tokens",
    default=default_of("mapped_rebalance_tokens"),
    show_default=True,
    type=click.IntRange(0, None),
    help="With --mapped (and a mapped '+host'): tokens between rebalances (each layer's most routed experts into GPU "
    "memory); 0 never.",
)
@click.option(
    "--mapped-gather",
    type=click.Choice(["auto", "off", "on", "both"]),
    default="auto",
    show_default=True,
    help="With --mapped (and a mapped '+host'): decode steps copy the routed experts into a stack in GPU memory "
    "first (setting mapped_gather; auto: where MLX's CUDA build runs); 'both' runs each '+mapped' configuration "
    "both ways (':g' marks gathering).",
)
@knob_option("prefetch_copy_blocks")
@click.option(
    "--prefetch",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="Prefetch of the predicted next-layer experts in the partial slot-pool runs (with a host tier: "
    "copied into the next layer's slots while the GPU computes); mapped pools have no prefetch.",
)
@knob_option("copy_kernel")
@click.option(
    "--speculative",
    type=click.Choice(["mtp", "draft"]),
    help="Instead: speculative vs plain decode at each capacity (default 1.0 0.25).",
)
@click.option(
    "--draft-tokens",
    "draft_tokens",
    multiple=True,
    type=click.IntRange(1, 8),
    help="K per round with --speculative (repeat); default 2.",
)
@click.option("--draft-model", type=click.Path(file_okay=False), help="Draft model for --speculative draft.")
@click.option(
    "--forecast/--no-forecast",
    default=True,
    show_default=True,
    help="Print `moestreamctl plan`'s forecast beside each streaming configuration's measurement.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def bench_decode(
    store,
    capacities,
    policy,
    prompt_tokens,
    decode_tokens,
    rounds,
    warmup_rounds,
    min_round_seconds,
    paired_blocks,
    checksums,
    per_layer,
    generation_loop,
    constrained,
    io_threads,
    no_stock,
    no_naive,
    no_slot_pool,
    mlx_memory_limit,
    host_cache,
    host_tier,
    temp,
    seed,
    fresh_text,
    mapped,
    mapped_rebalance_tokens,
    mapped_gather,
    prefetch_copy_blocks,
    prefetch,
    copy_kernel,
    speculative,
    draft_tokens,
    draft_model,
    forecast,
    as_json,
) -> None:
    """Decode tokens/s, hit rates, bytes moved per token per tier, admission GB/s and
    the bandwidth bound, for stock mlx-lm, moestream at each capacity (with and without
    the host-RAM tier) and the naive on-demand baseline."""
    if speculative is not None or draft_tokens or draft_model:
        _bench_speculative(
            store,
            speculative,
            draft_tokens,
            draft_model,
            capacities,
            policy,
            decode_tokens,
            rounds,
            io_threads,
            mlx_memory_limit,
            as_json,
        )
        return

    from ....daemon.bench.decode import BenchDecodeSettings, format_report, run_bench_decode
    from ....daemon.pool.expert_pool import PoolCapacityError
    from ....shared.settings import Settings, SettingsError
    from ....shared.store_format import StoreError

    if paired_blocks == 1:
        raise click.BadParameter("0 (off) or at least 2, for an interval", param_hint="--paired-blocks")
    memory_limit = size_option(mlx_memory_limit, "--mlx-memory-limit")
    host_bytes = size_option(host_cache, "--host-cache") or 0
    settings = BenchDecodeSettings(
        store=Path(store),
        capacities=tuple(capacities) or (1.0, 0.5, 0.25),
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        rounds=rounds,
        warmup_rounds=warmup_rounds,
        min_round_seconds=min_round_seconds,
        generation_loop=generation_loop,
        constrained=constrained,
        paired_blocks=paired_blocks,
        checksums=checksums,
        per_layer=per_layer,
        policy=policy,
        io_threads=io_threads,
        stock=not no_stock,
        naive=not no_naive,
        slot_pool=not no_slot_pool,
        mlx_memory_limit=memory_limit,
        host_cache=host_bytes,
        host_tier=host_tier,
        temp=temp,
        seed=seed,
        fresh_text=fresh_text,
        mapped=mapped,
        prefetch=prefetch,
        mapped_rebalance_tokens=mapped_rebalance_tokens,
        mapped_gather={"auto": (None,), "off": (False,), "on": (True,), "both": (False, True)}[mapped_gather],
        prefetch_copy_blocks=prefetch_copy_blocks,
        copy_kernel=copy_kernel,
    )
    compute = pools = None
    on_loaded = None
    try:
        if forecast:
            from ....daemon.bench.decode import pool_configs, probe_store

            click.echo("probing compute and pools for the forecast", err=True)
            compute, pools = probe_store(
                Path(store),
                pool_configs(settings),
                Settings(
                    policy=policy,
                    io_threads=io_threads,
                    prefetch=prefetch,
                    copy_kernel=copy_kernel,
                    prefetch_copy_blocks=prefetch_copy_blocks,
                    mapped_rebalance_tokens=mapped_rebalance_tokens,
                ),
            )
            on_loaded = _early_forecast(Path(store), io_threads, host_bytes, compute, pools)
        report = run_bench_decode(settings, progress=lambda line: click.echo(line, err=True), on_loaded=on_loaded)
    except (StoreError, PoolCapacityError, SettingsError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    text = format_report(report)
    if compute is not None:
        from ....daemon.bench.decode import decode_forecasts, format_decode_forecasts

        report["forecast_compute"] = compute.to_dict()
        report["forecast_pools"] = [p.to_dict() for p in pools.values()]
        report["forecast"] = decode_forecasts(report, compute, pools)
        text += "\n" + format_decode_forecasts(report["forecast"])
    click.echo(json.dumps(report) if as_json else text)


def _early_forecast(store: Path, io_threads: int, host: int, compute: Any, pools: Any) -> Callable[[list[dict]], None]:
    """What prints the forecast of every configuration once they are loaded, before any
    is timed, with bandwidths probed now (the report's own forecast, at the end, takes
    the run's, probed after its rounds): a run cut short still shows what was forecast."""
    from ....daemon.bench.decode import config_plans, format_forecast_lines, format_read_and_link
    from ....daemon.planning.plan import probe_bandwidths

    click.echo("probing the store's reads and the host->pool link for the forecast", err=True)
    bw = probe_bandwidths(store, io_threads)
    click.echo(
        format_read_and_link(bw.read_bytes_per_s, dict(bw.read_by_batch), bw.link_kind, bw.link_bytes_per_s), err=True
    )

    def show(rows: list[dict]) -> None:
        for line in format_forecast_lines(config_plans(store, rows, bw, host, compute, pools)):
            click.echo(line, err=True)

    return show


def _bench_speculative(
    store,
    mode,
    draft_tokens,
    draft_model,
    capacities,
    policy,
    decode_tokens,
    rounds,
    io_threads,
    mlx_memory_limit,
    as_json,
) -> None:
    """`--speculative`: acceptance, experts read per token and tokens/s against plain decode."""
    from ....daemon.bench.speculative import (
        BenchSpeculativeSettings,
        format_speculative_report,
        run_bench_speculative,
    )
    from ....daemon.pool.expert_pool import PoolCapacityError
    from ....shared.store_format import StoreError

    if mode is None:
        raise click.UsageError("--draft-tokens and --draft-model go with --speculative")
    if (mode == "draft") != (draft_model is not None):
        raise click.UsageError("--speculative draft needs --draft-model PATH, and only it takes one")
    memory_limit = size_option(mlx_memory_limit, "--mlx-memory-limit")
    settings = BenchSpeculativeSettings(
        store=Path(store),
        mode=mode,
        draft_tokens=tuple(draft_tokens) or (2,),
        draft_model=draft_model,
        capacities=tuple(capacities) or (1.0, 0.25),
        decode_tokens=decode_tokens,
        rounds=rounds,
        policy=policy,
        io_threads=io_threads,
        mlx_memory_limit=memory_limit,
    )
    try:
        report = run_bench_speculative(settings)
    except (StoreError, PoolCapacityError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps(report) if as_json else format_speculative_report(report))
