"""The prompt cache (daemon/model/prompt_cache.py) serves only what it may, exactly.

Exactness: a request served from the cache gives the same log-probabilities (bit for
bit) and greedy tokens as stock mlx-lm given the same reuse: stock's model prefills the
first request's prompt in the same chunks, its `generate_step` makes the same tokens on
that cache, and the second request runs through stock's `generate_step` over a copy of
that cache (trimmed back where the prompt cache trims). Four architectures, one of them
(qwen3_5_moe) with linear-attention layers whose cache cannot be trimmed, at 25% and
100% of the experts; exact match, a shorter cached prefix and a longer entry trimmed.

Safety: a cache made for another prompt is never served (its contents are checked
against a fresh prefill of the new prompt's own prefix), nor a file of another store
or one whose contents are not what its name and header say; memory stays within the
bounds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as stock_load
from mlx_lm.generate import BatchGenerator, generate_step, generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler
from stock_runs import stepped
from tiny_models import make_tiny_model

from moestream.daemon.model import prompt_cache_files
from moestream.daemon.model.batching import BatchSession
from moestream.daemon.model.generation import CacheUse, GenerationResult, SamplingParams, iter_generate, plain_steps
from moestream.daemon.model.prompt_cache import PromptCache, read_metadata
from moestream.daemon.model.prompt_tree import sequence_bytes
from moestream.daemon.model.shared_prefill import prefill_key
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.store_format import load_manifest

ARCHS = ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3")
STEP = 16  # several prefill chunks per prompt, so the layer-major order runs at 25%
GEN = 4
GREEDY = make_sampler(temp=0.0)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """`build(arch) -> (arch, store, stock model)`, each made once for the module."""
    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"pcache-{arch}")
            src = make_tiny_model(root / "model", arch, quant="4bit", seed=3)
            convert_model(src, root / "store")
            made[arch] = (arch, root / "store", stock_load(str(src))[0])
        return made[arch]

    return get


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, build):
    return build(request.param)


def _layout(model) -> list[str]:
    return [type(c).__name__ for c in make_prompt_cache(model)]


def _new_cache(model, **kw) -> PromptCache:
    return PromptCache("test-store", _layout(model), max_bytes=kw.pop("max_bytes", 2**30), max_entries=16, **kw)


def _ours(sm, pc: PromptCache, prompt: list[int]) -> tuple[tuple[list[int], list[np.ndarray]], CacheUse]:
    """One request through `plain_steps` with the prompt cache, kept at the end as
    `iter_generate` keeps it."""
    use = CacheUse(pc)
    out = stepped(plain_steps(sm, prompt, GREEDY, GEN, prefill_step=STEP, cache_use=use))
    use.keep(prompt, out[0])
    return out, use


def _stock_first(model, prompt: list[int]):
    """Stock's first request (its prefill loop, as `generate_step` runs it, then its
    last token through `generate_step`), with the cache after the prompt but its last
    token (the snapshot an untrimmable cache keeps) and the cache after the request."""
    cache = make_prompt_cache(model)
    head = mx.array(prompt[:-1])
    with mx.stream(generation_stream):
        for start in range(0, head.size, STEP):
            model(head[start : start + STEP][None], cache=cache)
            mx.eval([c.state for c in cache])
    snapshot = copy.deepcopy(cache)
    out = stepped(generate_step(mx.array(prompt[-1:]), model, max_tokens=GEN, sampler=GREEDY, prompt_cache=cache))
    return out, snapshot, cache


def _stock_reuse(model, cache, prompt: list[int], reused: int, trim: int = 0):
    cache = copy.deepcopy(cache)
    if trim:
        assert trim_prompt_cache(cache, trim) == trim
    steps = generate_step(
        mx.array(prompt[reused:]), model, max_tokens=GEN, sampler=GREEDY, prompt_cache=cache, prefill_step_size=STEP
    )
    return stepped(steps)


def _same(got, want, label: str) -> None:
    assert got[0] == want[0], f"{label}: tokens differ"
    for step, (a, b) in enumerate(zip(got[1], want[1])):
        assert np.array_equal(a, b), f"{label} step {step}: log-probs differ (max |d|={np.abs(a - b).max()})"


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, size=n).tolist()


def _capacities(store) -> list[tuple[str, Settings]]:
    manifest = load_manifest(store)
    experts = manifest.layers[0].num_experts
    return [
        ("25%", Settings(capacity=max(4, math.ceil(0.25 * experts)), direct_io=True)),
        ("100%", Settings(capacity=experts, direct_io=True)),
    ]


def test_served_from_the_cache_is_stock_given_the_same_reuse(converted):
    arch, store, stock = converted
    first = _prompt(40, seed=1)
    want_first, snapshot, after = _stock_first(stock, first)
    answer = want_first[0]
    trimmable = arch != "qwen3_5_moe"
    n = len(first)
    cases = {
        # The same prompt again: all of it but its last token.
        "exact": (first, n - 1, after if trimmable else snapshot, len(answer) + 1 if trimmable else 0),
        # The next chat turn: the first prompt and its answer, then more.
        "shorter": (first + answer + _prompt(20, seed=2), n + len(answer), after, 0),
        # A prompt that leaves the first one after 24 tokens: trimmed back to them (an
        # untrimmable cache has no snapshot there: nothing reused).
        "longer": (first[:24] + _prompt(30, seed=3), 24 if trimmable else 0, after, n + len(answer) - 24),
    }
    for label, settings in _capacities(store):
        sm = load_streaming_model(store, settings)
        try:
            for case, (prompt, reused, source, trim) in cases.items():
                pc = _new_cache(stock)
                got_first, use = _ours(sm, pc, first)
                _same(got_first, want_first, f"{arch} {label} first request")
                assert use.reused == 0
                got, use = _ours(sm, pc, prompt)
                assert use.reused == reused, f"{arch} {label} {case}: reused {use.reused}, not {reused}"
                if reused:
                    want = _stock_reuse(stock, source, prompt, reused, trim if trimmable else 0)
                else:
                    want = stepped(
                        generate_step(mx.array(prompt), stock, max_tokens=GEN, sampler=GREEDY, prefill_step_size=STEP)
                    )
                _same(got, want, f"{arch} {label} {case}")
        finally:
            sm.close()


def _kv_rows(cache, tokens: int) -> list[np.ndarray]:
    """Each attention layer's keys and values for the first `tokens` positions."""
    rows = []
    for c in cache:
        if type(c).__name__ == "KVCache":
            rows += [c.keys[..., :tokens, :], c.values[..., :tokens, :]]
        else:
            rows += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return [np.array(a.astype(mx.float32)) for a in rows]


