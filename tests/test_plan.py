"""`moestreamctl plan`: its arithmetic on the demo store with given probe figures (no
MLX, fast), the demo's shipped routing counts against the trace they come from, and the
command itself with real probes (slow)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from daemon_cli import clean_env, ctl

from moestream.daemon.planning.plan import (
    DEMO_COUNTS,
    DEMO_REUSE,
    Bandwidths,
    ComputeProbe,
    estimate_hits,
    format_plan,
    heat_counts,
    heat_reuse,
    load_bandwidths,
    load_compute,
    make_plan,
    save_bandwidths,
    save_compute,
)
from moestream.daemon.planning.probe_models import resident_dtype
from moestream.daemon.pool.capacity import kv_cache_bytes, memory_held
from moestream.shared.heat_file import read_usage
from moestream.shared.settings import Settings, demo_store_path
from moestream.shared.store_format import POOL_REUSE_NAME, load_manifest

ROOT = Path(__file__).resolve().parent.parent
DEMO = demo_store_path()
# 1 ms per layer per token plus 2 ms of embeddings and head; a wait after every layer adds
# 10 us to each. A prompt token: 0.1 ms per layer, 0.15 ms going layer by layer.
PROBE = ComputeProbe(
    (2, 4), (0.004, 0.006), (0.0004, 0.0006), (0.00402, 0.00604), (0.0005, 0.0008), 0.0, "cpu", "bfloat16"
)
FAST = Bandwidths(1e9, 1e10, "host memcpy", "given")


def test_the_demo_counts_shipped_are_the_demo_trace_counted():
    counts: dict[int, dict[int, int]] = {}
    for line in (ROOT / "tests/data/traces/demo_stdlib/trace.jsonl").read_text().splitlines():
        for layer, ids in enumerate(json.loads(line)["layers"]):
            for e in ids:
                counts.setdefault(layer, {}).setdefault(e, 0)
                counts[layer][e] += 1
    assert read_usage(DEMO_COUNTS).counts == counts


def test_the_demo_reuse_shipped_is_the_demo_trace_s_decode_steps_as_stack_distances():
    import numpy as np

    from moestream.daemon.bench.policy.trace import load_trace
    from moestream.daemon.pool.reuse import StackDistances

    trace = load_trace(ROOT / "tests/data/traces/demo_stdlib")
    decode = [i for i, p in enumerate(trace.phases) if p == "decode"]
    want = {}
    for layer in range(trace.num_layers):
        d = StackDistances(trace.num_experts, every=1)  # every step: the trace is short
        d.observe(np.array([trace.steps[i][layer] for i in decode]))
        want[layer] = {int(k): int(v) for k, v in enumerate(d.counts) if v}
    assert read_usage(DEMO_REUSE).counts == want


def test_an_lru_pool_s_hits_come_from_the_stack_distances(tmp_path):
    """With stack distances, an LRU pool's (and a mapped pool's) hit rate is theirs; the
    other policies keep the hottest share of the counts; the source says which."""
    from moestream.daemon.pool.reuse import lru_hit_rate

    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    manifest = load_manifest(DEMO)
    counts, source = heat_counts(DEMO, settings, manifest)
    reuse, reuse_source = heat_reuse(DEMO, settings, manifest)
    assert reuse_source.startswith("the demo trace's LRU stack distances")
    static = make_plan(DEMO, settings, FAST, PROBE, counts, source)
    lru = make_plan(DEMO, settings, FAST, PROBE, counts, source, reuse=reuse, reuse_source=reuse_source)
    assert lru.hits.pool_hit == pytest.approx(
        [lru_hit_rate(reuse[layer.ordinal], 16, 8, layer.num_experts) for layer in manifest.layers]
    )
    assert lru.hits.source == reuse_source and static.hits.source == source
    # The demo's text repeats its experts within a few tokens: LRU beats the hottest quarter.
    assert lru.hit_rate > static.hit_rate + 0.05
    assert lru.decode.terms_s["disk"] < static.decode.terms_s["disk"]
    # And the hit rate of other pool sizes, read off the same distances.
    curve = lru.hit_curve
    assert list(curve) == [0.125, 0.25, 0.5, 0.75] and curve[0.25] == pytest.approx(lru.hit_rate)
    assert all(a < b for a, b in zip(curve.values(), list(curve.values())[1:]))
    assert "by size    an LRU pool of 12.5 / 25 / 50 / 75% of the experts hits" in format_plan(
        lru
    ) and "by size" not in format_plan(static)
    assert json.loads(json.dumps(lru.to_dict()))["hit_curve"]["0.5"] == pytest.approx(curve[0.5])
    lfu = make_plan(DEMO, settings.replace(policy="lfu"), FAST, PROBE, counts, source, reuse=reuse)
    assert lfu.hits.pool_hit == static.hits.pool_hit and lfu.hit_curve == {}
    mapped = make_plan(DEMO, settings.replace(policy="lfu"), FAST, PROBE, counts, source, mapped=True, reuse=reuse)
    assert mapped.hits.pool_hit == lru.hits.pool_hit
    # A tier of every expert holds every miss; one of a few more experts a layer, some.
    every = make_plan(DEMO, settings.replace(host_cache="8M"), FAST, PROBE, counts, source, reuse=reuse)
    assert every.hits.tier_hit == pytest.approx([1.0] * 5)
    some = estimate_hits(manifest, counts, source, 16, 5 * 8, reuse, reuse_source)
    assert all(0 < t < 1 for t in some.tier_hit)
    both = [lru_hit_rate(reuse[layer.ordinal], 24, 8, layer.num_experts) for layer in manifest.layers]
    assert [h + (1 - h) * t for h, t in zip(some.pool_hit, some.tier_hit)] == pytest.approx(both)


def test_hits_are_the_hottest_share_per_layer_and_uniform_without_heat():
    manifest = load_manifest(DEMO)
    uniform = estimate_hits(manifest, {}, "none", 16, 0)
    assert uniform.pool_hit == pytest.approx([0.25] * 5) and uniform.tier_hit == pytest.approx([0.0] * 5)
    skewed = {layer.ordinal: {0: 60, 1: 20, 2: 20} for layer in manifest.layers}
    hits = estimate_hits(manifest, skewed, "given", 1, 5 * 1)  # tier: one more per layer
    assert hits.pool_hit == pytest.approx([0.6] * 5) and hits.tier_hit == pytest.approx([0.5] * 5)


def test_the_plan_of_the_demo_store(tmp_path):
    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    manifest = load_manifest(DEMO)
    counts, source = heat_counts(DEMO, settings, manifest)
    assert source.startswith("the demo model's recorded routing")  # no saved heat in tmp_path
    p = make_plan(DEMO, settings, FAST, PROBE, counts, source)
    assert p.slots_per_layer == 16 and p.pool_bytes == 16 * sum(layer.expert_bytes for layer in manifest.layers)
    assert p.kv_bytes_per_1k_tokens == kv_cache_bytes(manifest.config, 1024)
    assert p.resident_bytes == sum((DEMO / f).stat().st_size for f in manifest.resident_files)
    # The context: the model's own (4096), no memory known to bound it; with a budget,
    # what the budget leaves once the weights, the pool, a long prompt's stack and the
    # prompt cache are in, and the context is what that holds.
    assert (p.context.tokens, p.context.bound, p.context.kv_room_bytes) == (4096, "model", None)
    assert "context    4096 tokens per request, bound by model (the model's 4096)" in format_plan(p)
    budget = 20 * 2**20
    with_budget = Settings(model=str(DEMO), memory_budget=budget, prompt_cache_bytes=0, heat_dir=str(tmp_path))
    b = make_plan(DEMO, with_budget, FAST, PROBE, counts, source, memory=(1 << 40, "device memory (a test's)"))
    assert b.slots_per_layer == 64  # 20M holds every expert beside room for the model's 4096 tokens
    assert b.context.memory == "memory_budget" and b.context.kv_room_bytes == budget - b.resident_bytes - b.pool_bytes
    assert b.context.tokens == min(4096, b.context.kv_room_bytes // kv_cache_bytes(manifest.config, 1)) == 4096
    # No budget: the device's memory bounds it (here a small one: 4 MiB beside the model).
    held = memory_held(manifest, p.resident_bytes, p.pool_bytes, p.slots_per_layer, settings.prompt_cache_bytes)
    small = make_plan(DEMO, settings, FAST, PROBE, counts, source, memory=(held + 4 * 2**20, "device memory (x)"))
    assert (small.context.tokens, small.context.bound) == (4 * 2**20 // 3072, "memory")
    assert 0.25 < p.hit_rate < 0.6  # the hottest quarter takes more than a quarter of the routings
    terms = p.decode.terms_s
    assert terms["compute"] == pytest.approx(0.004 + (6 - 2) * 0.001)  # 6 layers
    assert terms["sync"] == pytest.approx(5 * 1e-5)  # 10 us after each of the 5 MoE layers
    misses = sum(8 * (1 - h) for h in p.hits.pool_hit)
    assert terms["disk"] == pytest.approx(misses * p.expert_bytes / 1e9)
    assert p.decode.tokens_per_s == pytest.approx(1 / sum(terms.values()))
    assert p.decode.bound_tokens_per_s > p.decode.tokens_per_s and p.decode.bound_by == "compute"
    assert p.ttft.seconds > 2048 * 0.0008 and p.ttft.bound_by == "compute"
    text = format_plan(p)
    assert "busy" not in text and " ms per token" in text and not re.search(r"\d{4,}\.\d+ ms", text)
    # A probe on a busy machine (its times scaled to an idle one's) says so.
    busy = make_plan(DEMO, settings, FAST, dataclasses.replace(PROBE, cpu_share=0.45), counts, source)
    assert "the machine gave the probe 45% of a core" in format_plan(busy)
    # A slow disk bounds it; every expert resident moves nothing; a tier of every expert
    # takes the disk out.
    slow = make_plan(DEMO, settings, Bandwidths(1e5, 1e10, "memcpy", "given"), PROBE, counts, source)
    assert slow.decode.bound_by == "disk" and slow.ttft.bound_by == "disk"
    full = make_plan(DEMO, settings.replace(capacity=1.0), FAST, PROBE, counts, source)
    assert full.hit_rate == pytest.approx(1.0) and full.decode.terms_s["disk"] == 0 == full.decode.terms_s["sync"]
    tier = make_plan(DEMO, settings.replace(host_cache="8M"), FAST, PROBE, counts, source)
    assert tier.decode.terms_s["disk"] == pytest.approx(0.0) and tier.decode.terms_s["link"] > 0
    json.dumps(p.to_dict())


def test_the_prefill_forecast_takes_the_order_the_daemon_prefills_in(tmp_path):
    """A prompt of one chunk goes layer by layer at every pool (its progress per layer), so
    its compute is the probe's with every layer waited for; a longer one at a full pool
    goes in stock's chunks; at a partial pool, layer by layer (its experts staged)."""
    settings = Settings(model=str(DEMO), capacity=1.0, heat_dir=str(tmp_path))
    counts, source = heat_counts(DEMO, settings, load_manifest(DEMO))
    layered, plain = 0.0005 + 4 * 0.00015, 0.0004 + 4 * 0.0001  # 6 layers

    def compute(prompt_tokens: int, capacity: float) -> float:
        p = make_plan(
            DEMO, settings.replace(capacity=capacity), FAST, PROBE, counts, source, prompt_tokens=prompt_tokens
        )
        return p.ttft.terms_s["compute"]

    assert compute(2048, 1.0) == pytest.approx(2048 * layered)
    assert compute(4096, 1.0) == pytest.approx(4096 * plain)
    assert compute(4096, 0.25) == pytest.approx(4096 * layered)
    assert compute(32, 1.0) == pytest.approx(32 * plain)  # too short to wait on
    # Each token of mean context adds to a prompt token's time (here 0.01% of it): a
    # prompt's tokens meet half its length on average, the probe's 24.
    growing = dataclasses.replace(PROBE, prefill_growth=1e-4)
    p = make_plan(DEMO, settings, FAST, growing, counts, source, prompt_tokens=2048)
    assert p.ttft.terms_s["compute"] == pytest.approx(2048 * layered * (1 + 1e-4 * (2048 - 48) / 2))


