"""The mapped pool (daemon/mapped/mapped_pool.py) as a mode of `generate --local` and of the
daemon: greedy tokens are stock mlx-lm's; the placement statistics reach the request's
stats, `status` and `stats`; the heat file holds exactly the routed counts of the
requests; autopin places each layer's hottest experts in GPU memory; speculative
decoding counts its experts without taking the placement's routing log; and a host too
small for every expert is refused before anything is loaded."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from daemon_cli import clean_env, ctl
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer
from tiny_models import local_outputs, tiny_store

from moestream.client.client import Client
from moestream.daemon.model.generation import SamplingParams, encode_prompt, generate
from moestream.daemon.model.speculative import SpeculativeParams, SpeculativeStats, speculative_steps
from moestream.daemon.model.streaming_model import (
    MAPPED_HOST_MARGIN,
    check_mapped_host_memory,
    load_stock_model,
    load_streaming_model,
)
from moestream.daemon.pool.autopin import autopin
from moestream.daemon.pool.expert_pool import PoolCapacityError
from moestream.shared.heat_file import read_usage, usage_path, write_usage
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.settings import Settings, demo_store_path, format_size
from moestream.shared.store_format import load_manifest

PROMPTS = ["The farmer counted his hens", "def route(hidden, gate, k=2):", "Numbers and dates: 1, 2, 3"]
N_TOKENS = 24
CAPACITY = "0.25"
SLOTS = 4  # 25% of the tiny model's 16 experts (its top-k is 4)


@pytest.fixture(scope="module")
def store():
    with tiny_store("msmp") as path:
        yield path


@pytest.fixture(scope="module")
def reference(store):
    """What `generate --local` computes in-process without --mapped, prompt by prompt."""
    return local_outputs(store, dict.fromkeys(PROMPTS, N_TOKENS))


def hot_counts(store: Path) -> dict[int, dict[int, int]]:
    """Heat whose hottest experts are not the default placement's (0, 1, 2, ...)."""
    counts = {}
    for layer in load_manifest(store).layers:
        n = layer.num_experts
        counts[layer.ordinal] = {(n - 1 - 3 * i) % n: 1000 - i for i in range(n)}
    return counts


def hottest_first(counts: dict[int, int]) -> list[int]:
    return sorted(counts, key=lambda e: (-counts[e], e))


def test_local_mapped_generate_is_stock_mlx_lm(store, reference):
    prompt = PROMPTS[0]
    out = ctl(
        "generate",
        prompt,
        "--local",
        "--mapped",
        "--model",
        str(store),
        "--capacity",
        CAPACITY,
        "--max-tokens",
        str(N_TOKENS),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["tokens"] == reference[prompt].tokens and got["text"] == reference[prompt].text

    stock = load_stock_model(store)
    ids = load_tokenizer(store).encode(prompt)
    steps = generate_step(mx.array(ids), stock, max_tokens=N_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1))
    want = [int(t) for t, _ in steps]
    assert got["tokens"] == want[: len(got["tokens"])] and len(got["tokens"]) > 0

    stats = got["stats"]
    assert stats["mapped"] is True and stats["capacity"] == SLOTS
    placement = stats["mapped_pool"]
    # Every routed (token, expert) pair was accounted by the end of the request: as
    # many as the slot pool counts on the host for the same request.
    assert placement["routed"] == stats["routed_experts"] == reference[prompt].stats.routed_experts > 0
    assert 0 < placement["routed_on_gpu"] < placement["routed"] and placement["gpu_slots"] == SLOTS
    assert placement["gpu_hit_rate"] == placement["routed_on_gpu"] / placement["routed"]
    # No sync per layer: the only one per token reads the sampled token.
    assert stats["host_syncs_per_token"] == 1.0