def _prefilled(model, prompt: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_a_cache_of_another_prompt_is_never_served(converted):
    """Whatever is served holds the new prompt's own prefix: its keys and values (and
    linear-attention state) are those a fresh prefill of that prefix makes, to float
    rounding; another prompt's would differ everywhere."""
    arch, store, stock = converted
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        pc = _new_cache(stock)
        first = _prompt(40, seed=1)
        _ours(sm, pc, first)
        other = [t + 1 for t in first]  # no shared prefix at all
        assert pc.fetch(other) is None
        for k in (1, 5, 17):
            # The same first k tokens, then another path; and the first prompt with one token changed.
            tails = ([(first[k] + 3) % 500] + _prompt(20, seed=9), [(first[k] + 7) % 500] + first[k + 1 :])
            for prompt in (first[:k] + tail for tail in tails):
                reuse = pc.fetch(prompt)
                if arch == "qwen3_5_moe":
                    assert reuse is None, "an untrimmable cache has no snapshot inside the first prompt"
                    continue
                assert reuse is not None and reuse.tokens == k
                assert all(c.offset == k for c in reuse.cache if hasattr(c, "offset"))
                for a, b in zip(_kv_rows(reuse.cache, k), _kv_rows(_prefilled(stock, prompt[:k]), k)):
                    # bfloat16 rounding apart; another prompt's rows differ by their whole size.
                    assert np.allclose(a, b, rtol=0.05, atol=0.05), f"{arch}: a served cache is not this prefix's"
        # Another store's cache object is never in this one's trie; a wrong answer check:
        # serving `first`'s cache for `other` would have failed above. The entry itself is untouched:
        again = pc.fetch(first + [1])
        assert again is not None and again.tokens == len(first) - (arch == "qwen3_5_moe")
    finally:
        sm.close()


def test_memory_stays_within_its_bounds(converted):
    arch, store, stock = converted
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        probe = _new_cache(stock)
        _ours(sm, probe, _prompt(30, seed=0))
        one = probe.stats.bytes
        assert one > 0 and probe.stats.entries >= 1
        bound = int(2.5 * one)
        pc = PromptCache("test-store", _layout(stock), max_bytes=bound, max_entries=3)
        for i in range(6):
            _ours(sm, pc, [i] + _prompt(29, seed=100 + i))  # no two share a first token
            (tree,) = [s.tree for s in pc._scopes.values()]
            held = [node for node in tree._nodes() if node.end]
            assert pc.stats.bytes == sum(n.nbytes for n in tree._nodes())
            assert pc.stats.bytes <= bound and pc.stats.entries <= 3 and pc.stats.entries == len(held)
        assert pc.stats.evicted > 0
        stats = pc.stats.to_dict()
        assert stats["lookups"] == 6 and stats["hits"] == 0 and stats["hit_rate"] == 0.0
        # A single cache larger than the bound is refused, never kept.
        tiny = PromptCache("test-store", _layout(stock), max_bytes=one // 4, max_entries=3)
        _ours(sm, tiny, _prompt(30, seed=7))
        assert tiny.stats.entries == 0 and tiny.stats.bytes == 0 and tiny.stats.refused >= 1
    finally:
        sm.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_disk_round_trip_and_bad_files(build, arch, tmp_path):
    """A cache written to disk is found by a new PromptCache (a restarted daemon) and
    serves the same output as from memory; another store's file, a file whose token
    list is not its name's, and a truncated file are skipped, never served."""
    _, store, stock = build(arch)
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder = tmp_path / "pc"
    try:
        first = _prompt(40, seed=1)
        pc = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)
        (answer, _), _ = _ours(sm, pc, first)
        pc.close()
        assert len(list(folder.glob("*.safetensors"))) == 1 and pc.stats.disk_written == 1
        # The conversation's tokens are in the file: its owner's only.
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in folder.glob("*.safetensors"))
        nxt = first + answer + _prompt(10, seed=4)
        memory = _new_cache(stock)
        _ours(sm, memory, first)
        from_memory, use = _ours(sm, memory, nxt)
        assert use.reused == len(first) + len(answer)
        # A restart: the file is indexed; the next turn is served from disk, exactly.
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)
        assert again.stats.disk_entries == 1 and again.stats.entries == 0
        from_disk, use = _ours(sm, again, nxt)
        assert use.from_disk and use.reused == len(first) + len(answer)
        _same(from_disk, from_memory, f"{arch}: served from disk")
        again.close()
        assert len(list(folder.glob("*.safetensors"))) == 2
        # Another store's folder: skipped, kept (it is that store's), never served.
        foreign = PromptCache(
            "another-store", _layout(stock), max_bytes=2**30, max_entries=4, disk_dir=folder, disk_bytes=2**30
        )
        assert foreign.stats.disk_entries == 0 and foreign.stats.disk_skipped >= 2
        assert foreign.fetch(nxt) is None
        foreign.close()
        # A file renamed to another token list's name: removed at start.
        target = max(folder.glob("test-store-*.safetensors"), key=lambda p: p.stat().st_size)
        meta = read_metadata(target)
        tokens = json.loads(meta["tokens"])
        bogus = folder / "test-store-0123456789abcdef0123456789abcdef.safetensors"
        shutil.copy(target, bogus)
        # A truncated file whose header is whole: indexed, then refused when read.
        data = target.read_bytes()
        target.write_bytes(data[: len(data) - 64])
        third = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)
        assert not bogus.exists() and third.stats.disk_skipped >= 1
        prompt = tokens + [7]
        reuse = third.fetch(prompt)
        assert not target.exists(), "the truncated file is removed once found bad"
        assert reuse is None or (not reuse.from_disk or reuse.tokens < len(tokens))
        third.close()
    finally:
        sm.close()


