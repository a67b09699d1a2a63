"""Speculative decoding (daemon/model/speculative.py): greedy output is token-identical to plain
decode at every pool capacity, for the demo model's MTP head, a tiny Qwen3-Next with an
MTP head converted from `mtp.*` tensors, a draft model, and a drafter that is right and
wrong on purpose (accept, reject and the recurrent-state replay), also when speculative
and plain blocks alternate for the whole request (every switch the fallback probe
makes); the probe's decision follows its rule; K shrinks to what the pool holds; the
daemon serves `speculative` requests and reports what they did."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import pytest
from tiny_models import make_tiny_model

from moestream.daemon.model.demo_mtp import MTP_FILE
from moestream.daemon.model.generation import SamplingParams, encode_prompt, generate
from moestream.daemon.model.mtp_head import Qwen3NextMTP, load_mtp_head
from moestream.daemon.model.speculative import (
    SpeculativeParams,
    SpeculativeStats,
    _Probe,
    _Watch,
    effective_draft_tokens,
    speculative_steps,
)
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared import protocol as proto
from moestream.shared.settings import Settings, demo_store_path
from moestream.shared.store_format import load_manifest

N = 32
DEMO_PROMPT = "def read_lines(path):\n    "
TINY_PROMPT = "The expert store keeps every expert"


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def spec_tokens(
    sm, prompt: list[int], spec: SpeculativeParams, n: int = N, drafter=None
) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats(mode=spec.mode, draft_tokens_requested=spec.draft_tokens)
    steps = speculative_steps(sm, prompt, sampler=_greedy, max_tokens=n, spec=spec, stats=stats, drafter=drafter)
    return [t for t, _ in steps], stats


def plain_tokens(sm, prompt: list[int], n: int = N) -> list[int]:
    return generate(sm, prompt, SamplingParams(max_tokens=n)).tokens


@pytest.fixture(scope="module")
def tiny_stores():
    root = Path(tempfile.mkdtemp(prefix="msspec"))
    try:
        stores = {}
        for name, arch, quant, mtp in (
            ("next", "qwen3_next", "f32", True),
            ("next4", "qwen3_next", "4bit", True),
            ("moe", "qwen3_moe", "f32", False),
        ):
            src = make_tiny_model(root / f"{name}-model", arch, quant=quant, seed=3, mtp=mtp)
            convert_model(src, root / name)
            stores[name] = root / name
        yield stores
    finally:
        shutil.rmtree(root)


# The partial pool in the default run (its drafts also exercise the pool's reads); every
# expert resident with `-m slow`.
@pytest.mark.parametrize("capacity", [pytest.param(1.0, marks=pytest.mark.slow), 0.25])
def test_demo_mtp_is_token_identical_to_plain_decode(capacity):
    sm = load_streaming_model(demo_store_path(), Settings(capacity=capacity))
    try:
        prompt = encode_prompt(sm, DEMO_PROMPT, None)
        want = plain_tokens(sm, prompt)
        for k in (1, 3):
            # fallback=False: K as given, so at 25% (16 slots) K=3 verifies overflow the pool.
            got, stats = spec_tokens(sm, prompt, SpeculativeParams("mtp", draft_tokens=k, fallback=False))
            assert got == want, (capacity, k)
            assert stats.rounds > 0 and stats.proposed > 0
            assert stats.accepted > 0  # the trained head does predict tokens
            assert not stats.fell_back
            d = stats.to_dict()
            # Each round emits its accepted drafts plus the verifier's own token.
            assert stats.spec_tokens == stats.accepted + stats.rounds
            # A verify reads per MoE layer at least top_k experts and at most top_k per
            # token it routes (K+1), whatever is accepted.
            per_round = d["experts_read_per_accepted_token"] * stats.spec_tokens / stats.rounds
            assert 8 * 5 <= per_round <= 8 * 5 * (k + 1)
        # The switches the fallback probe makes, for the whole request: a plain block of
        # one token, then a speculative one, and so on (K as given, so 25% overflows).
        alternating = SpeculativeParams("mtp", draft_tokens=2, fallback=False, probe_tokens=1, alternate=True)
        got, stats = spec_tokens(sm, prompt, alternating)
        assert got == want, (capacity, "alternating")
        assert stats.switches >= 10 and stats.plain_tokens >= 5 and stats.accepted > 0
        assert not stats.fell_back
    finally:
        sm.close()


def test_generate_with_mtp_reports_speculation_and_falls_back_only_on_measurement():
    sm = load_streaming_model(demo_store_path(), Settings(capacity=1.0))
    try:
        prompt = encode_prompt(sm, DEMO_PROMPT, None)
        # The probe takes at most 3 pairs of blocks of 9 tokens (3 rounds of K + 1).
        want = plain_tokens(sm, prompt, 64)
        result = generate(sm, prompt, SamplingParams(max_tokens=64, speculative="mtp", draft_tokens=2))
        assert result.tokens == want
        spec = result.stats.speculative
        assert spec["mode"] == "mtp" and spec["draft_tokens"] == 2
        assert 0.0 < spec["acceptance_rate"] <= 1.0
        assert spec["plain_experts_read_per_token"] == 8 * 5  # one token: top_k per MoE layer
        # The ABBA probe measured both; the decision follows the measurement.
        ratios = spec["probe_speed_ratios"]
        assert 2 <= len(ratios) <= 3
        faster = (
            sorted(ratios)[len(ratios) // 2] > 1
            and spec["probe_tokens_per_s_speculative"] > spec["probe_tokens_per_s_plain"]
        )
        assert spec["fell_back"] == (not faster)
        assert (spec["reason"] is not None) == (not faster)
    finally:
        sm.close()


def test_a_penalised_or_logprobs_request_decodes_without_speculation():
    """Speculation verifies drafts on the model's own logits and yields no
    log-probabilities: a request with logits processors or logprobs runs without it (its
    statistics say so), and makes the tokens it makes without asking for speculation."""
    sm = load_streaming_model(demo_store_path(), Settings(capacity=1.0))
    try:
        prompt = encode_prompt(sm, DEMO_PROMPT, None)
        for controls in (proto.SamplingControls(presence_penalty=1.5), proto.SamplingControls(logprobs=0)):
            plain = generate(sm, prompt, SamplingParams(max_tokens=16, controls=controls))
            asked = generate(sm, prompt, SamplingParams(max_tokens=16, controls=controls, speculative="mtp"))
            assert asked.stats.speculative is None and "without speculation" in asked.stats.speculative_off
            assert asked.tokens == plain.tokens
        penalised = generate(
            sm, prompt, SamplingParams(max_tokens=16, controls=proto.SamplingControls(presence_penalty=1.5))
        )
        assert penalised.tokens != generate(sm, prompt, SamplingParams(max_tokens=16)).tokens
        assert generate(sm, prompt, SamplingParams(max_tokens=16, speculative="mtp")).stats.speculative is not None
    finally:
        sm.close()


def test_k_shrinks_to_what_a_partial_pool_holds():
    sm = load_streaming_model(demo_store_path(), Settings(capacity=16))  # top_k 8
    try:
        assert effective_draft_tokens(sm, 3)[0] == 1
        assert "shrunk from 3 to 1" in effective_draft_tokens(sm, 3)[1]
    finally:
        sm.close()
    sm = load_streaming_model(demo_store_path(), Settings(capacity=12))
    try:
        k, reason = effective_draft_tokens(sm, 2)
        assert k == 0 and "speculation is off" in reason
        prompt = encode_prompt(sm, DEMO_PROMPT, None)
        got, stats = spec_tokens(sm, prompt, SpeculativeParams("mtp", draft_tokens=2))
        assert got == plain_tokens(sm, prompt)
        assert stats.fell_back and stats.rounds == 0
    finally:
        sm.close()


def test_convert_keeps_the_qwen3_next_mtp_head(tiny_stores):
    for name in ("next", "next4"):
        assert isinstance(load_mtp_head(tiny_stores[name], load_manifest(tiny_stores[name]).config), Qwen3NextMTP)
    assert not (tiny_stores["moe"] / MTP_FILE).is_file()
    sm = load_streaming_model(tiny_stores["moe"], Settings(capacity=1.0))
    try:
        with pytest.raises(Exception, match="has no MTP head"):
            spec_tokens(sm, [1, 2, 3], SpeculativeParams("mtp"))
    finally:
        sm.close()


@pytest.mark.parametrize(
    "capacity", [pytest.param(1.0, marks=pytest.mark.slow), pytest.param(0.5, marks=pytest.mark.slow), 0.25]
)
def test_qwen3_next_mtp_is_token_identical_to_plain_decode(tiny_stores, capacity):
    sm = load_streaming_model(tiny_stores["next"], Settings(capacity=capacity))
    try:
        prompt = encode_prompt(sm, TINY_PROMPT, None)
        want = plain_tokens(sm, prompt)
        got, stats = spec_tokens(sm, prompt, SpeculativeParams("mtp", draft_tokens=2, fallback=False))
        assert got == want
        # A random head is mostly wrong: rejected drafts restore the linear-attention state.
        assert stats.rounds > 0 and stats.replays > 0
        for probe_tokens in (1, 2):
            alternating = SpeculativeParams(
                "mtp", draft_tokens=2, fallback=False, probe_tokens=probe_tokens, alternate=True
            )
            got, stats = spec_tokens(sm, prompt, alternating)
            assert got == want, probe_tokens
            assert stats.switches >= N // (2 * probe_tokens + 3) and stats.replays > 0
    finally:
        sm.close()


class OracleDrafter:
    """Proposes the reference continuation, spoiled on purpose in two rounds of three."""

    need_hidden = True

    def __init__(self, reference: Sequence[int]) -> None:
        self.reference = list(reference)
        self.seen = 0
        self.round = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.seen = 1

    def observe(self, hidden, next_tokens) -> None:
        self.seen += int(next_tokens.size)

    def propose(self, k: int) -> mx.array:
        start = self.seen
        drafts = [self.reference[i] if i < len(self.reference) else 0 for i in range(start, start + k)]
        self.round += 1
        if self.round % 3 == 1:
            drafts[0] = (drafts[0] + 1) % 512
        elif self.round % 3 == 2:
            drafts[-1] = (drafts[-1] + 1) % 512
        return mx.array(drafts, mx.uint32)


@pytest.mark.parametrize("name", ["next", "moe"])
def test_accepted_and_rejected_drafts_keep_the_output(tiny_stores, name):
    sm = load_streaming_model(tiny_stores[name], Settings(capacity=0.5 if name == "next" else 1.0))
    try:
        prompt = encode_prompt(sm, TINY_PROMPT, None)
        want = plain_tokens(sm, prompt)
        for alternate in (False, True):
            spec = SpeculativeParams("mtp", draft_tokens=3, fallback=False, probe_tokens=2, alternate=alternate)
            got, stats = spec_tokens(sm, prompt, spec, drafter=OracleDrafter(prompt + want))
            assert got == want, alternate
            assert 0 < stats.accepted < stats.proposed
            assert (stats.replays > 0) == (name == "next")  # only recurrent state is replayed
            assert (stats.switches > 4) == alternate
    finally:
        sm.close()


def _probe_decides(ratios_and_blocks: list[tuple[float, float]], pairs: int = 3) -> SpeculativeStats:
    """Feed `_Probe` pairs of (speculative, plain) tokens/s, in its own block order."""
    probe = _Probe(SpeculativeParams("mtp", probe_pairs=pairs))
    stats = SpeculativeStats(mode="mtp", draft_tokens_requested=2)
    for spec_tps, plain_tps in ratios_and_blocks:
        for _ in range(2):
            kind = probe.block()
            probe.record(kind, 10, 10 / (spec_tps if kind == "spec" else plain_tps), stats)
        if not probe.probing:
            break
    return stats


def test_probe_decides_on_the_median_and_never_keeps_a_slower_speculation():
    assert _Probe(SpeculativeParams("mtp")).block() == "spec"
    # Two pairs clearly on one side: decided early, either way.
    keep = _probe_decides([(150, 100), (140, 100), (10, 100)])
    assert not keep.fell_back and len(keep.probe_ratios) == 2 and keep.reason is None
    drop = _probe_decides([(50, 100), (60, 100), (500, 100)])
    assert drop.fell_back and len(drop.probe_ratios) == 2 and "not faster" in drop.reason
    # One noisy pair does not decide: the median of three does.
    noisy = _probe_decides([(90, 100), (95, 100), (90, 10)])
    assert noisy.fell_back and len(noisy.probe_ratios) == 3
    noisy = _probe_decides([(120, 100), (115, 100), (110, 20)])
    assert not noisy.fell_back and len(noisy.probe_ratios) == 3
    # The median says faster but a slow speculative block makes the pooled speeds say
    # slower: plain decode is kept.
    split = _probe_decides([(101, 100), (102, 100), (10, 100)])
    assert sorted(split.probe_ratios)[1] > 1 and split.fell_back
    assert _probe_decides([(120, 100)], pairs=1).fell_back is False


def test_watch_falls_back_after_two_slow_windows_in_a_row_only():
    stats = SpeculativeStats(mode="mtp", draft_tokens_requested=3)
    watch = _Watch(plain_tps=100.0)
    for tps in (150, 80, 140, 85, 120):  # slow windows, never two in a row
        watch.record(32, 32 / tps, stats)
    assert not stats.fell_back and stats.reason is None
    assert [round(r, 2) for r in stats.watch_ratios] == [1.5, 0.8, 1.4, 0.85, 1.2]
    watch.record(32, 32 / 70, stats)
    assert not stats.fell_back
    watch.record(32, 32 / 60, stats)
    assert stats.fell_back and "slower than plain decode after the probe" in stats.reason
    assert "0.70, 0.60" in stats.reason


@pytest.mark.parametrize(
    "name,capacity", [pytest.param("demo", 1.0, marks=pytest.mark.slow), ("demo", 0.25), ("next", 0.5), ("moe", 1.0)]
)
def test_bucketed_key_lengths_keep_the_output(tiny_stores, name, capacity):
    """Keys padded to buckets of 8 (the CUDA default is 256; 8 makes forwards cross
    bucket boundaries often): every drafter and cache kind stays token-identical."""
    store = demo_store_path() if name == "demo" else tiny_stores[name]
    sm = load_streaming_model(store, Settings(capacity=capacity))
    try:
        prompt = encode_prompt(sm, DEMO_PROMPT if name == "demo" else TINY_PROMPT, None)
        want = plain_tokens(sm, prompt)
        mode = dict(mode="draft", draft_model=str(store)) if name == "moe" else dict(mode="mtp")
        for alternate in (False, True):
            spec = SpeculativeParams(
                **mode, draft_tokens=3, fallback=False, probe_tokens=2, alternate=alternate, key_bucket=8
            )
            got, stats = spec_tokens(sm, prompt, spec)
            assert got == want, alternate
            assert stats.to_dict()["key_bucket"] == 8 and stats.rounds > 0
        # By default only CUDA pads (where new key lengths cost 40 ms): elsewhere
        # speculation keeps mlx-lm's caches.
        _, stats = spec_tokens(sm, prompt, SpeculativeParams(**mode, draft_tokens=2, fallback=False), n=8)
        cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
        assert stats.to_dict()["key_bucket"] == (256 if cuda else 0)
    finally:
        sm.close()


def test_draft_model_is_token_identical(tiny_stores):
    sm = load_streaming_model(tiny_stores["moe"], Settings(capacity=0.5))
    try:
        prompt = encode_prompt(sm, TINY_PROMPT, None)
        want = plain_tokens(sm, prompt)
        # The model drafting for itself: drafts are nearly always right.
        spec = SpeculativeParams("draft", draft_tokens=2, draft_model=str(tiny_stores["moe"]), fallback=False)
        got, stats = spec_tokens(sm, prompt, spec)
        assert got == want
        assert stats.accepted > 0.8 * stats.proposed
    finally:
        sm.close()


def test_protocol_speculative_fields():
    msg = proto.Generate(id="a", prompt="x", speculative="mtp", draft_tokens=3)
    assert proto.decode_request(proto.encode(msg)) == msg
    plain = proto.encode(proto.Generate(id="b", prompt="x"))
    assert b"speculative" not in plain  # older daemons still read it
    for bad in (
        dict(speculative="eagle"),
        dict(speculative="draft"),
        dict(speculative="mtp", draft_tokens=9),
        dict(draft_tokens=2),
    ):
        with pytest.raises(proto.ProtocolError):
            proto.decode_request(proto.encode(proto.Generate(id="c", prompt="x", **bad)))


def test_daemon_serves_speculative_requests():
    from test_daemon import clean_env, ctl, paths_of

    from moestream.client.client import Client

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msq"))
    out = ctl(
        "start", "--model", str(demo_store_path()), "--capacity", "0.25", "--runtime-dir", str(rt), env=clean_env()
    )
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        with Client(paths_of(rt)) as client:
            stream = client.generate(DEMO_PROMPT, max_tokens=N)
            for _ in stream:
                pass
            want = stream.done.tokens
            spec = client.generate(DEMO_PROMPT, max_tokens=N, speculative="mtp", draft_tokens=2)
            for _ in spec:
                pass
            assert spec.done.tokens == want
            s = spec.done.stats.speculative
            assert s["mode"] == "mtp" and s["draft_tokens"] == 1  # 16 slots: K shrinks to 1
            assert "shrunk from 2 to 1" in s["reason"] or s["fell_back"]
    finally:
        stopped = ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
        assert stopped.returncode == 0, stopped.stderr


def test_generate_cli_speculative_flags():
    import json

    from test_daemon import clean_env, ctl

    args = ["generate", "--local", "--model", str(demo_store_path()), "--max-tokens", "16", "--json", DEMO_PROMPT]
    plain = ctl(*args, env=clean_env())
    spec = ctl(*args, "--speculative", "mtp", "--draft-tokens", "2", env=clean_env())
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["tokens"] == b["tokens"]
    assert a["stats"]["speculative"] is None and b["stats"]["speculative"]["mode"] == "mtp"
    bad = ctl("generate", "--local", "--speculative", "draft", "x", env=clean_env())
    assert bad.returncode != 0 and "--draft-model" in bad.stderr


def test_hf_layout_mtp_tensors_are_stacked_and_their_norms_shifted(tiny_stores):
    from moestream.daemon.model.mtp_head import MTP_FILE, sanitize_mtp_weights

    mlx_layout = mx.load(str(tiny_stores["next"] / MTP_FILE))
    hf = {}
    for k, v in mlx_layout.items():
        if ".switch_mlp." in k:
            for e in range(v.shape[0]):
                hf[k.replace("switch_mlp", f"experts.{e}")] = v[e]
        elif v.ndim == 1 and "norm" in k:
            hf[k] = v - 1.0  # Hugging Face keeps zero-centred norms
        else:
            hf[k] = v
    back = sanitize_mtp_weights(hf, num_experts=8)
    assert set(back) == set(mlx_layout)
    for k, v in mlx_layout.items():
        assert mx.allclose(back[k], v, atol=1e-6).item(), k


def test_speculative_report_columns_line_up():
    """`bench decode --speculative`'s table: each column is as wide as its widest cell,
    so every row's cells sit under the header's names (right-aligned numbers end where
    the name ends, the left-aligned names start where it starts), also where a cell is
    "-" or a note runs long."""
    from moestream.daemon.bench.speculative import format_speculative_report

    spec = {
        "draft_tokens": 1,
        "acceptance_rate": 0.75,
        "experts_read_per_accepted_token": 41.25,
        "reason": "draft_tokens shrunk from 2 to 1: the pool holds 16 experts per layer",
    }
    rows = [
        {
            "capacity": 1.0,
            "name": "plain",
            "tokens_per_s": 20.06,
            "speed_vs_plain": 1.0,
            "plain_experts_read_per_token": 40,
            "same_tokens_as_plain": True,
            "first_diff": None,
        },
        {
            "capacity": 0.25,
            "name": "mtp-k2-auto",
            "tokens_per_s": 123.4,
            "speed_vs_plain": 0.85,
            "plain_experts_read_per_token": 40,
            "same_tokens_as_plain": False,
            "first_diff": 17,
            "speculative": spec,
            "after_decision_vs_plain": 0.9,
        },
        {
            "capacity": 0.25,
            "name": "mtp-k3",
            "tokens_per_s": 7.0,
            "speed_vs_plain": 0.473,
            "plain_experts_read_per_token": None,
            "same_tokens_as_plain": True,
            "first_diff": None,
            "speculative": {**spec, "draft_tokens": 3, "reason": None},
        },
    ]
    report = {
        "model_type": "qwen3_moe",
        "device": "cpu",
        "mode": "mtp",
        "decode_tokens": 16,
        "rounds": 1,
        "results": rows,
    }
    header, *lines = format_speculative_report(report).splitlines()[1:]
    names = [
        "capacity",
        "config",
        "K",
        "tok/s",
        "x plain",
        "accept",
        "exp/tok",
        "plain exp/tok",
        "same",
        "after",
        "note",
    ]
    starts, at = [], 0
    for name in names:  # in order, so that "exp/tok" is not found inside "plain exp/tok"
        at = header.index(name, at)
        starts.append(at)
        at += len(name)
    for line in lines:
        for name, start in zip(names, starts):
            if name in ("config", "note"):
                if name == "note" and len(line) <= start:
                    continue  # no note: the line ends before it
                assert line[start - 1] == " " and line[start] != " ", (name, line)
            else:
                end = start + len(name)
                assert line[end - 1] != " " and line[end : end + 1] in ("", " "), (name, line)
    cells = [line.split() for line in lines]
    assert [c[1] for c in cells] == ["plain", "mtp-k2-auto", "mtp-k3"]
    assert cells[0][2:10] == ["-", "20.1", "1.000", "-", "-", "40", "True", "-"] and len(cells[0]) == 10
    assert cells[1][2:10] == ["1", "123.4", "0.850", "0.75", "41.2", "40", "@17", "0.900"]
    assert lines[1].endswith(" 0.900 " + spec["reason"]) and not lines[2].endswith(" ")