def test_no_mapped_overrides_the_environment(store, reference):
    prompt = PROMPTS[0]
    out = ctl(
        "generate",
        prompt,
        "--local",
        "--no-mapped",
        "--model",
        str(store),
        "--capacity",
        CAPACITY,
        "--max-tokens",
        str(N_TOKENS),
        "--json",
        env=clean_env(MOESTREAM_MAPPED="1"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["stats"]["mapped"] is False and got["stats"]["mapped_pool"] is None
    assert got["tokens"] == reference[prompt].tokens


def test_daemon_mapped_serves_local_output_reports_placement_and_keeps_exact_heat(store, reference):
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msmd"))
    own = Path(shutil.copytree(store, rt / "store"))
    counts = hot_counts(own)
    write_usage(usage_path(own), counts)
    saved = read_usage(usage_path(own)).total
    # Without the prompt cache: PROMPTS[0] comes twice, and each request's routed experts
    # are compared with its whole prompt's alone.
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt), MOESTREAM_PROMPT_CACHE_BYTES="0")
    paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
    layers = load_manifest(own).layers
    try:
        # `generate --mapped` starts a mapped daemon when none runs.
        out = ctl(
            "generate",
            PROMPTS[0],
            "--mapped",
            "--model",
            str(own),
            "--capacity",
            CAPACITY,
            "--max-tokens",
            str(N_TOKENS),
            "--json",
            env=env,
        )
        assert out.returncode == 0, out.stderr
        assert "starting one" in out.stderr
        first = json.loads(out.stdout)
        assert first["tokens"] == reference[PROMPTS[0]].tokens
        routed = first["stats"]["routed_experts"]
        assert routed == reference[PROMPTS[0]].stats.routed_experts

        with Client(paths) as c:
            # Interleaved on the engine thread: each gets the tokens it gets alone.
            streams = [c.generate(p, max_tokens=N_TOKENS) for p in PROMPTS]
            for s in streams:
                list(s)
        for p, s in zip(PROMPTS, streams):
            assert s.done.tokens == reference[p].tokens, p
            assert s.done.stats.mapped is True and s.done.stats.mapped_pool["routed"] > 0
        # A request's last ticks may account another's forwards, but none is lost.
        interleaved = sum(s.done.stats.routed_experts for s in streams)
        assert interleaved == sum(reference[p].stats.routed_experts for p in PROMPTS)
        routed += interleaved
        assert routed == first["stats"]["mapped_pool"]["routed"] + sum(
            s.done.stats.mapped_pool["routed"] for s in streams
        )

        st = json.loads(ctl("status", "--json", env=env).stdout)
        assert st["settings"]["mapped"] is True and st["pool"]["mapped"] is True
        placement = st["pool"]["mapped_pool"]
        assert placement["routed"] == routed > 0 and placement["gpu_slots"] == SLOTS
        assert all(layer["on_gpu"] == SLOTS for layer in st["pool"]["layers"])
        # Autopin placed the saved heat's hottest experts in GPU memory, pinning none.
        auto = st["autopin"]
        assert auto["mapped"] is True and auto["pinned"] == 0
        assert auto["layers"] == len(layers) and auto["placed"] == SLOTS * len(layers)
        assert "mapped" in ctl("status", env=env).stdout
        stats = json.loads(ctl("stats", "--json", env=env).stdout)
        assert stats["pool"]["mapped_pool"]["routed"] == routed
        assert "GPU hit rate" in ctl("stats", env=env).stdout

        stopped = ctl("stop", env=env)
        assert stopped.returncode == 0, stopped.stderr
        usage = read_usage(usage_path(own))
        assert usage.problem is None
        assert usage.total == saved + routed
        added = [sum(usage.counts[layer.ordinal].values()) - sum(counts[layer.ordinal].values()) for layer in layers]
        assert len(set(added)) == 1, "every MoE layer sees the same tokens"
    finally:
        ctl("stop", env=env)
        shutil.rmtree(rt, ignore_errors=True)


def test_autopin_places_the_hottest_experts_and_the_budget_holds(store, reference):
    counts = hot_counts(store)
    counts[load_manifest(store).layers[0].ordinal] = {}  # no heat: the default placement stays
    # Rebalancing soon and often, so that experts move while it decodes.
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped=True, mapped_rebalance_tokens=8))
    try:
        placement = sm.mapped_pool
        assert all(s == set(range(SLOTS)) for s in placement.on_gpu)
        summary = autopin(sm, counts, frac=0.5)
        assert summary.mapped and summary.pinned == 0 and summary.bytes_read == 0
        assert summary.layers == len(sm.pools) - 1 and summary.skipped_layers == 1
        assert summary.placed == SLOTS * (len(sm.pools) - 1)
        assert placement.on_gpu[0] == set(range(SLOTS))
        for i, pool in enumerate(sm.pools[1:], 1):
            assert placement.on_gpu[i] == set(hottest_first(counts[pool.layer.ordinal])[:SLOTS])
        # The placement keeps its budget as rebalancing moves experts afterwards.
        for p in PROMPTS:
            result = generate(sm, encode_prompt(sm, p, None), SamplingParams(max_tokens=N_TOKENS))
            assert result.tokens == reference[p].tokens
        assert sm.mapped_pool.stats.moves > 0
        assert all(len(s) == SLOTS for s in placement.on_gpu)
    finally:
        sm.close()
    cold = load_streaming_model(store, Settings(capacity=0.25, mapped=True))
    try:
        summary = autopin(cold, counts, frac=0.0)
        assert summary.placed == 0 and all(s == set(range(SLOTS)) for s in cold.mapped_pool.on_gpu)
    finally:
        cold.close()