def test_a_prefix_of_a_longer_file_reads_only_the_blocks_it_uses(build, tmp_path, monkeypatch):
    """A file of 90-odd tokens serving a prompt that shares its first 20 reads the two
    16-token blocks that hold them, and serves what memory serves; a flipped byte in a
    later block does not stop that prefix being served, and is caught once the whole file
    is read (then removed)."""
    monkeypatch.setattr(prompt_cache_files, "BLOCK_TOKENS", 16)
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder, key = tmp_path / "pc", tmp_path / "state" / "prompt-cache.key"
    try:
        first = _prompt(90, seed=11)
        pc = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        (answer, _), _ = _ours(sm, pc, first)
        pc.close()
        (path,) = folder.glob("*.safetensors")
        size, held = path.stat().st_size, len(json.loads(read_metadata(path)["tokens"]))
        assert held > 80
        nxt = first[:20] + _prompt(8, seed=12)
        memory = _new_cache(stock)
        _ours(sm, memory, first)
        from_memory, use = _ours(sm, memory, nxt)
        assert use.reused == 20
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        from_disk, use = _ours(sm, again, nxt)
        assert use.from_disk and use.reused == 20
        _same(from_disk, from_memory, "a prefix read from a longer file")
        # What the read put in memory holds those 20 tokens and claims no more (the file
        # moved aside, so that memory alone answers).
        path.rename(folder / "aside")
        kept = again.fetch(first[:60] + [5])
        assert kept is not None and kept.tokens == 20 and not kept.from_disk
        again.close()
        (folder / "aside").rename(path)
        cache, _, _ = prompt_cache_files.load_cache_file(path, prompt_cache_files.user_key(key), 2**30, 20)
        assert all(c.offset == 20 == c.keys.shape[2] for c in cache)
        head = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
        read = again.stats.disk_read_bytes - head
        assert read < (size - head) * 40 / held, f"read {read} of {size - head} array bytes for 32 of {held} tokens"
        # A flipped byte near the file's end: outside the prefix's blocks (the file the
        # last request left is removed, so that this one serves again).
        for other in set(folder.glob("*.safetensors")) - {path}:
            other.unlink()
        data = bytearray(path.read_bytes())
        data[-8] ^= 0x40
        path.write_bytes(bytes(data))
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        from_disk, use = _ours(sm, again, nxt)
        again.close()
        assert use.from_disk and use.reused == 20 and path.exists()
        _same(from_disk, from_memory, "a prefix read before a changed block")
        for other in set(folder.glob("*.safetensors")) - {path}:
            other.unlink()
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        whole = first + answer + [3]
        assert again.fetch(whole) is None and not path.exists() and again.stats.disk_skipped == 1
        again.close()
    finally:
        sm.close()