def test_the_probe_times_a_small_model_of_the_stores_architecture():
    """Every figure of a probe model's timing: decode, prefill (scaled by the share of a
    core it had), and what a longer prompt adds to each token."""
    from moestream.daemon.planning.plan import _time_model
    from moestream.daemon.planning.probe_models import probe_config, random_model

    model = random_model(probe_config(load_manifest(DEMO).config, 2), "float32")
    timed = _time_model(model, 4096, 16, 2, long_prompt=64)
    assert timed.decode_s > 0 and timed.prefill_s > 0 and 0 < timed.share <= 1 and timed.growth >= 0
    assert _time_model(model, 4096, 16, 2).growth == 0  # not asked


def test_decode_reads_at_the_rate_of_a_layers_batch(tmp_path):
    """A decode step reads each layer's misses together and waits for them: the disk term
    takes the rate measured in batches of that many reads, interpolated in log(batch)."""
    bw = Bandwidths(1e9, 1e10, "host memcpy", "given", {1: 1e8, 4: 3e8, 16: 5e8})
    assert bw.decode_read_rate(0.3) == bw.decode_read_rate(1) == 1e8  # mostly 0 or 1 read
    assert bw.decode_read_rate(2) == pytest.approx(2e8)  # halfway from 1 to 4 in log
    assert bw.decode_read_rate(4) == pytest.approx(3e8) and bw.decode_read_rate(64) == 5e8
    assert FAST.decode_read_rate(3) == 1e9  # none measured: the bulk rate

    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    manifest = load_manifest(DEMO)
    counts, source = heat_counts(DEMO, settings, manifest)
    bulk = make_plan(DEMO, settings, Bandwidths(1e9, 1e10, "memcpy", "given"), PROBE, counts, source)
    batched = make_plan(DEMO, settings, bw, PROBE, counts, source)
    per_layer = [8 * (1 - h) for h in batched.hits.pool_hit]
    assert all(1 < n < 16 for n in per_layer)
    want = sum(n * batched.expert_bytes / bw.decode_read_rate(n) for n in per_layer)
    assert batched.decode.terms_s["disk"] == pytest.approx(want)
    assert batched.decode.terms_s["disk"] > 2 * bulk.decode.terms_s["disk"]
    # The prefill's reads are many in flight: its disk term keeps the bulk rate.
    assert batched.ttft.terms_s["disk"] == pytest.approx(bulk.ttft.terms_s["disk"])