def test_speculative_decoding_on_a_mapped_pool_leaves_the_routing_log_to_the_placement():
    demo = demo_store_path()
    slots = load_streaming_model(demo, Settings(capacity=0.25))
    sm = load_streaming_model(demo, Settings(capacity=0.25, mapped=True))
    try:
        prompt = encode_prompt(sm, "def read_lines(path):\n    ", None)
        plain = generate(slots, prompt, SamplingParams(max_tokens=N_TOKENS)).tokens

        # Through generation: a tick per token, settled at the end.
        result = generate(sm, prompt, SamplingParams(max_tokens=N_TOKENS, speculative="mtp", draft_tokens=2))
        assert result.tokens == plain
        assert result.stats.speculative["rounds"] > 0
        assert result.stats.mapped_pool["routed"] == result.stats.routed_experts > 0

        # The same rounds on a slot pool (which counts routing on the host, forward by
        # forward) and on the mapped pool: the verifies read as many experts, and every
        # forward's routing, verifies included, reached the placement.
        spec = SpeculativeParams("mtp", draft_tokens=2, fallback=False)
        got = {}
        for name, model in (("slots", slots), ("mapped", sm)):
            before = sum(p.stats.routed_total for p in model.pools)
            stats = SpeculativeStats(mode="mtp", draft_tokens_requested=2)
            tokens = []
            for t, _ in speculative_steps(
                model, prompt, sampler=lambda x: mx.argmax(x, axis=-1), max_tokens=N_TOKENS, spec=spec, stats=stats
            ):
                tokens.append(t)
                if model.mapped_pool is not None:
                    model.mapped_pool.tick()
            if model.mapped_pool is not None:
                model.mapped_pool.settle()
                assert all(p.route_log is not None for p in model.pools), "the placement's routing log was taken"
            got[name] = (
                tokens,
                stats.rounds,
                stats.spec_experts,
                sum(p.stats.routed_total for p in model.pools) - before,
            )
        assert got["mapped"] == got["slots"]
        assert got["mapped"][0] == plain and got["mapped"][2] > 0
    finally:
        sm.close()
        slots.close()


def test_a_host_without_room_for_every_expert_is_refused_before_loading(store, reference, tmp_path):
    manifest = load_manifest(store)
    need = manifest.expert_bytes_total
    assert need == sum(layer.num_experts * layer.expert_bytes for layer in manifest.layers) > 0
    check_mapped_host_memory(manifest, need + MAPPED_HOST_MARGIN)
    with pytest.raises(PoolCapacityError) as e:
        check_mapped_host_memory(manifest, need + MAPPED_HOST_MARGIN - 1)
    message = str(e.value)
    assert (
        f"take {format_size(need)} " in message
        and f"only {format_size(need + MAPPED_HOST_MARGIN - 1)} is available" in message
    )
    assert "--host-cache" in message and "drop --mapped" in message

    # Refused before the resident weights are read: a store without them fails on the
    # host check, not on the missing file.
    broken = Path(shutil.copytree(store, tmp_path / "store"))
    for name in manifest.resident_files:
        (broken / name).unlink()
    with pytest.raises(PoolCapacityError, match="--mapped keeps every expert in host memory"):
        load_streaming_model(broken, Settings(capacity=0.25, mapped=True), host_available=1 << 20)
    # A host tier given with --mapped must hold every expert (the mapped pool is then
    # that tier); a smaller one is refused, before loading, naming both sizes.
    with pytest.raises(PoolCapacityError) as e:
        load_streaming_model(broken, Settings(capacity=0.25, mapped=True, host_cache=need - 1))
    assert f"({format_size(need)})" in str(e.value) and f"--host-cache {format_size(need - 1)}" in str(e.value)
    sm = load_streaming_model(store, Settings(capacity=0.25, mapped=True, host_cache=need))
    try:
        assert sm.mapped_pool is not None and sm.admission_note["host_tier"].startswith("mapped")
        got = generate(sm, encode_prompt(sm, PROMPTS[0], None), SamplingParams(max_tokens=N_TOKENS))
        assert got.tokens == reference[PROMPTS[0]].tokens
    finally:
        sm.close()
    assert Settings.resolve({}, env={"MOESTREAM_MAPPED": "1"}, config_file=tmp_path / "none.toml").mapped is True