def _one_file(sm, stock, folder) -> int:
    """The size of the file one 30-token request leaves in `folder`."""
    probe = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)
    _ours(sm, probe, _prompt(30, seed=0))
    probe.close()
    return max(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_disk_stays_within_its_bound(build, tmp_path):
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder = tmp_path / "pc"
    try:
        bound = int(2.5 * _one_file(sm, stock, folder / "probe"))
        pc = _new_cache(stock, disk_dir=folder / "bounded", disk_bytes=bound)
        for i in range(5):
            _ours(sm, pc, _prompt(30, seed=50 + i))
            pc.idle()
        pc.close()
        sizes = [p.stat().st_size for p in (folder / "bounded").glob("*.safetensors")]
        assert sum(sizes) <= bound and len(sizes) == 2 and pc.stats.disk_dropped == 3
        assert pc.stats.disk_entries == 2
    finally:
        sm.close()


def test_iter_generate_reports_cached_tokens(build):
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        pc = _new_cache(stock)
        first = _prompt(30, seed=1)
        r1 = GenerationResult()
        list(iter_generate(sm, first, SamplingParams(max_tokens=GEN), r1, prompt_cache=pc))
        r2 = GenerationResult()
        list(iter_generate(sm, first + r1.tokens + [5, 6], SamplingParams(max_tokens=GEN), r2, prompt_cache=pc))
        assert r1.stats.cached_tokens == 0
        assert r2.stats.cached_tokens == len(first) + len(r1.tokens)
        use = r2.stats.prompt_cache
        assert use.reused_tokens == r2.stats.cached_tokens and use.from_disk is False
        assert 0 < use.fetch_seconds < r2.stats.prompt_seconds
        # The prompt past the cached prefix was prefilled (stock's chunks here: all fits).
        assert r2.stats.prefill["tokens"] == 1 and r2.stats.prefill["seconds"] > 0
        assert pc.stats.to_dict()["hit_rate"] == 0.5
    finally:
        sm.close()


def _stock_batch_decode(model, cache, last: int, eos: list[int]):
    """Stock's BatchGenerator from `cache` and the prompt's last token: the tokens, and
    the request's cache out of the batch with the tokens it holds beyond `cache`."""
    gen = BatchGenerator(model, stop_tokens=[[e] for e in eos], completion_batch_size=4, prefill_batch_size=4)
    (uid,) = gen.insert([[last]], max_tokens=[GEN], caches=[cache], samplers=[GREEDY])
    out = []
    while True:
        rs = [r for r in gen.next_generated() if r.uid == uid]
        out += [int(r.token) for r in rs]
        ended = [r for r in rs if r.finish_reason is not None]
        if ended:
            break
    gen.close()
    return out, ended[0].prompt_cache, list(ended[0].all_tokens)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_cached_prefixes_seed_batched_requests(build, arch):
    """A batched request starts from the prompt cache too (prefilled on that cache's
    copy) and leaves its cache there: the same greedy tokens as stock's
    BatchGenerator given the same cache (the first request's cache out of the batch,
    trimmed back, or its prompt's snapshot where it cannot be trimmed)."""
    _, store, stock = build(arch)
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        session = BatchSession(sm, max_batch=4)
        pc = _new_cache(stock)
        eos = sorted(sm.tokenizer.eos_token_ids)
        first = _prompt(30, seed=1)
        ours_first = [int(t) for t, _ in session.steps(first, GREEDY, GEN, cache_use=CacheUse(pc))]
        snapshot = _prefilled(stock, first[:-1])
        want_first, final, fed = _stock_batch_decode(stock, copy.deepcopy(snapshot), first[-1], eos)
        assert ours_first == want_first and pc.stats.refused == 0
        nxt = first + _prompt(12, seed=2)
        use = CacheUse(pc)
        got = [int(t) for t, _ in session.steps(nxt, GREEDY, GEN, cache_use=use)]
        if arch == "qwen3_5_moe":
            assert use.reused == len(first) - 1, "the first prompt's snapshot seeds the second"
            cache = copy.deepcopy(snapshot)
        else:
            assert use.reused == len(first), "the first request's cache, trimmed back to its prompt"
            cache = copy.deepcopy(final)
            trim_prompt_cache(cache, len(first) - 1 + len(fed) - use.reused)
        stock(mx.array(nxt[use.reused : -1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        assert got == _stock_batch_decode(stock, cache, nxt[-1], eos)[0]
        session.close()
    finally:
        sm.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_requests_joining_a_decoding_batch_keep_and_reuse_the_prompt_cache(build, arch):
    """Requests that join a decoding batch: one from an empty prefix, then one from the
    prefix the first left in the prompt cache. Each makes the greedy tokens it makes
    alone, the cache keys the first one's final cache by its whole prompt and tokens, and
    the second reuses it."""
    _, store, _ = build(arch)
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        session = BatchSession(sm, max_batch=4)
        pc = _new_cache(sm.model)
        busy = session.steps(_prompt(9, seed=5), GREEDY, 40)
        next(busy)  # decoding: the prompts below join the batch
        first = _prompt(20, seed=6)
        ours = [int(t) for t, _ in session.steps(first, GREEDY, GEN, cache_use=CacheUse(pc)) if t is not None]
        assert session.stats.max_size == 2
        assert ours == [int(t) for t, _ in plain_steps(sm, first, GREEDY, GEN)]
        nxt = first + ours + _prompt(6, seed=7)
        use = CacheUse(pc)
        got = [int(t) for t, _ in session.steps(nxt, GREEDY, GEN, cache_use=use) if t is not None]
        # The first request's cache out of the batch holds its prompt and every token it
        # made (each was fed before it was returned), all of them a prefix of the next.
        assert use.reused == len(first) + len(ours)
        assert got == [int(t) for t, _ in plain_steps(sm, nxt, GREEDY, GEN)]
        busy.close()
        session.close()
    finally:
        sm.close()


def test_a_store_without_a_store_id_is_named_by_its_manifest(tmp_path):
    from moestream.daemon.model.prompt_cache import cache_identity
    from moestream.shared.settings import demo_store_path

    assert cache_identity(tmp_path, "abc") == "abc"
    named = cache_identity(demo_store_path(), None)
    assert named.startswith("manifest-") and named == cache_identity(demo_store_path(), None)
    (tmp_path / "manifest.json").write_text("{}")
    assert cache_identity(tmp_path, None) != named


def test_the_disk_folder_must_be_private_and_its_files_are_never_links_or_fifos(build, tmp_path):
    """Another user who made the folder first could plant a link at the temporary name
    (the daemon then overwrote the target) or a FIFO (the index hung for good): a folder
    open to others, or a link, is refused (memory only, said in status); in a private
    folder a FIFO is removed, not read, and a link at the temporary name is replaced,
    never written through."""
    _, store, stock = build("qwen3_moe")
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o777)
    open_folder.chmod(0o777)
    pc = _new_cache(stock, disk_dir=open_folder, disk_bytes=2**30)
    assert pc.stats.disk_dir is None and "open to other users" in pc.stats.disk_problem
    pc.close()
    link = tmp_path / "link"
    link.symlink_to(open_folder)
    pc = _new_cache(stock, disk_dir=link, disk_bytes=2**30)
    assert pc.stats.disk_dir is None and "not a folder" in pc.stats.disk_problem
    pc.close()

    folder = tmp_path / "pc"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / "test-store-0123456789abcdef0123456789abcdef.safetensors")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        pc = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)  # returns: the FIFO is not read
        assert pc.stats.disk_dir == str(folder) and pc.stats.disk_skipped == 1
        assert not any(p.is_fifo() for p in folder.iterdir())
        prompt = _prompt(30, seed=3)
        (answer, _), _ = _ours(sm, pc, prompt)
        pc.close()
        written = next(folder.glob("*.safetensors"))
        (written.parent / (written.name + ".tmp")).symlink_to(victim)
        written.unlink()
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30)
        _ours(sm, again, prompt)
        again.close()
        assert victim.read_bytes() == b"keep me" and written.is_file() and not written.is_symlink()
    finally:
        sm.close()


