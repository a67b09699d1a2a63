"""The next-layer predictor, the prefetcher and the prefetch governor."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.prefetch.prefetcher import Prefetcher, PrefetchGovernor
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings, SettingsError, demo_store_path
from moestream.shared.store_format import load_manifest


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral", "qwen3_5_moe"])
def test_next_router_ranks_as_the_layers_own_router(arch, tmp_path):
    """On the same hidden state, the predictor's top-k is what the next layer's own
    router picks (DeepSeek's group limit aside, so a superset check there)."""
    src = make_tiny_model(tmp_path / "m", arch, quant="4bit", seed=3)
    convert_model(src, tmp_path / "s")
    sm = load_streaming_model(tmp_path / "s", Settings(capacity=0.25, prefetch="on"))
    try:
        moes = sorted(
            (m for _, m in sm.model.named_modules() if type(m).__name__ == "StreamingMoE"),
            key=lambda m: m.pool.layer.ordinal,
        )
        assert len(moes) >= 2 and sm.prefetcher is not None
        wired = [m for m in moes if m.next is not None]
        assert len(wired) == len(moes) - 1 and moes[-1].next is None
        nxt = wired[0].next
        block = next(b for _, b in sm.model.named_modules() if getattr(b, "switch_mlp", None) is moes[1])
        k = nxt.pool.top_k
        config = sm.manifest.config.get("text_config", sm.manifest.config)
        x = mx.random.normal((1, 5, config["hidden_size"]), key=mx.random.key(0))
        ranked = np.array(nxt.router.ranked(x, 4 * k, ordered=True))
        if arch == "deepseek_v3":
            inds, _ = block.gate(x)
            own = np.array(inds)
            assert all(set(own[0, t]) <= set(ranked[0, t, : 4 * k]) for t in range(5))
        else:
            own = np.array(mx.argpartition(-block.gate(x), kth=k - 1, axis=-1)[..., :k])
            assert all(set(own[0, t]) == set(ranked[0, t, :k]) for t in range(5))
        unordered = np.array(nxt.router.ranked(x, k, ordered=False))
        assert all(set(unordered[0, t]) == set(ranked[0, t, :k]) for t in range(5))
    finally:
        sm.close()


def test_a_fully_resident_model_gets_no_prefetcher():
    sm = load_streaming_model(demo_store_path(), Settings(capacity=1.0, prefetch="on"))
    try:
        assert sm.prefetcher is None and sm.diagnostics is not None
    finally:
        sm.close()


def test_prefetched_bytes_are_the_store_bytes_and_a_full_buffer_drops_the_oldest():
    sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, prefetch="off"))
    try:
        layer = sm.manifest.layers[2]
        pf = Prefetcher(sm.reader, sm.manifest, None, slots=3, top_k=8, mode="on")
        assert pf.submit(layer, [1, 2, 3]) == 3
        assert pf.submit(layer, [1, 2]) == 0  # already buffered
        pf.drain()
        assert [pf.state(layer.ordinal, e) for e in (1, 2, 3, 4)] == ["done", "done", "done", "none"]
        # A fourth expert takes the least recently used slot: expert 3 (1 and 2 were
        # touched again by the second submit).
        assert pf.submit(layer, [4]) == 1
        assert pf.state(layer.ordinal, 3) == "dropped" and pf.s.dropped_unused == 1
        # Promote into rows of fresh arrays: the bytes equal the expert block in the store.
        arrays = {t.name: mx.zeros((2, *t.shape), dtype=getattr(mx, t.dtype)) for t in layer.tensors}
        mx.eval(list(arrays.values()))
        left, waited = pf.promote(layer, [(4, 0), (1, 1)], arrays)
        assert left == [] and waited <= 1
        raw = np.fromfile(sm.store_dir / layer.file, dtype=np.uint8)
        for e, row in ((4, 0), (1, 1)):
            entry = layer.experts[e]
            for t in layer.tensors:
                got = np.frombuffer(memoryview(arrays[t.name]).cast("B"), np.uint8)[
                    row * t.nbytes : (row + 1) * t.nbytes
                ]
                want = raw[entry.offset + t.offset : entry.offset + t.offset + t.nbytes]
                assert np.array_equal(got, want), (e, t.name)
        assert not pf.has(layer.ordinal, 4) and pf.has(layer.ordinal, 2)
        assert pf.stats()["promoted"] == 2
        pf.drain()
    finally:
        sm.close()