def test_the_layer_read_probe_reads_the_store():
    from moestream.daemon.planning.bandwidth import measure_layer_reads

    rates = measure_layer_reads(DEMO, threads=2, batches=(1, 4), reads=8)
    assert set(rates) == {1, 4} and all(r > 0 for r in rates.values())


def test_probes_are_kept_for_no_probe(tmp_path):
    assert load_bandwidths(tmp_path) is None and load_compute(tmp_path, "abc") is None
    save_bandwidths(tmp_path, FAST)
    again = load_bandwidths(tmp_path)
    assert again.read_bytes_per_s == 1e9 and again.source.startswith("last probed ")
    assert again.read_by_batch == {}
    save_bandwidths(tmp_path, Bandwidths(1e9, 1e10, "memcpy", "given", {1: 2e8, 8: 6e8}))
    assert load_bandwidths(tmp_path).read_by_batch == {1: 2e8, 8: 6e8}
    save_compute(tmp_path, "abc", PROBE)
    assert load_compute(tmp_path, "abc") == PROBE and load_compute(tmp_path, "other") is None
    # Read from the safetensors headers: the demo's resident weights are float32, a copy
    # of them cast to bfloat16 is bfloat16.
    assert resident_dtype(DEMO, load_manifest(DEMO)) == "float32"
    import mlx.core as mx

    manifest = load_manifest(DEMO)
    (name,) = manifest.resident_files
    weights = mx.load(str(DEMO / name))
    mx.save_safetensors(
        str(tmp_path / name), {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
    )
    assert resident_dtype(tmp_path, manifest) == "bfloat16"


@pytest.mark.slow  # probes the disk, the link, two random-weight models and a pool: 30 s to minutes on a shared CPU
def test_plan_command_on_the_demo_model(tmp_path):
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "state"), MOESTREAM_HEAT_DIR=str(tmp_path / "heat"))
    out = ctl("plan", "--model", str(DEMO), "--capacity", "0.5", "--json", env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["slots_per_layer"] == 32 and p["decode"]["tokens_per_s"] > 0 and p["ttft"]["seconds"] > 0
    assert p["bandwidths"]["source"] == "probed now" and p["hits"]["source"].startswith("the demo trace's LRU")
    assert p["pool_probe"]["slots"] == 32 and "probing the slot pool at 50%" in out.stderr
    assert "compute: round 3 of 3" in out.stderr  # the longest probes say how far they are
    assert "pool: the same model streamed, 32 of 64 experts a layer" in out.stderr
    assert p["decode"]["terms_s"]["sync"] == 0 and "pool" in p["decode"]["terms_s"]
    text = ctl("plan", "--model", str(DEMO), "--no-probe", "--capacity", "0.5", env=env, timeout=300)
    assert text.returncode == 0 and "(last probed " in text.stdout and "KV cache" in text.stdout, text.stderr
    assert "pool probe" in text.stdout and "probing" not in text.stderr  # all three kept
    # A second and over as seconds, not `compute 131909.86 ms`.
    assert not re.search(r"\d{4,}\.\d+ ms", text.stdout), text.stdout
    # The demo needs no path: no --model, or `--model demo`, plans it.
    for model in ([], ["--model", "demo"]):
        same = ctl("plan", *model, "--no-probe", "--capacity", "0.5", env=env, timeout=300)
        assert same.returncode == 0 and same.stdout.splitlines()[0] == text.stdout.splitlines()[0], same.stderr
    bad = ctl("plan", "--model", str(DEMO), "--capacity", "2", env=env)
    assert bad.returncode == 2 and "below the minimum" in bad.stderr


@pytest.mark.slow  # the probes, then a short bench decode of one configuration
def test_bench_decode_prints_the_forecast_before_it_times_anything(tmp_path):
    """A run cut short still says what was forecast: each configuration's forecast line
    comes once it is loaded, before its first round; the report's rows at the end."""
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "state"), MOESTREAM_HEAT_DIR=str(tmp_path / "heat"))
    args = ("--capacity", "0.5", "--no-stock", "--no-naive", "--rounds", "1", "--warmup-rounds", "1")
    out = ctl(
        "bench",
        "decode",
        "--model",
        str(DEMO),
        *args,
        "--decode-tokens",
        "4",
        "--forecast",
        "--json",
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    early = next(i for i, line in enumerate(lines) if line.startswith("forecast moestream@0.5:"))
    first_round = next(i for i, line in enumerate(lines) if "round 1/1 moestream@0.5" in line)
    assert early < first_round and "from the demo trace's LRU stack distances" in lines[early]
    (row,) = json.loads(out.stdout)["forecast"]
    assert row["name"] == "moestream@0.5" and row["forecast_hit_source"].startswith("the demo trace's LRU")
    assert f"hit {row['forecast_hit_rate']:.3f}" in lines[early]


def test_an_expert_parallel_groups_heat_files_add_up_for_the_plan(tmp_path):
    """No single-process heat, only the rank files of two groups (of 2 and of 3 ranks):
    the plan (and `heatmap`, through the same reader) takes the newer group's files, summed
    (ranks own disjoint experts), and says so."""
    import os

    from moestream.shared.heat_file import group_usage, usage_name, write_usage

    write_usage(tmp_path / usage_name(0, 3), {0: {0: 50}})
    os.utime(tmp_path / usage_name(0, 3), (1, 1))  # an older group
    write_usage(tmp_path / usage_name(0, 2), {0: {0: 5, 2: 7}, 1: {4: 1}})
    write_usage(tmp_path / usage_name(1, 2), {0: {1: 3, 3: 9}})
    (tmp_path / "pool_usage.rank2of2.json").write_text("{}")  # no such rank: not a group's file
    counts, paths = group_usage(tmp_path)
    assert counts == {0: {0: 5, 1: 3, 2: 7, 3: 9}, 1: {4: 1}}
    assert [p.name for p in paths] == [usage_name(0, 2), usage_name(1, 2)]

    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    planned, source = heat_counts(DEMO, settings, load_manifest(DEMO))
    assert planned == counts and "2 ranks of an expert-parallel group" in source and "25 routings" in source
    (tmp_path / usage_name(1, 2)).write_text("not json")
    with pytest.raises(ValueError, match="rank1of2"):
        group_usage(tmp_path)
    # A single process's heat, once there, comes first.
    write_usage(tmp_path / "pool_usage.json", {0: {9: 1}})
    assert heat_counts(DEMO, settings, load_manifest(DEMO))[0] == {0: {9: 1}}


def test_stack_distances_that_do_not_fit_the_store_are_not_planned_from(tmp_path):
    """A reuse file with a distance past a layer's experts, or a layer the store lacks, is
    another model's: the plan takes the demo's shipped distances instead of reading it."""
    from moestream.shared.heat_file import write_usage

    settings = Settings(model=str(DEMO), capacity=0.25, heat_dir=str(tmp_path))
    manifest = load_manifest(DEMO)
    n = manifest.layers[0].num_experts
    write_usage(tmp_path / POOL_REUSE_NAME, {0: {0: 5, n: 2}})  # n: first uses, which fit
    assert heat_reuse(DEMO, settings, manifest)[1].startswith(f"the LRU stack distances in {tmp_path}")
    for foreign in ({0: {0: 5, n + 1: 2}}, {max(layer.ordinal for layer in manifest.layers) + 7: {0: 5}}):
        write_usage(tmp_path / POOL_REUSE_NAME, foreign)
        assert heat_reuse(DEMO, settings, manifest)[1].startswith("the demo trace's LRU stack distances")


def test_the_probe_models_have_fewer_experts_and_run_for_every_supported_architecture():
    """The compute probe's models keep at most PROBE_MAX_EXPERTS experts a layer (a
    multiple of the router's groups, at least twice the top-k) and its layer counts: each
    supported architecture's tiny model with more experts than that builds and decodes."""
    import mlx.core as mx
    from arch_table import TOP_K, supported, tiny_arch_config
    from mlx_lm.models.cache import make_prompt_cache

    from moestream.daemon.planning.plan import probe_layer_counts
    from moestream.daemon.planning.probe_models import PROBE_MAX_EXPERTS, probe_config, random_model
    from moestream.daemon.pool.capacity import EXPERT_COUNT_KEYS, layer_count

    assert probe_layer_counts(48) == (4, 16) and probe_layer_counts(6) == (2, 6) and probe_layer_counts(2) == (1, 2)
    grouped = probe_config(
        {"num_hidden_layers": 40, "n_routed_experts": 256, "n_group": 6, "num_experts_per_tok": 8}, 4
    )
    assert grouped["n_routed_experts"] == 66 and grouped["num_hidden_layers"] == 4  # 64 up to a multiple of 6
    assert probe_config({"num_hidden_layers": 4, "num_experts": 48, "num_experts_per_tok": 40}, 2)["num_experts"] == 48
    many = PROBE_MAX_EXPERTS + 32
    for model_type in supported():
        config = tiny_arch_config(model_type)
        for cfg in (config, config.get("text_config")):
            for key in EXPERT_COUNT_KEYS if isinstance(cfg, dict) else ():
                if key in cfg:
                    cfg[key] = many
        # All the tiny model's layers: some need several (llama4 attends globally every 4th).
        probe = probe_config(config, layer_count(config))
        assert kv_cache_bytes(config, 1024) > 0, model_type  # phixtral and longcat_flash name it num_layers
        counts = [c[k] for c in (probe, probe.get("text_config") or {}) for k in EXPERT_COUNT_KEYS if k in c]
        assert counts and all(c == max(PROBE_MAX_EXPERTS, 2 * TOP_K) for c in counts), (model_type, counts)
        model = random_model(probe, "float32")
        cache = make_prompt_cache(model)
        logits = model(mx.array([[1, 2, 3]]), cache=cache)
        logits = model(mx.array([[4]]), cache=cache)
        assert logits.shape[-1] > 0 and bool(mx.isfinite(logits).all()), model_type