def _unique_positions(sequences: list[list[int]]) -> int:
    """Positions a tree of these sequences holds: one per distinct prefix."""
    return len({tuple(s[: i + 1]) for s in sequences for i in range(len(s))})


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_branches_keep_their_shared_prefix_once_and_each_its_own_continuation(build, arch):
    """A main agent and two subagents under one system prompt: the system prompt's rows
    are held once, each branch's next turn reuses its own whole history (never another
    branch's), exactly as stock does from that branch's own cache."""
    _, store, stock = build(arch)
    system = _prompt(48, seed=20)
    firsts = [system + _prompt(12, seed=21 + b) for b in range(3)]
    sm = load_streaming_model(store, _capacities(store)[0][1])
    try:
        pc = _new_cache(stock)
        answers = []
        for first in firsts:
            (tokens, _), _ = _ours(sm, pc, first)
            answers.append(tokens)
        kept = [first + answer for first, answer in zip(firsts, answers)]
        assert pc.stats.branches == 3
        # Every request's own cache holds its prompt and its answer (plain_steps feeds the last token too).
        held = kept
        one = _prefilled(stock, [1])
        one_row = sequence_bytes([c for c in one if type(c).__name__ == "KVCache"], 1)
        # The linear-attention layers' state, kept whole at each entry's end (a prompt's
        # boundary and its answer's end: it cannot be trimmed back to either).
        snapshot = sequence_bytes([c for c in one if type(c).__name__ != "KVCache"], 1)
        assert pc.stats.bytes == one_row * _unique_positions(held) + snapshot * pc.stats.entries, (
            "the system prompt's rows are held once"
        )
        assert pc.stats.entries == (3 if arch == "qwen3_moe" else 6)
        for b, first in enumerate(firsts):
            turn = kept[b] + _prompt(8, seed=40 + b)
            want_first, snapshot, after = _stock_first(stock, first)
            got, use = _ours(sm, pc, turn)
            assert use.reused == len(held[b]), f"branch {b}: reused {use.reused} of its {len(held[b])}"
            _same(got, _stock_reuse(stock, after, turn, use.reused), f"{arch} branch {b}")
    finally:
        sm.close()