class _Switch:
    """What the governor switches: a prefetcher's `enabled`."""

    enabled = True


@pytest.mark.parametrize("on_ms,off_ms,keep", [(10.0, 14.0, True), (14.0, 10.0, False), (10.0, 10.1, False)])
def test_the_governor_keeps_prefetch_only_where_it_pays(on_ms, off_ms, keep):
    switch = _Switch()
    g = PrefetchGovernor(switch, window=4, trials=3)
    seen = []
    while not g.decided:
        seen.append(switch.enabled)
        g.observe((on_ms if switch.enabled else off_ms) / 1e3)
    assert switch.enabled is keep
    assert seen.count(True) == seen.count(False) == 12  # both states alike
    # ABBA windows of 4 steps: on, off, off, on, on, off.
    assert seen == [w % 4 in (0, 3) for w in range(6) for _ in range(4)]
    d = g.to_dict()
    assert d["decided"] and d["speedup"] == pytest.approx(off_ms / on_ms)
    # The first step, and the first after each of the 3 switches, are left out.
    assert d["steps_measured"] == 24 - 4
    assert d["window_medians_ms"] == [
        ["on" if w % 4 in (0, 3) else "off", on_ms if w % 4 in (0, 3) else off_ms] for w in range(6)
    ]
    assert ("does not pay" in d["decision"]) is (not keep)
    g.observe(1.0)  # decided: nothing changes any more
    assert switch.enabled is keep


def test_prefetch_setting_is_checked():
    assert Settings().replace(prefetch="AUTO").prefetch == "auto"
    with pytest.raises(SettingsError, match="prefetch"):
        Settings().replace(prefetch="sometimes")


def test_copy_batch_is_no_setting_any_more():
    # Measured not fast enough (tests/bench/RESULTS.md), so removed with its native path.
    assert not hasattr(Settings(), "copy_batch")
    with pytest.raises(SettingsError, match="unknown setting 'copy_batch'"):
        Settings.from_values({"copy_batch": "1"})


def test_copier_figures_are_per_forward():
    from moestream.daemon.bench.predict import BenchPredictSettings, _copier_per_forward

    before = {
        "calls": 10,
        "spans": 100,
        "bytes": 0,
        "kernel_launches": 2,
        "bind_seconds": 1.0,
        "enqueue_seconds": 2.0,
        "wait_seconds": 3.0,
        "kernel_error": "",
    }
    after = {
        "calls": 30,
        "spans": 500,
        "bytes": 9,
        "kernel_launches": 10,
        "bind_seconds": 1.1,
        "enqueue_seconds": 2.3,
        "wait_seconds": 3.5,
        "kernel_error": "",
    }
    d = _copier_per_forward(before, after, BenchPredictSettings(store=Path("."), decode_tokens=3))  # 4 forwards
    assert d["calls"] == 5 and d["spans"] == 100 and d["kernel_launches"] == 2
    assert (
        d["bind_ms"] == pytest.approx(25)
        and d["enqueue_ms"] == pytest.approx(75)
        and d["wait_ms"] == pytest.approx(125)
    )
    assert d["us_per_span"] == pytest.approx(1e6 * 0.4 / 400)
    assert d["kernel_error"] is None
    # The copier's counters carry one string, the driver's reason for refusing the kernel.
    refused = _copier_per_forward(
        before, {**after, "kernel_error": "no kernel image"}, BenchPredictSettings(store=Path("."))
    )
    assert refused["kernel_error"] == "no kernel image"


def test_a_deeper_prefetch_reads_layers_further_ahead_and_changes_no_token(capsys):
    """`prefetch_depth = 2`: layer L also reads what layer L+2's router names on L's
    input. The layers are wired two ahead (the last but one has only L+1), the buffer
    serves reads for a layer two on (promoted there), and the tokens are the same."""
    from moestream.daemon.model.generation import SamplingParams, generate

    prompt, out = list(range(40, 52)), {}
    for depth in (1, 2):
        sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, prefetch="on", prefetch_depth=depth))
        try:
            moes = sorted(
                (m for _, m in sm.model.named_modules() if type(m).__name__ == "StreamingMoE"),
                key=lambda m: m.pool.layer.ordinal,
            )
            assert [len(m.next.ahead) for m in moes[:-1]] == [depth - 1] * (len(moes) - 2) + [0]
            if depth == 2:
                assert moes[0].next.ahead[0].pool is moes[2].pool
            result = generate(sm, prompt, SamplingParams(max_tokens=16))
            out[depth] = (result.tokens, result.stats.prefetch)
        finally:
            sm.close()
    assert out[1][0] == out[2][0]
    assert out[2][1]["submitted"] > out[1][1]["submitted"] > 0 and out[2][1]["promoted"] > 0
    assert (out[1][1]["depth"], out[2][1]["depth"]) == (1, 2)  # and the request's stats say so
    from moestream.client.cli.daemon import _echo_prefetch

    _echo_prefetch(out[2][1], None)
    assert f"{out[2][1]['submitted']} read, 2 layers ahead" in capsys.readouterr().out


