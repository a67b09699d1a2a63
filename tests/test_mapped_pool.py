"""The mapped pool (daemon/mapped/mapped_pool.py): every expert addressable, a placement of the
hottest in GPU memory. Here (CPU) nothing moves; the output and the bookkeeping are
what can be checked: exact tokens, no host sync per layer, placements within budget."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import make_tiny_model

from moestream.daemon.mapped.mapped_pool import CountingMover, MappedPool, _runs
from moestream.daemon.mapped.row_gather import MAX_GATHERED, RowGather
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.daemon.pool.resident_routing import READBACK_LAG
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings, SettingsError

STEPS = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mapped")
    src = make_tiny_model(root / "model", "qwen3_moe", quant="4bit", seed=5)
    convert_model(src, root / "store")
    return root / "store"


def decode(model, steps: int, tick=None) -> list[int]:
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.arange(20)[None] % 300, cache=cache)[:, -1, :], axis=-1)
    out = []
    for _ in range(steps):
        next_y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(next_y)
        out.append(int(y.item()))
        if tick is not None:
            tick()
        y = next_y
    return out


def rebalance(placement: MappedPool) -> None:
    """Set each layer's GPU share to its most routed experts now (after the worker's
    turns so far); returns when the moves are queued."""
    placement.drain()
    spans = placement._rebalance_spans()
    if spans:
        placement.mover.place_many(spans, False, False)


def test_runs_split_flags_into_maximal_runs():
    assert _runs(np.array([True, True, False, True])) == [(0, 2, True), (2, 3, False), (3, 4, True)]
    assert _runs(np.array([False])) == [(0, 1, False)]


def test_mapped_pool_is_exact_syncs_never_and_keeps_its_budget(store):
    want = decode(load_stock_model(store), STEPS)
    # Rebalancing soon and often, so that experts move while it decodes.
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=8), mapped=True)
    try:
        placement = sm.mapped_pool
        assert isinstance(placement.mover, CountingMover)  # no CUDA here
        slots = placement.gpu_slots
        experts = sm.pools[0].layer.num_experts
        assert slots == max(sm.pools[0].top_k, int(np.ceil(0.25 * experts)))
        assert all(p.fully_resident and p.capacity == experts for p in sm.pools)
        assert all(len(s) == slots for s in placement.on_gpu), "initial placement fills the budget"

        got = decode(sm.model, STEPS, placement.tick)
        assert got == want
        placement.drain()
        stats = sm.pool_stats()
        assert stats.host_syncs == 0, "a mapped pool never syncs per layer"
        p = stats.mapped_pool
        top_k, layers = sm.pools[0].top_k, len(sm.pools)
        # Routing is read two forwards late: the prefill and all but the last two decode steps.
        assert p["routed"] >= (STEPS - READBACK_LAG) * top_k * layers
        assert 0 < p["routed_on_gpu"] < p["routed"]
        assert p["moves"] > 0 and placement.mover.calls == p["place_calls"]
        assert all(len(s) <= slots for s in placement.on_gpu)
        assert all(len(pool.route_log) <= READBACK_LAG for pool in sm.pools)
    finally:
        sm.close()
    assert all(pool.route_log is None for pool in sm.pools)


class FailingMover(CountingMover):
    """A driver that refuses every move after the initial placement."""

    def place_many(self, spans, map_for_gpu=False, wait=False) -> None:
        if not map_for_gpu:
            raise OSError("cudaMemPrefetchAsync: invalid argument")
        super().place_many(spans, map_for_gpu, wait)


def test_a_failed_move_is_raised_on_the_decode_thread_and_at_close(store):
    sm = load_streaming_model(store, Settings(capacity=0.25), mapped=True)
    slots = sm.mapped_pool.gpu_slots
    sm.mapped_pool.close()
    placement = sm.mapped_pool = MappedPool(sm.pools, slots, FailingMover(), rebalance_tokens=8)
    placement.place_initial()
    with pytest.raises(RuntimeError, match="placing experts between host and GPU memory failed: cudaMemPrefetchAsync"):
        decode(sm.model, STEPS, placement.tick)
        # A failure the worker met after the last tick's hand-over comes back at the
        # next one, or here (as at a request's end), still on this thread.
        placement.drain()
    with pytest.raises(RuntimeError, match="cudaMemPrefetchAsync"):
        sm.close()
    # The reader was closed all the same.
    with pytest.raises(RuntimeError, match="engine is closed"):
        sm.reader.engine.submit_batch([])


def test_a_second_placement_moves_only_the_experts_whose_place_changes(store):
    sm = load_streaming_model(store, Settings(capacity=0.25), mapped=True)
    try:
        placement = sm.mapped_pool
        slots, tensors = placement.gpu_slots, len(sm.pools[0].layer.tensors)
        before = placement.mover.calls
        # Each layer swaps one expert: the last of the default placement for expert n-1.
        orders = [[*range(slots - 1), p.layer.num_experts - 1] for p in sm.pools]
        placement.place_initial(orders)
        assert placement.mover.calls - before == 2 * tensors * len(sm.pools)
        assert all(s == set(o) for s, o in zip(placement.on_gpu, orders))
        assert placement.mover.calls == placement.stats.place_calls
    finally:
        sm.close()


class SlowMover(CountingMover):
    """A driver whose moves take longer than a token."""

    def place_many(self, spans, map_for_gpu=False, wait=False) -> None:
        if not map_for_gpu:
            time.sleep(0.05)
        super().place_many(spans, map_for_gpu, wait)


def test_a_worker_that_falls_behind_takes_the_backlog_in_one_turn(store):
    """Moves slower than tokens: the worker's turns take several forwards each, so it
    makes fewer turns than there are forwards, and the tokens stay exact."""
    want = decode(load_stock_model(store), STEPS)
    sm = load_streaming_model(store, Settings(capacity=0.25), mapped=True)
    slots = sm.mapped_pool.gpu_slots
    sm.mapped_pool.close()
    placement = sm.mapped_pool = MappedPool(sm.pools, slots, SlowMover(), rebalance_tokens=8)
    try:
        placement.place_initial()
        for pool in sm.pools:
            pool.start_route_log()
        got = decode(sm.model, STEPS, placement.tick)
        placement.settle()
        assert got == want
        p = placement.stats.to_dict()
        forwards = STEPS + 1  # the 20-token prefill, then one per step
        assert p["routed"] == (20 + STEPS) * sm.pools[0].top_k * len(sm.pools)
        assert 0 < p["turns"] < forwards
        assert p["moves"] > 0
    finally:
        sm.close()


def test_no_rebalancing_keeps_the_initial_placement(store):
    want = decode(load_stock_model(store), STEPS)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=0), mapped=True)
    try:
        before = [set(s) for s in sm.mapped_pool.on_gpu]
        assert decode(sm.model, STEPS, sm.mapped_pool.tick) == want
        sm.mapped_pool.settle()
        assert sm.mapped_pool.stats.moves == 0 and sm.mapped_pool.on_gpu == before
        assert sm.mapped_pool.stats.routed > 0
    finally:
        sm.close()


def test_rebalancing_puts_each_layers_most_routed_experts_in_gpu_memory(store):
    """A rebalance every 8 tokens: the tokens stay exact, rebalances happen as routing
    goes, and after a last one every expert in GPU memory was routed at least as often
    as any expert left in host memory."""
    want = decode(load_stock_model(store), STEPS)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=8), mapped=True)
    try:
        placement = sm.mapped_pool
        assert decode(sm.model, STEPS, placement.tick) == want
        placement.settle()
        assert placement.stats.rebalances >= 2 and placement.stats.moves > 0
        rebalance(placement)
        for pool, on_gpu in zip(sm.pools, placement.on_gpu):
            routed = pool.stats.routed  # every token's routing (no heat keeper here)
            off = [e for e in range(len(routed)) if e not in on_gpu]
            assert len(on_gpu) == placement.gpu_slots
            assert min(routed[list(on_gpu)]) >= max(routed[off])
    finally:
        sm.close()


def test_rebalancing_weighs_the_heat_autopin_seeded(store):
    """Seeded heat that dwarfs a few tokens' routing decides the placement."""
    from moestream.daemon.pool.autopin import autopin

    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=0), mapped=True)
    try:
        placement = sm.mapped_pool
        n = sm.pools[0].layer.num_experts
        counts = {p.layer.ordinal: {e: 10_000 * (e + 1) for e in range(n)} for p in sm.pools}
        autopin(sm, counts, frac=0.5)
        want = [set(range(n - placement.gpu_slots, n)) for _ in sm.pools]
        assert placement.on_gpu == want
        decode(sm.model, 4, placement.tick)
        placement.settle()
        rebalance(placement)
        assert placement.on_gpu == want
    finally:
        sm.close()