def test_a_prompt_that_leaves_every_branch_gets_only_what_it_shares(build):
    """Served rows are always the new prompt's own prefix: a prompt that shares only the
    system prompt with three branches gets its rows, and those of no branch."""
    _, store, stock = build("qwen3_moe")
    system = _prompt(32, seed=30)
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        pc = _new_cache(stock)
        for b in range(3):
            _ours(sm, pc, system + _prompt(10, seed=31 + b))
        for tail_seed in (50, 51):
            prompt = system + _prompt(10, seed=tail_seed)
            reuse = pc.fetch(prompt)
            assert reuse is not None and reuse.tokens == len(system)
            for a, b in zip(_kv_rows(reuse.cache, len(system)), _kv_rows(_prefilled(stock, system), len(system))):
                assert np.allclose(a, b, rtol=0.05, atol=0.05), "a served cache is not this prefix's"
        # Inside a branch's own tokens: up to where the prompt leaves it, not a token more.
        branch = system + _prompt(10, seed=31)
        reuse = pc.fetch(branch[:40] + [(branch[40] + 1) % 500, 7, 7])
        assert reuse is not None and reuse.tokens == 40
    finally:
        sm.close()


def test_disk_writes_stay_within_the_days_budget(build, tmp_path):
    """Past the day's write budget, caches stay in memory only; the day's count survives a
    restart; a cache that a trimmable file on disk already holds is not written again."""
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder = tmp_path / "pc"
    try:
        probe = _new_cache(stock, disk_dir=tmp_path / "probe", disk_bytes=2**30)
        _ours(sm, probe, _prompt(30, seed=0))
        probe.idle()
        one = probe.stats.disk_written_today
        probe.close()
        assert one > 0
        budget = int(2.5 * one)
        pc = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, write_budget=budget)
        for i in range(4):
            _ours(sm, pc, [i] + _prompt(29, seed=60 + i))
            pc.idle()
        pc.close()
        assert len(list(folder.glob("*.safetensors"))) == 2 and pc.stats.disk_over_budget == 2
        assert pc.stats.disk_written_today <= budget
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, write_budget=budget)
        assert again.stats.disk_written_today == pc.stats.disk_written_today
        _ours(sm, again, [9] + _prompt(29, seed=70))
        again.idle()
        again.close()
        assert again.stats.disk_over_budget == 1 and len(list(folder.glob("*.safetensors"))) == 2
        # A prefix of a file on disk is not written again.
        fresh = _new_cache(stock, disk_dir=tmp_path / "prefix", disk_bytes=2**30)
        long = _prompt(30, seed=80)
        _ours(sm, fresh, long)
        fresh.idle()
        fresh.close()
        written = fresh.stats.disk_written_today
        fresh = _new_cache(stock, disk_dir=tmp_path / "prefix", disk_bytes=2**30)
        fresh.insert(long[:20], _prefilled(stock, long[:20]), persist=True)
        fresh.idle()
        fresh.close()
        assert fresh.stats.disk_written_today == written and len(list((tmp_path / "prefix").glob("*.safetensors"))) == 1
    finally:
        sm.close()