def test_mapped_auto_chooses_by_gpu_pool_tier_and_host_ram(store):
    """`mapped = auto` (the default): a mapped pool only with a CUDA copier, a partial
    pool, no host tier asked for and host RAM for every expert; here (CPU) the slot
    pool, saying why."""
    from moestream.daemon.model.streaming_model import MAPPED_HOST_MARGIN, choose_mapped

    manifest = load_manifest(store)
    need = manifest.expert_bytes_total + MAPPED_HOST_MARGIN
    auto = Settings()
    assert auto.mapped is None and Settings.from_values({"mapped": "auto"}).mapped is None
    assert choose_mapped(manifest, 4, auto, need, "") == (
        True,
        "on: an NVIDIA GPU, a partial pool and host RAM for every expert",
    )
    assert choose_mapped(manifest, 4, auto, need, "MLX runs on the CPU")[0] is False
    assert choose_mapped(manifest, 4, auto, need - 1, "")[1].startswith("off: host RAM")
    # A host tier that holds every expert is made as a mapped pool; a smaller one keeps
    # the slot pool (which reads what the tier lacks from disk).
    experts = manifest.expert_bytes_total
    assert choose_mapped(manifest, 4, auto.replace(host_cache=experts), need, "") == (
        True,
        "on: an NVIDIA GPU, a partial pool and a host tier that holds every expert, read in place",
    )
    assert choose_mapped(manifest, 4, auto.replace(host_cache=experts), need - 1, "")[1].startswith("off: host RAM")
    assert choose_mapped(manifest, 4, auto.replace(host_cache=experts), need, "MLX runs on the CPU")[0] is False
    small = choose_mapped(manifest, 4, auto.replace(host_cache=experts - 1), need, "")
    assert small[0] is False and "--host-cache" in small[1] and "holds part of the experts" in small[1]
    assert "every expert fits" in choose_mapped(manifest, 16, auto, need, "")[1]
    assert choose_mapped(manifest, 4, auto, need, "", naive=True)[0] is False
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        assert sm.mapped_pool is None and sm.pool_stats().mapped is False
        assert sm.admission_note["mapped_auto"] == "off: MLX runs on the CPU"
    finally:
        sm.close()
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msa"))
    try:
        assert ctl("start", "--model", str(store), "--capacity", CAPACITY, "--runtime-dir", str(rt)).returncode == 0
        with Client(RuntimePaths(dir=rt, log=rt / "daemon.log")) as c:
            st = c.status()
        assert st.settings["mapped"] == "auto" and st.pool.mapped is False
        assert st.pool.mapped_auto == "off: MLX runs on the CPU"
        assert "mapped pool (auto): off: MLX runs on the CPU" in (rt / "daemon.log").read_text()
        text = ctl("status", "--runtime-dir", str(rt))
        assert text.returncode == 0 and "mapped     auto, off: MLX runs on the CPU" in text.stdout
    finally:
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt, ignore_errors=True)


def test_batched_requests_leave_the_placement_unsettled_while_others_decode():
    """A batched request that ends while another decodes does not wait for the placement
    (the forward in flight, the worker's moves: the other would wait too); the last one
    settles it, and no routed expert is lost from the requests' statistics. On the demo
    model, whose tokens come out as text one by one (the tiny ones' are held as spaces)."""
    from moestream.daemon.model.batching import BatchSession
    from moestream.daemon.model.generation import GenerationResult, iter_generate

    sm = load_streaming_model(demo_store_path(), Settings(capacity=0.25, mapped=True))
    session = BatchSession(sm, max_batch=4)  # its probe's forward settled before the count starts
    settled: list[int] = []
    real_settle = sm.mapped_pool.settle

    def settle() -> None:  # the real settle, noting how many requests were still decoding
        settled.append(session.decoding())
        real_settle()

    sm.mapped_pool.settle = settle
    try:
        prompts = {"def read_lines(path):\n    ": N_TOKENS // 2, "import os\n\n\ndef walk(top):\n    ": N_TOKENS}
        alone = {
            p: generate(sm, encode_prompt(sm, p, None), SamplingParams(max_tokens=n)).tokens for p, n in prompts.items()
        }
        settled.clear()
        routed_before = sm.mapped_pool.stats.routed
        results = {p: GenerationResult() for p in prompts}
        gens = [
            iter_generate(sm, encode_prompt(sm, p, None), SamplingParams(max_tokens=n), results[p], batch=session)
            for p, n in prompts.items()
        ]
        while gens:  # the engine loop's round robin
            g = gens.pop(0)
            if next(g, None) is not None:
                gens.append(g)
        assert session.stats.max_size == 2 and session.stats.steps > 0 and settled == [0]
        for p in prompts:
            assert results[p].tokens == alone[p]
        routed = sum(r.stats.routed_experts for r in results.values())
        assert routed == sum(r.stats.mapped_pool["routed"] for r in results.values())
        assert routed == sm.mapped_pool.stats.routed - routed_before > 0
    finally:
        session.close()
        sm.close()