class CountingGather:
    """Passes gathers on to a RowGather and records how many ids each one took."""

    def __init__(self, inner: RowGather) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def __call__(self, arrays, ids):
        self.sizes.append(ids.size)
        return self.inner(arrays, ids)

    def routed(self, arrays, ids):
        self.sizes.append(ids.size)
        return self.inner.routed(arrays, ids)

    def __getattr__(self, name):  # the rest of RowGather, as it is
        return getattr(self.inner, name)


def test_row_gather_copies_the_rows_it_is_given_and_points_repeats_at_the_first():
    a = mx.arange(5 * 6 * 4, dtype=mx.uint32).reshape(5, 6, 4)
    b = mx.random.normal((5, 3)).astype(mx.bfloat16)
    ids = mx.array([[3, 0, 3]], dtype=mx.uint32)
    gather = RowGather(use_kernel=False)
    got = gather([a, b], ids)
    assert [g.shape for g in got] == [(3, 6, 4), (3, 3)]
    assert mx.array_equal(got[0], a[mx.array([3, 0, 3])]) and mx.array_equal(got[1], b[mx.array([3, 0, 3])])
    # A batch's routing: two tokens of top-3, experts 4 and 1 routed by both.
    routing = mx.array([[[4, 1, 2]], [[1, 0, 4]]], dtype=mx.uint32)
    rows, where = gather.routed([a, b], routing)
    assert where.shape == routing.shape and where.dtype == routing.dtype
    assert where.reshape(-1).tolist() == [0, 1, 2, 1, 4, 0], "each pair points at its expert's first row"
    # Every pair finds its own expert's bytes at the row it points at.
    for stack, source in zip(rows, (a, b)):
        assert mx.array_equal(stack[where.reshape(-1)], source[routing.reshape(-1)])


