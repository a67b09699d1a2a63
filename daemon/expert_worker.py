"""A follower rank of an expert-parallel daemon (`--distributed`, docs/scale-out.md).

`mlx.launch` starts the daemon once per rank; rank 0 serves the socket and runs every
forward, and each other rank runs this loop instead: it loads its share of the store
(its pools hold only the experts e % N == rank, read from its own store copy) and, for
each MoE layer rank 0 reaches, takes the layer's input and routing, computes the rows of
the pairs it owns and joins the all_sum (`ExpertShare.follow`). It has no socket and no
requests of its own; it keeps the heat of its own experts (daemon/heat.py: a warm start
from its own file, counts to a heat keeper of its own, pushed between rank 0's commands,
which come at least every few seconds: rank 0's status asks every rank for its row). It
ends when rank 0 says STOP (after a final write of its heat), or when the group fails
(rank 0 gone: the collective raises).
"""

from __future__ import annotations

import logging

from ..shared.settings import Settings
from .heat import Heat, state_code
from .model.expert_parallel import FORWARD, STATS, STOP, ExpertShare


def share_row(sm, heat: Heat | None = None) -> list[int]:
    """This rank's STAT_FIELDS (daemon/model/expert_parallel.py), for rank 0's status;
    without `heat` (a benchmark's group keeps none), its heat fields say off."""
    stats = sm.pool_stats()
    hits = stats.hits_prefill + stats.hits_decode
    misses = stats.misses_prefill + stats.misses_decode
    experts = sum(p.layer.num_experts for p in sm.pools)
    layers = stats.layers
    pool = [sm.capacity, sum(lay.resident for lay in layers), sum(lay.pinned for lay in layers)]
    heat_row = heat.summary() if heat is not None else [state_code("off"), 0, 0, 0, 0]
    return [stats.bytes_read, hits, misses, experts, sm.pool_bytes, sm.share.stats.collectives, *pool, *heat_row]


def serve_share(settings: Settings, share: ExpertShare, log: logging.Logger, *, keep_heat: bool = True) -> int:
    """Follow rank 0's forwards until it stops; returns the exit code. `keep_heat` False (a
    benchmark's group): no warm start, no heat file and no keeper or sockets."""
    import mlx.core as mx

    from .model.streaming_model import load_streaming_model
    from .model.streaming_moe import StreamingMoE

    if settings.model is None:
        log.error("rank %d: no model: give --model STORE", share.rank)
        return 2
    sm = load_streaming_model(settings.model, settings, max_tokens=None, share=share)
    heat = Heat(settings, log, share) if keep_heat else None
    layers = {m.ordinal: m for _, m in sm.model.named_modules() if isinstance(m, StreamingMoE)}
    log.info(
        "rank %d of %d: serving experts e %% %d == %d of %d MoE layers, %d slots each",
        share.rank,
        share.size,
        share.size,
        share.rank,
        len(layers),
        sm.capacity,
    )
    forwards = 0
    try:
        if heat is not None:
            heat.pin(sm)
            heat.start(sm)
        share.barrier()  # rank 0 has loaded too: its commands may come from now on
        while True:
            cmd = share.follow()
            if cmd.op == STOP:
                log.info("rank %d: stopped by rank 0 after %d forwards", share.rank, forwards)
                return 0
            if cmd.op == STATS:
                share.gather_stats(share_row(sm, heat))
            elif cmd.op == FORWARD:
                mx.eval(layers[cmd.ordinal](cmd.x, cmd.indices))
                forwards += 1
            else:
                log.error("rank %d: unknown command %d from rank 0", share.rank, cmd.op)
                return 1
            if heat is not None:
                heat.tick(sm)
    finally:
        try:
            if heat is not None:
                heat.close(sm)
        finally:
            sm.close()