def _rewrite_header(data: bytes, edit) -> bytes:
    """A safetensors file with its header changed by `edit(header)` (its arrays kept)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + n :]


def test_a_changed_or_foreign_cache_file_fails_its_mac_is_removed_and_never_served(build, tmp_path):
    """Flipped bytes, a relabelled dtype, swapped dimensions or another key's MAC: the
    file is refused when read, removed, and the prompt prefilled afresh; the key is the
    user's, 0600; the good file still serves."""
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder, key = tmp_path / "pc", tmp_path / "state" / "prompt-cache.key"
    try:
        first = _prompt(40, seed=1)
        pc = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        (answer, _), _ = _ours(sm, pc, first)
        pc.close()
        assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
        (path,) = folder.glob("*.safetensors")
        good = path.read_bytes()
        tensor = next(k for k in json.loads(good[8 : 8 + struct.unpack("<Q", good[:8])[0]]) if k != "__metadata__")

        def relabel(h):
            h[tensor]["dtype"] = "F16" if h[tensor]["dtype"] != "F16" else "BF16"

        def swap(h):
            shape = h[tensor]["shape"]
            shape[1], shape[2] = shape[2], shape[1]

        flipped = bytearray(good)
        flipped[-100] ^= 0x40
        other_key = tmp_path / "other" / "prompt-cache.key"
        cases = {
            "a flipped byte": (bytes(flipped), key),
            "a relabelled dtype": (_rewrite_header(good, relabel), key),
            "swapped dimensions": (_rewrite_header(good, swap), key),
            "another user's key": (good, other_key),
        }
        nxt = first + answer + [7]
        for case, (data, key_file) in cases.items():
            path.write_bytes(data)
            again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key_file)
            assert again.stats.disk_entries == 1, case
            assert again.fetch(nxt) is None, f"{case}: served"
            assert not path.exists() and again.stats.disk_skipped == 1, f"{case}: not removed"
            again.close()
        path.write_bytes(good)
        again = _new_cache(stock, disk_dir=folder, disk_bytes=2**30, key_file=key)
        reuse = again.fetch(nxt)
        assert reuse is not None and reuse.from_disk and reuse.tokens == len(first) + len(answer)
        again.close()
    finally:
        sm.close()