def test_mapped_gather_gives_stock_logits_and_gathers_only_small_forwards(store):
    """With mapped_gather, decode steps run mlx-lm's expert call on a stack of the routed
    rows: logits bit-equal to stock mlx-lm's at every step; the prefill (more routed ids
    than MAX_GATHERED, and at least one per expert) runs on a stack of the whole layer,
    one gather of every expert, as a layer-major prefill stages it."""
    stock = load_stock_model(store)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_gather=True, prefetch="off"), mapped=True)
    try:
        shared = sm.pools[0].gather
        assert isinstance(shared, RowGather) and all(p.gather is shared for p in sm.pools)
        counting = CountingGather(shared)
        for pool in sm.pools:
            pool.gather = counting
        prompt = mx.arange(20)[None] % 300
        caches = make_prompt_cache(stock), make_prompt_cache(sm.model)
        want, got = stock(prompt, cache=caches[0]), sm.model(prompt, cache=caches[1])
        assert mx.array_equal(want, got)
        k, experts = sm.pools[0].top_k, sm.pools[0].layer.num_experts
        assert 20 * k > MAX_GATHERED and 20 * k >= experts
        assert counting.sizes == [experts] * len(sm.pools), "20 tokens x top-k ids: the whole layer staged once"
        y = mx.argmax(want[:, -1, :], axis=-1)
        for _ in range(6):
            want, got = stock(y[None], cache=caches[0]), sm.model(y[None], cache=caches[1])
            assert mx.array_equal(want, got)
            y = mx.argmax(want[:, -1, :], axis=-1)
        assert counting.sizes == [experts] * len(sm.pools) + [k] * (6 * len(sm.pools))
        # A speculative verify's few tokens are gathered too (3 x top-k ids).
        three = mx.array([[5, 17, 250]])
        want, got = stock(three, cache=caches[0]), sm.model(three, cache=caches[1])
        assert mx.array_equal(want, got)
        assert counting.sizes[-len(sm.pools) :] == [3 * k] * len(sm.pools)
    finally:
        sm.close()