def test_prefetch_depth_setting_is_checked():
    assert Settings().prefetch_depth == 1
    assert Settings().replace(prefetch_depth="2").prefetch_depth == 2
    for bad in ("0", "5", "deep"):
        with pytest.raises(SettingsError, match="prefetch_depth"):
            Settings().replace(prefetch_depth=bad)


def test_prefetch_buffer_setting_sizes_the_buffer():
    """`prefetch_buffer` (bytes) sets how many experts the prefetch buffer holds; one
    too small for a token's experts is refused with the size it needs; with prefetch off
    the buffer stays minimal."""
    from moestream.daemon.pool.host_tier import expert_stride

    store = demo_store_path()
    stride = expert_stride(load_manifest(store))
    assert Settings().prefetch_buffer == 0
    assert Settings().replace(prefetch_buffer="3M").prefetch_buffer == 3 << 20
    with pytest.raises(SettingsError):
        Settings().replace(prefetch_buffer="lots")
    default = load_streaming_model(store, Settings(capacity=0.25, prefetch="on"))
    try:
        k = default.prefetcher.top_k
        default_slots = default.prefetcher.slots
    finally:
        default.close()
    wanted = default_slots + 37
    sm = load_streaming_model(
        store, Settings(capacity=0.25, prefetch="on", prefetch_buffer=wanted * stride + stride // 2)
    )
    try:
        assert sm.prefetcher.slots == wanted
        assert sm.prefetcher.stats()["buffer_bytes"] == wanted * stride
    finally:
        sm.close()
    off = load_streaming_model(store, Settings(capacity=0.25, prefetch="off", prefetch_buffer=wanted * stride))
    try:
        assert off.prefetcher.slots == k
    finally:
        off.close()
    with pytest.raises(ValueError, match=f"give at least {k * stride}"):
        load_streaming_model(store, Settings(capacity=0.25, prefetch="on", prefetch_buffer=k * stride - 1))


def test_disk_figures_bound_decode_by_the_read_bandwidth():
    """`bench predict`'s read bound: bytes per token over the read bandwidth, the share
    of it each way reached, and the most prefetch could gain (decode with prefetch at
    the read bandwidth, against prefetch off); none where prefetch read nothing."""
    from moestream.daemon.bench.predict import disk_figures

    d = disk_figures({False: 2.0, True: 3.0}, {False: 500e6, True: 550e6}, read_bandwidth=2.2e9)
    assert d["prefetch_off"]["bound_tokens_per_s"] == pytest.approx(4.4)
    assert d["prefetch_on"]["bound_tokens_per_s"] == pytest.approx(4.0)
    assert d["prefetch_off"]["of_bound"] == pytest.approx(2.0 / 4.4) and d["prefetch_on"]["of_bound"] == pytest.approx(
        0.75
    )
    assert d["speedup_ceiling"] == pytest.approx(2.0)  # 4.0 tok/s at best with prefetch, against 2.0 without
    served = disk_figures({False: 10.0, True: 12.0}, {False: 0.0, True: 0.0}, read_bandwidth=2.2e9)
    assert served["prefetch_on"]["bound_tokens_per_s"] is None and served["prefetch_on"]["of_bound"] is None
    assert served["speedup_ceiling"] is None
    assert d["bound_applies"] and d["bound_why_not"] is None and not served["bound_applies"]


def _predict_report(*disks: dict) -> dict:
    """A `bench predict` report with one slot-pool row per `disk` (disk_figures)."""
    rows = [
        {
            "capacity": 0.25,
            "pool": "slots",
            "recall": {"decode": {"top_k": 0.78, "top_2k": 0.95, "top_4k": 0.99}},
            "tokens_per_s_off": 15.0,
            "tokens_per_s_on": 12.0,
            "speedup": 0.8,
            "speedup_paired": None,
            "speedup_interval_95": None,
            "window_ms": 5.5,
            "matmul_ms_per_call": {"prefetch_on": 6.5, "prefetch_off": 10.5},
            "host_ms_per_token": None,
            "auto": {"decision": "off: does not pay"},
            "disk": disk,
            "prefetch": {"submitted": 100, "dropped_unused": 0, "buffer_experts": 128, "buffer_bytes": 128 * 16384},
        }
        for disk in disks
    ]
    return {
        "model_type": "qwen3_moe",
        "moe_layers": 5,
        "experts_per_layer": 64,
        "device": "cpu",
        "decode_tokens": 16,
        "temp": 0.0,
        "rounds": 1,
        "prefetch_depth": 1,
        "results": rows,
    }


def test_bench_predict_says_where_the_read_bound_does_not_apply():
    """Where decode reads a few hundred KiB per token (the demo model) the read bound is
    far above any speed compute allows, so the report says it does not apply instead of
    "prefetch could give at most 138x"; the same where a host tier served every read or
    the store is read through the page cache. Sizes are format_size's, never "0.00 GB"."""
    from moestream.daemon.bench.predict import disk_figures, format_report
    from moestream.shared.settings import format_size

    tps = {False: 15.0, True: 12.0}
    demo = disk_figures(tps, {False: 352e3, True: 352e3}, read_bandwidth=340e6)
    assert demo["bound_why_not"] == "few_reads" and not demo["bound_applies"]
    assert demo["speedup_ceiling"] > 50  # the number is kept in the JSON
    disk_bound = disk_figures(tps, {False: 20e6, True: 22e6}, read_bandwidth=340e6)
    cached = disk_figures(tps, {False: 20e6, True: 22e6}, read_bandwidth=340e6, page_cache="O_DIRECT refused")
    served = disk_figures(tps, {False: 0.0, True: 0.0}, read_bandwidth=340e6)
    assert disk_bound["bound_applies"]
    assert cached["bound_why_not"] == "page_cache" and served["bound_why_not"] == "no_reads"
    lines = format_report(_predict_report(demo, disk_bound, cached, served)).splitlines()
    reads = [line for line in lines if "read from the store per token" in line]
    assert len(reads) == 4
    size = f"{format_size(352e3)}/{format_size(352e3)} at {format_size(340e6)}/s"
    assert size == "343.8 KiB/343.8 KiB at 324.2 MiB/s" and size in reads[0]
    assert "reading them takes 1.6% of a token at that bandwidth, so no read bound applies" in reads[0]
    assert "could give at most" not in reads[0] and "of that bound" not in reads[0]
    assert "19.1 MiB/21.0 MiB" in reads[1] and "of that bound off 0.88, on 0.78" in reads[1]
    assert "prefetch could give at most 1.03x" in reads[1]
    assert "through the page cache (O_DIRECT refused)" in reads[2] and "could give" not in reads[2]
    assert "0 B/0 B" in reads[3] and "nothing read" in reads[3] and "could give" not in reads[3]
    buffers = [line for line in lines if "prefetch buffer" in line]
    assert len(buffers) == 4 and all("prefetch buffer 128 experts (2.0 MiB)" in line for line in buffers)
    assert not any(unit in line for line in lines for unit in (" GB", " MB"))


def test_the_loader_hands_each_layer_its_collaborators():
    """Pools and streaming layers get what they work with when they are made: the
    prefetcher, the lowest layers' pools (the policies' hint), the next layer to predict
    for and the model's diagnostics switch."""
    from moestream.daemon.model.streaming_model import LOWER_HINT_LAYERS

    sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, prefetch="on"))
    try:
        moes = [m for _, m in sm.model.named_modules() if type(m).__name__ == "StreamingMoE"]
        moes.sort(key=lambda m: m.ordinal)
        assert [m.pool for m in moes] == sm.pools
        for i, (m, pool) in enumerate(zip(moes, sm.pools)):
            assert pool.prefetcher is sm.prefetcher and m.hub is sm.diagnostics
            assert pool.lower == sm.pools[: min(i, LOWER_HINT_LAYERS)]
            if i + 1 < len(sm.pools):
                assert m.next.pool is sm.pools[i + 1] and m.prefetcher is sm.prefetcher
            else:
                assert m.next is None
    finally:
        sm.close()