def test_the_disk_bound_is_the_folders_not_each_stores(build, tmp_path):
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    folder = tmp_path / "pc"
    try:
        bound = int(3.5 * _one_file(sm, stock, tmp_path / "probe"))
        for store_id in ("store-a", "store-b"):
            pc = PromptCache(
                store_id, _layout(stock), max_bytes=2**30, max_entries=16, disk_dir=folder, disk_bytes=bound
            )
            for i in range(3):
                _ours(sm, pc, [i] + _prompt(29, seed=90 + i))
                pc.idle()
            pc.close()
        sizes = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
        assert sum(sizes.values()) <= bound and len(sizes) == 3, sizes
        assert sum(name.startswith("store-b-") for name in sizes) == 3, "the oldest files went first, store-a's"
    finally:
        sm.close()


def test_a_scope_never_reuses_another_scopes_caches(build, tmp_path):
    """Requests of one scope (a client's identity) never get another's cache, in memory or
    from disk, nor join its prefill; the same scope reuses its own; memory is bounded
    across scopes."""
    _, store, stock = build("qwen3_moe")
    sm = load_streaming_model(store, Settings(direct_io=True))
    try:
        pc = _new_cache(stock, disk_dir=tmp_path / "pc", disk_bytes=2**30)
        secret = _prompt(30, seed=5)
        use = CacheUse(pc, "alice")
        out = stepped(plain_steps(sm, secret, GREEDY, GEN, prefill_step=STEP, cache_use=use))
        use.keep(secret, out[0])
        probe = secret + [1, 2]
        assert pc.fetch(probe, "mallory") is None and pc.fetch(probe) is None
        reuse = pc.fetch(probe, "alice")
        assert reuse is not None and reuse.tokens == len(secret)
        pc.close()
        # From disk after a restart: alice's file serves alice only.
        again = _new_cache(stock, disk_dir=tmp_path / "pc", disk_bytes=2**30)
        assert again.stats.disk_entries == 1
        assert again.fetch(probe, "mallory") is None
        reuse = again.fetch(probe, "alice")
        assert reuse is not None and reuse.from_disk
        assert again.stats.scopes == 1
        again.close()
    finally:
        sm.close()
    assert prefill_key(secret, True, 16, "alice") != prefill_key(secret, True, 16, "mallory")