def test_mapped_gather_is_auto_by_default_and_only_for_mapped_pools(store):
    """Auto gathers where the CUDA copy kernel runs and nowhere else (so not on a CPU
    or Metal machine); a slot pool never gathers, whatever the setting."""
    assert Settings().mapped_gather is None
    assert Settings().replace(mapped_gather="auto").mapped_gather is None
    assert Settings().replace(mapped_gather="on").mapped_gather is True
    here = RowGather.kernel_available()
    sm = load_streaming_model(store, Settings(capacity=0.25, prefetch="off"), mapped=True)
    try:
        assert all((p.gather is not None) == here for p in sm.pools)
        assert sm.pool_stats().admission["gather"] is here
    finally:
        sm.close()
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_gather=True), mapped=False)
    try:
        assert all(p.gather is None for p in sm.pools)
    finally:
        sm.close()


def test_rebalances_come_sooner_at_first(store):
    """Intervals of an eighth, a quarter, a half of mapped_rebalance_tokens, then all of
    it: with 64, the 20-token prompt brings the first rebalance (8 tokens due), 16 decode
    tokens the second, and the next 32 are not there yet after 24 steps."""
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped_rebalance_tokens=64), mapped=True)
    try:
        placement = sm.mapped_pool
        decode(sm.model, STEPS, placement.tick)
        placement.settle()
        routed_tokens = 20 + STEPS - READBACK_LAG  # the prompt and the decode steps read back
        assert routed_tokens < 64, "without the ramp there would be no rebalance at all"
        assert placement.stats.rebalances == 2
    finally:
        sm.close()


def test_a_mapped_pool_has_no_prefetch_whatever_the_setting(store):
    """Prefetch reads into a slot pool; a mapped pool holds every expert and has none."""
    for prefetch in ("on", "auto"):
        sm = load_streaming_model(store, Settings(capacity=0.25, mapped_gather=True, prefetch=prefetch), mapped=True)
        try:
            assert sm.prefetcher is None
        finally:
            sm.close()
    with pytest.raises(SettingsError, match="prefetch_copy_blocks: must be between 1 and 1024"):
        Settings().replace(prefetch_copy_blocks="0")


def test_bench_predict_reports_progress_on_stderr_and_json_on_stdout(store):
    """`bench predict --json`: a line on stderr as each stage starts and ends (seconds
    since the start first, as `bench decode` prints them), one JSON object on stdout."""
    import json

    from click.testing import CliRunner

    from moestream.client.cli import main as cli

    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "predict",
            "--model",
            str(store),
            "--capacity",
            "0.25",
            "--prompt-tokens",
            "4",
            "--decode-tokens",
            "4",
            "--rounds",
            "1",
            "--temp",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["results"][0]["disk"]["bound_applies"] in (True, False)
    progress = result.stderr.splitlines()
    assert all(line.startswith("[") and " s] " in line for line in progress), progress
    for stage in (
        "measuring the store's read bandwidth",
        "capacity 25% (slot pool): loading the model",
        "capacity 25%: warm-up",
        "capacity 25%: recall:",
        "capacity 25%: speed: one decode",
        "capacity 25%: speed: off",
        "capacity 25%: auto decided",
        "capacity 25%: done",
    ):
        assert any(stage in line for line in progress), (stage, progress)


def test_bench_predict_measures_the_slot_pools_prefetch(store):
    """`bench predict`: the slot pool's run (recall, speeds, auto's decision)."""
    from moestream.daemon.bench.predict import BenchPredictSettings, format_report, run_bench_predict

    slots_report = run_bench_predict(
        BenchPredictSettings(store=store, capacities=(0.25,), prompt_tokens=4, decode_tokens=6, rounds=2, temp=1.0)
    )
    slots = slots_report["results"][0]
    assert slots["pool"] == "slots" and 0 <= slots["recall"]["decode"]["top_k"] <= 1
    # Two blocks of off / on / on / off: a ratio per block, their median and interval,
    # and the host's time per token both ways.
    assert len(slots["speedup_per_block"]) == 2 and slots["speedup_paired"] > 0
    lo, hi = slots["speedup_interval_95"]
    assert lo <= hi and min(slots["speedup_per_block"]) <= slots["speedup_paired"] <= max(slots["speedup_per_block"])
    for way in ("prefetch_off", "prefetch_on"):
        h = slots["host_ms_per_token"][way]
        assert (
            h["host_call_ms_per_token"] > 0 and h["host_launch_ms_per_token"] >= 0 and h["host_wait_ms_per_token"] >= 0
        )
    assert "host ms per token, model call/launch/wait" in format_report(slots_report)
    # The store's read bandwidth, measured at the start, and the bytes read per decode
    # token both ways: at 25% of a store on disk, decode reads, and its bound follows.
    disk = slots["disk"]
    assert disk["read_bandwidth_bytes_per_s"] == slots_report["read_bandwidth_bytes_per_s"] > 0
    assert disk["prefetch_off"]["bytes_per_token"] > 0
    for way, enabled in (("prefetch_off", False), ("prefetch_on", True)):
        d = disk[way]
        if d["bytes_per_token"]:
            assert d["bound_tokens_per_s"] == pytest.approx(disk["read_bandwidth_bytes_per_s"] / d["bytes_per_token"])
            tps = slots["tokens_per_s_on"] if enabled else slots["tokens_per_s_off"]
            assert d["of_bound"] == pytest.approx(tps / d["bound_tokens_per_s"])
    assert "read from the store per token off/on" in format_report(slots_report)
    # The prefetch buffer's size and the share of its reads dropped unrouted, with the
    # hint to enlarge it only where that share is large.
    pf = slots["prefetch"]
    assert pf["buffer_bytes"] > 0 and 0 <= pf["dropped_unused"] <= pf["submitted"]
    assert f"prefetch buffer {pf['buffer_experts']} experts" in format_report(slots_report)
    hinted = {**slots_report, "results": [{**slots, "prefetch": {**pf, "submitted": 100, "dropped_unused": 11}}]}
    quiet = {**slots_report, "results": [{**slots, "prefetch": {**pf, "submitted": 100, "dropped_unused": 0}}]}
    assert "11.0% of its reads dropped" in format_report(hinted) and "larger --prefetch-buffer" in format_report(hinted)
    assert "0.0% of its reads dropped" in format_report(quiet) and "larger --prefetch-buffer" not in format_report(
        quiet
    )
    assert slots["tokens_per_s_off"] > 0 and slots["tokens_per_s_on"] > 0
    assert slots["auto"]["decided"] and slots["auto"]["decision"].startswith(("on:", "off:"))
