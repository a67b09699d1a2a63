"""The elastic pool (daemon/pool/elastic.py): under memory pressure the pool and host tier
give memory back, between steps, and take it again once it passes; the output stays stock
mlx-lm's bit for bit; below the floor a daemon refuses new requests with a clear error.

The pressure is always driven by the test (`ManualPressure` in-process, a `file:` source
for a daemon), never read from this machine, and the in-process rule runs on a clock the
test advances: what happens at which step does not depend on the machine's load."""

from __future__ import annotations

import gc
import logging
import shutil
import sys
import tempfile
import weakref
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from daemon_cli import ctl, wait_for
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from pool_store import ManualPressure
from stock_runs import GREEDY, LogitsRecorder
from test_openai_gateway import Gateway
from tiny_models import make_tiny_model

from moestream.daemon.model.generation import plain_steps
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.pool.elastic import ElasticPool
from moestream.daemon.pool.host_tier import HostTier
from moestream.daemon.pool.pressure import (
    AvailablePressure,
    FilePressure,
    MacPressure,
    Pressure,
    PsiPressure,
    pressure_source,
)
from moestream.daemon.store.convert import convert_model
from moestream.shared.settings import Settings
from moestream.shared.status import ElasticStatus, ResizeEvent, Status, from_wire

TOKENS = 256
# A prompt of three chunks at this step: the layer-major prefill yields between layers,
# and the pool is resized there too.
PROMPT = 40
PREFILL_STEP = 16
LOG = logging.getLogger("test_elastic_pool")


class Clock:
    """The rule's clock: each tick of the test is a second later (past its poll interval
    and its settle time), so every tick reads the pressure and may act."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen3_moe (16 experts per layer, top-4): its folder, store and stock model."""
    root = tmp_path_factory.mktemp("elastic")
    src = make_tiny_model(root / "model", "qwen3_moe", quant="4bit", seed=5)
    convert_model(src, root / "store")
    model, _ = stock_load(str(src))
    return src, root / "store", model


def _prompt() -> list[int]:
    return np.random.default_rng(PROMPT).integers(0, 512, size=PROMPT).tolist()


def _stock(model) -> tuple[list[int], list[np.ndarray]]:
    recorder = LogitsRecorder(model)
    steps = generate_step(
        mx.array(_prompt()), recorder, max_tokens=TOKENS, sampler=GREEDY, prefill_step_size=PREFILL_STEP
    )
    tokens = [int(token) for token, _ in steps]
    return tokens, recorder.steps(len(tokens))


# The pressure the test sets when the decode reaches each token (prefill: before the first).
SCHEDULE = {"prefill": "critical", 8: "normal", 64: "warn", 128: "critical", 192: "normal"}


@pytest.mark.parametrize("host_cache", ["0", "96K"], ids=["pool", "pool+host-tier"])
def test_a_greedy_decode_at_half_the_experts_shrinks_to_top_k_grows_back_and_equals_stock(tiny, host_cache):
    """256 greedy tokens at 50% (8 of 16 slots, half of them pinned), the pressure driven
    between steps and between the prefill's layers: critical during the prefill (the floor,
    top-k: 4 slots, nothing pinned), normal (8 again, the pins back), warn (halved down to
    the floor, one step a tick), critical, normal. Every logit and token equals stock
    mlx-lm's; the pool's arrays (and the host tier's bytes) shrank and grew with it."""
    src, store, stock = tiny
    want_tokens, want_logits = _stock(stock)
    sm = load_streaming_model(store, Settings().replace(capacity=0.5, host_cache=host_cache, prefill="layer"))
    try:
        for pool in sm.pools:  # pinned as a warm start pins them: a quarter, hottest first
            pool.pin([3, 11, 7, 0])
        made_pins = [set(p.pinned) for p in sm.pools]
        assert all(len(pins) == 4 for pins in made_pins)  # pin keeps top-k slots free: 8 - 4
        source, clock = ManualPressure(), Clock()
        elastic = ElasticPool(source, LOG, clock=clock)
        elastic.attach(sm)
        full_bytes, tier_bytes = sm.pool_bytes, elastic.status().configured_tier_bytes
        assert (host_cache == "0") == (tier_bytes == 0)
        trace: list[tuple[int, int, int, int]] = []  # (token, slots, pinned, tier bytes)

        def tick(at: int | str) -> None:
            if at in SCHEDULE:
                source.set(SCHEDULE[at])
            clock.now += 1.0
            elastic.tick()
            st = elastic.status()
            trace.append((-1 if at == "prefill" else at, st.slots, len(sm.pools[0].pinned), st.tier_bytes))

        recorder = LogitsRecorder(sm.model)
        sm.model, model = recorder, sm.model
        got_tokens: list[int] = []
        try:
            steps = plain_steps(sm, _prompt(), GREEDY, TOKENS, prefill_step=PREFILL_STEP, pieces=True)
            for token, _ in steps:
                if token is None:
                    tick("prefill")  # between two layers of the prefill
                    continue
                got_tokens.append(int(token))
                tick(len(got_tokens))
        finally:
            sm.model = model
        got_logits = recorder.steps(len(got_tokens))
        assert len(got_tokens) == TOKENS
        for step, (a, b) in enumerate(zip(got_logits, want_logits)):
            assert np.array_equal(a, b), f"step {step}: logits differ (max |d|={np.abs(a - b).max()})"
        assert got_tokens == want_tokens

        slots = {at: s for at, s, _, _ in trace}
        assert any(at == -1 and s == 4 for at, s, _, _ in trace), "the prefill did not run at the floor"
        assert slots[7] == 4 and slots[8] == 8  # back to the made size once the pressure passed
        # Warn halves the share above the floor: 8 -> 6 -> 5 -> 4, one step a tick.
        assert [slots[t] for t in range(63, 68)] == [8, 6, 5, 4, 4]
        assert slots[130] == 4 and slots[191] == 4 and slots[192] == 8 and slots[TOKENS] == 8
        pinned = {at: p for at, _, p, _ in trace}
        assert pinned[7] == 0 and pinned[8] == 4 and pinned[65] == 1 and pinned[66] == 0 and pinned[TOKENS] == 4
        assert [set(p.pinned) for p in sm.pools] == made_pins  # the same experts pinned again
        assert sm.pool_bytes == full_bytes and all(p.capacity == 8 for p in sm.pools)
        if tier_bytes:
            tiers = {at: t for at, _, _, t in trace}
            assert tiers[7] == 4 * 4096 < tiers[8] == tier_bytes and tiers[65] < tier_bytes
        events = elastic.status().events
        assert [e.slots_to for e in events] == [4, 8, 6, 5, 4, 8]
        assert events[0].level == "critical" and events[0].pool_bytes_to == full_bytes // 2
        assert "memory pressure critical" in events[0].reason and "passed" in events[-1].reason
    finally:
        sm.close()


def _slot_bytes(pool, slot: int) -> bytes:
    return b"".join(np.array(pool.arrays[t.name][slot].view(mx.uint8)).tobytes() for t in pool.layer.tensors)


def _expert_bytes(store: Path, pool, expert: int) -> bytes:
    """The expert's tensors as the store holds them (the layer file's block)."""
    layer = pool.layer
    raw = np.fromfile(store / layer.file, dtype=np.uint8)
    block = raw[expert * layer.stride : expert * layer.stride + layer.stride]
    return b"".join(block[t.offset : t.offset + t.nbytes].tobytes() for t in layer.tensors)


def test_a_shrink_gives_back_the_coldest_then_the_pinned_and_keeps_every_slot_true(tiny):
    """ExpertPool.resize: the policy's victims (LRU: least recently routed) go first,
    then the pinned ones a shrink unpinned, least routed first; every expert kept is in
    a slot of the new, smaller arrays with its own bytes; a grow pins again what was
    unpinned, and the arrays (and MLX's active memory) follow the size."""
    src, store, _ = tiny
    sm = load_streaming_model(store, Settings().replace(capacity=12, prefetch="off"))
    try:
        pool = sm.pools[0]
        pool.pin([0, 1, 2, 3, 4, 5, 6, 7])  # hottest first; 12 - top-4 = 8 pinned
        assert len(pool.pinned) == 8
        # Routed: 8..11 in this order (8 least recently), and the pinned 5 most, then 1.
        for row in ([8, 9, 10, 11], [5, 1, 2, 3], [5, 1, 9, 10], [11, 5, 0, 4]):
            pool.ensure(np.array([row]), decode=True)
        assert len(pool._resident) == 12 and pool.capacity == 12
        # The arrays a shrink must let go (MLX rounds such small buffers up, and other
        # threads of the test process allocate: references, not a byte count).
        before = [weakref.ref(a) for a in pool.arrays.values()]

        def resident() -> set[int]:
            return {int(e) for e in np.flatnonzero(pool.slot_of >= 0)}

        # 10 slots: 6 pins left, the 6 hottest (5 and 1 most routed, then 0, 2, 3, 4 once
        # each, in pin order); the LRU's victims go: 8, then 9 (9 and 10 were routed again
        # before 11 was).
        assert pool.resize(10) == 2
        assert resident() == set(range(8)) | {10, 11} and pool.pinned == {5, 1, 0, 2, 3, 4}
        assert pool.unpinned == [6, 7]
        # 6 slots: 2 pins left (5, 1); the plain residents go, then the unpinned, least routed first.
        assert pool.resize(6) == 4
        mx.synchronize()
        mx.clear_cache()
        assert pool.pinned == {5, 1} and pool.unpinned == [0, 2, 3, 4, 6, 7]
        assert resident() == {0, 1, 2, 3, 4, 5}
        assert all(a.shape[0] == 6 for a in pool.arrays.values())
        for e in resident():
            slot = int(pool.slot_of[e])
            assert pool.expert_in[slot] == e and slot < 6
            assert _slot_bytes(pool, slot) == _expert_bytes(store, pool, e)
        gc.collect()
        assert pool.nbytes == 6 * pool.layer.expert_bytes and not [r for r in before if r() is not None]
        read = pool.resize(12)
        assert read > 0 and len(pool.pinned) == 8 and pool.unpinned == []
        assert {0, 1, 2, 3, 4, 5, 6, 7} == pool.pinned
        for e in np.flatnonzero(pool.slot_of >= 0):
            assert _slot_bytes(pool, int(pool.slot_of[e])) == _expert_bytes(store, pool, int(e))
        assert pool.resize(1) >= 0 and pool.capacity == pool.top_k  # never below the floor
    finally:
        sm.close()


def test_a_full_pool_shrinks_by_heat_and_is_whole_again_when_it_grows(tiny):
    """A pool of every expert (the default) shrinks too: nothing is pinned but the hottest,
    its lookups leave the device (slot ids), and a grow to every expert loads them all
    again and maps ids on the device as before."""
    _, store, stock = tiny
    sm = load_streaming_model(store, Settings())
    try:
        pool = sm.pools[0]
        assert pool.fully_resident
        pool.stats.routed[[9, 4, 12]] = [5, 3, 1]
        pool.resize(6)
        assert not pool.fully_resident and pool.capacity == 6 and pool.pinned == {9, 4}
        assert {9, 4, 12} <= {int(e) for e in np.flatnonzero(pool.slot_of >= 0)}
        pool.resize(16)
        assert pool.fully_resident and pool.pinned == set(range(16))
    finally:
        sm.close()


def test_the_host_tier_keeps_its_most_recent_experts_and_gives_back_its_pages(tmp_path):
    """HostTier.resize: the most recently used experts stay (moved below the new size), the
    pages above it go back to the system (on Linux they then read as zeros, the kernel's
    sign that they were dropped), and a grow takes them again."""
    stride = 1 << 16
    tier = HostTier(8, stride, None)
    view = tier.view
    for e in range(8):
        slot, _ = tier.assign((0, e), set())
        view[slot * stride : (slot + 1) * stride] = bytes([e + 1]) * stride
    for e in (6, 2, 7):  # the most recently used: 6, 2, 7
        tier.lookup((0, e))
    tier.resize(3)
    assert tier.slots == 3 and len(tier) == 3 and tier.free_slots == 0
    for e in (6, 2, 7):
        slot = tier.lookup((0, e))
        assert slot is not None and slot < 3 and view[slot * stride] == e + 1 == view[(slot + 1) * stride - 1]
    assert not tier.holds((0, 0))
    if sys.platform.startswith("linux"):
        assert tier.released and bytes(view[3 * stride :]) == bytes(5 * stride)
    tier.resize(100)  # at most what it was made with
    assert tier.slots == 8 and tier.free_slots == 5 and len(tier) == 3
    slot, evicted = tier.assign((1, 0), set())
    assert slot >= 3 and not evicted


def test_the_rule_halves_under_warn_floors_under_critical_refuses_after_and_grows_when_it_passes(tiny):
    """The rule on its own clock: a reading at most every poll interval; warn halves the
    share above the floor once a settle time; critical takes the floor at once and refuses
    new requests once it has lasted a settle time there; normal for a settle time grows
    back. Off without a source, and with a mapped pool."""
    _, store, _ = tiny
    sm = load_streaming_model(store, Settings().replace(capacity=12))
    try:
        source, clock = ManualPressure(), Clock()
        el = ElasticPool(source, LOG, clock=clock, poll_seconds=0.25, settle_seconds=1.0)
        el.attach(sm)
        assert el.tick() is None and el.slots() == 12  # normal: nothing to do
        source.set("warn", "PSI some avg10 12.0%")
        clock.now += 0.1
        assert el.tick() is None  # within the poll interval: not even read
        clock.now += 0.2
        ev = el.tick()
        assert isinstance(ev, ResizeEvent) and (ev.slots_from, ev.slots_to) == (12, 8)
        assert ev.reason == "memory pressure warn (PSI some avg10 12.0%)" and ev.seconds >= 0
        clock.now += 0.5
        assert el.tick() is None and el.slots() == 8  # not settled yet
        clock.now += 0.5
        assert el.tick().slots_to == 6
        source.set("critical")
        clock.now += 0.3
        assert el.tick().slots_to == 4 and not el.refusing
        clock.now += 0.5
        assert el.tick() is None and not el.refusing  # at the floor, not a settle time yet
        clock.now += 0.6
        assert el.tick() is None and el.refusing
        assert "critical memory pressure" in el.why_refused() and "floor (4 slots per layer" in el.why_refused()
        source.set("warn")
        clock.now += 0.3
        assert el.tick() is None and not el.refusing and el.slots() == 4  # no longer refused, not grown
        source.set("normal")
        clock.now += 0.3
        assert el.tick() is None and el.slots() == 4  # pressure seen less than a settle time ago
        clock.now += 1.0
        assert el.tick().slots_to == 12
        st = from_wire(ElasticStatus, el.status().to_dict())  # as it crosses the socket
        assert st == el.status() and [e.slots_to for e in st.events] == [8, 6, 4, 12]
        assert (st.slots, st.configured_slots, st.floor_slots, st.source) == (12, 12, 4, "manual")
        el.detach()
        assert el.tick() is None and not el.refusing
    finally:
        sm.close()
    off = ElasticPool(None, LOG)
    assert off.tick() is None and off.status().source is None and "off" in off.status().note


def test_the_pressure_sources_read_psi_meminfo_and_a_file_with_their_hysteresis(tmp_path):
    psi = tmp_path / "memory"
    source = PsiPressure(psi)
    assert not source.available()

    def stall(some: float, full: float) -> str:
        rest = "avg60=0.00 avg300=0.00 total=1"
        psi.write_text(f"some avg10={some:.2f} {rest}\nfull avg10={full:.2f} {rest}\n")
        return source.read().level

    assert stall(0.0, 0.0) == "normal" and source.available()
    assert stall(12.0, 0.0) == "warn" and stall(6.0, 0.0) == "warn" and stall(4.0, 0.0) == "normal"
    assert stall(30.0, 11.0) == "critical" and stall(30.0, 6.0) == "critical" and stall(30.0, 4.0) == "warn"
    assert "PSI some avg10 30.0%, full avg10 4.0%" == source.read().detail
    meminfo = tmp_path / "meminfo"
    avail = AvailablePressure(meminfo)

    def available(share: float) -> str:
        meminfo.write_text(f"MemTotal: 1000000 kB\nMemFree: 1 kB\nMemAvailable: {int(share * 1e6)} kB\n")
        return avail.read().level

    assert available(0.5) == "normal" and available(0.08) == "warn" and available(0.04) == "critical"
    assert available(0.09) == "critical" and available(0.11) == "warn" and available(0.25) == "normal"
    assert "GiB" in avail.read().detail
    level = tmp_path / "level"
    fp = FilePressure(level)
    assert fp.read().level == "normal"  # no file yet
    level.write_text("critical from the test\n")
    assert fp.read() == FilePressure(level).read() and fp.read().level == "critical"
    assert fp.read().detail == "from the test"
    level.write_text("panic")
    assert fp.read().level == "normal" and "no level" in fp.read().detail
    assert pressure_source("off") is None and isinstance(pressure_source(f"file:{level}"), FilePressure)
    # macOS: the kernel's level by sysctl (a stand-in C library here), 1 normal, 2 warn, 4 critical.

    class Libc:
        value, rc = 1, 0

        def sysctlbyname(self, name, value, size, new, new_size):
            assert name == b"kern.memorystatus_vm_pressure_level" and new is None
            value._obj.value = self.value
            return self.rc

    libc = Libc()
    mac = MacPressure(libc)
    for value, want in ((1, "normal"), (2, "warn"), (4, "critical")):
        libc.value = value
        assert mac.read() == Pressure(want, f"kern.memorystatus_vm_pressure_level {value}")
    libc.rc = -1
    assert mac.read().level == "normal" and "unreadable" in mac.read().detail
    assert pressure_source("auto") is not None  # Linux: PSI or MemAvailable; macOS: its level
    with pytest.raises(ValueError, match="auto, off or file:PATH"):
        pressure_source("sometimes")


# ---- a real daemon ------------------------------------------------------------------------

PROMPT_TEXT = "def fibonacci(n):"  # greedy, the demo loops on it and never ends: stopped by a cancel


def test_a_daemon_resizes_during_a_decode_refuses_below_the_floor_and_serves_once_the_pressure_passes():
    """A real daemon on the demo at 50% (32 of 64 slots, top-8) with a host tier, one
    request decoded at a time, its pressure read from a file the test writes. A decode
    runs through a shrink to top-k and a grow back; a second request waits in the queue.
    Critical again, with the pool at its floor: a new request is refused with a clear
    error (code memory_pressure; the gateway's 503 to the real OpenAI client), `status`,
    `moestreamctl status` and the dashboard's state say why and show the resizes; the
    decode is cancelled and the queued request is held, not started. Once the pressure
    passes it is served and the pool grows back. Both made the local run's tokens."""
    from moestream.client.client import Client, RequestRejected, Token
    from moestream.daemon.bench.soak.driver import DaemonProcess, reference_outputs
    from moestream.shared.settings import demo_store_path

    store = demo_store_path()
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mse"))
    level = rt / "pressure"
    daemon = DaemonProcess.start(
        store,
        rt / "rt",
        capacity="0.5",
        flags={"host_cache": "2M"},
        knobs={"memory_pressure": f"file:{level}"},
        env={"MOESTREAM_MAX_ACTIVE": "1"},
    )
    gateway = None
    try:
        gateway = Gateway(daemon.paths.dir, rt / "gateway.log")
        oa = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with Client(daemon.paths, timeout=60) as c, Client(daemon.paths, timeout=60) as other:

            def elastic() -> ElasticStatus:
                return c.status().elastic

            st = elastic()
            assert (st.source, st.slots, st.configured_slots, st.floor_slots) == (f"file {level}", 32, 32, 8)
            assert st.tier_bytes == st.configured_tier_bytes > 0 and not st.refusing
            # A decode that runs until it is cancelled, through a shrink and a grow.
            stream = c.generate(PROMPT_TEXT, max_tokens=3000)
            for event in stream:
                if isinstance(event, Token):
                    break
            level.write_text("critical set by the test\n")
            wait_for(lambda: elastic().slots == 8, 30, "the pool to shrink to top-k")
            level.write_text("normal\n")
            wait_for(lambda: elastic().slots == 32, 30, "the pool to grow back")
            # Another request, queued behind it (one at a time).
            queued = other.generate(PROMPT_TEXT, max_tokens=8)
            wait_for(lambda: c.status().requests.queued == 1, 30, "the second request to be queued")
            # Below the floor: refused, with why.
            level.write_text("critical set by the test\n")
            st = wait_for(lambda: (s := elastic()).refusing and s, 30, "new requests to be refused")
            assert st.slots == 8 and st.tier_bytes < st.configured_tier_bytes
            with pytest.raises(RequestRejected) as refused:
                list(c.generate(PROMPT_TEXT, max_tokens=8))
            assert refused.value.code == "memory_pressure"
            why = str(refused.value)
            assert "critical memory pressure (set by the test)" in why and "floor (8 slots per layer" in why, why
            with pytest.raises(openai.APIStatusError) as http:
                oa.chat.completions.create(model="moestream", messages=[{"role": "user", "content": "zip?"}])
            assert http.value.status_code == 503 and "critical memory pressure" in http.value.message
            sizes = httpx.get(gateway.url + "/dashboard/state", timeout=30).json()["pool_sizes"]
            assert [s["slots"] for s in sizes["steps"]] == [32, 8, 32, 8] and sizes["refusing"] is True
            assert (sizes["made"], sizes["floor"], sizes["slots"]) == (32, 8, 8)
            assert sizes["events"][0]["reason"] == "memory pressure critical (set by the test)"
            text = ctl("status", "--runtime-dir", str(daemon.paths.dir)).stdout
            assert "elastic    8 of 32 slots per layer (floor 8)" in text, text
            assert "new requests refused (2 so far)" in text and "32 -> 8 slots" in text
            assert "memory pressure critical (set by the test)" in text
            # The decode ends; the queued request is held while the pressure lasts.
            stream.cancel()
            list(stream)
            done = stream.done
            assert done.finish_reason == "cancelled" and done.stats.pool_resizes == 3
            requests = wait_for(lambda: (r := c.status().requests).active == 0 and r, 30, "the decode to end")
            assert requests.queued == 1 and "critical memory pressure" in requests.why_queued
            # The pressure passes: the queued request is served, the pool grows back.
            level.write_text("normal\n")
            list(queued)
            wait_for(lambda: (s := elastic()).slots == 32 and not s.refusing, 30, "the pool to grow back")
            st = elastic()
            assert st.refused == 2 and st.tier_bytes == st.configured_tier_bytes
            assert [(e.slots_from, e.slots_to) for e in st.events] == [(32, 8), (8, 32), (32, 8), (8, 32)]
            assert c.status().requests.failed == 0
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop(15.0)
        shutil.rmtree(rt, ignore_errors=True)
    made = len(done.tokens)
    reference = reference_outputs(store, "0.5", [(PROMPT_TEXT, made), (PROMPT_TEXT, 8)])
    assert done.tokens == list(reference[(PROMPT_TEXT, made)].tokens), "a resize changed a token"
    assert queued.done.tokens == list(reference[(PROMPT_TEXT, 8)].tokens)


def test_the_dashboards_pool_sizes_are_the_resizes_as_steps_with_why():
    """`pool_sizes` (the page's chart and list): the size before the first resize, a step
    at each with its reason, the bounds and the pressure; off says why."""
    from moestream.client.dashboard.app import pool_sizes

    ev = [
        ResizeEvent(10.0, "critical", "memory pressure critical (x)", 32, 8, 4 << 20, 1 << 20, 0, 0, 120, 0.02),
        ResizeEvent(20.0, "normal", "the memory pressure passed (y)", 8, 32, 1 << 20, 4 << 20, 0, 0, 0, 0.01),
    ]
    st = ElasticStatus("PSI", "rule", "normal", "PSI some avg10 0.0%", 32, 32, 8, 0, 0, False, 0, ev)
    sizes = pool_sizes(Status(state="ready", elastic=st), 30.0)
    assert [(s["at"], s["slots"]) for s in sizes["steps"]] == [(None, 32), (10.0, 8), (20.0, 32)]
    assert sizes["steps"][1]["reason"] == "memory pressure critical (x)" and sizes["now"] == 30.0
    assert [e["at"] for e in sizes["events"]] == [20.0, 10.0]  # newest first
    assert (sizes["made"], sizes["floor"], sizes["slots"], sizes["refusing"]) == (32, 8, 32, False)
    calm = ElasticStatus("PSI", "rule", "normal", "", 32, 32, 8, 0, 0, False, 0, [])
    assert pool_sizes(Status(state="ready", elastic=calm), 1.0)["steps"] == [
        {"at": None, "slots": 32, "reason": "unchanged", "level": None}
    ]
    off = ElasticStatus(
        None, "off: a mapped pool keeps every expert in host memory", "normal", "", 0, 0, 0, 0, 0, False, 0
    )
    assert pool_sizes(Status(state="ready", elastic=off), 1.0) == {"steps": [], "note": off.note}
    assert pool_sizes(Status(state="ready"), 1.0)["steps"] == [] and pool_sizes(None, 1.0)["steps"] == []


@pytest.mark.slow  # a daemon, a gateway and two headless Chromium runs
def test_the_page_in_headless_chromium_draws_the_pool_size_and_its_resizes(tmp_path):
    """The dashboard in a real headless Chromium after a shrink under critical pressure:
    the pool-size chart has its steps, the note says the size and that new requests are
    refused, the resizes list says from, to and why; no script error."""
    from test_dashboard import CHROMIUM, _page

    from moestream.daemon.bench.soak.driver import DaemonProcess
    from moestream.shared.settings import demo_store_path

    if CHROMIUM is None:
        pytest.fail("needs a headless Chromium: apt-get install chromium (Debian's package)")
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msd"))
    level = rt / "pressure"
    daemon = DaemonProcess.start(
        demo_store_path(), rt / "rt", capacity="0.5", knobs={"memory_pressure": f"file:{level}"}
    )
    gateway = None
    try:
        gateway = Gateway(daemon.paths.dir, rt / "gateway.log")
        level.write_text("critical drawn by the test\n")

        def refusing() -> bool:
            return httpx.get(gateway.url + "/dashboard/state", timeout=30).json()["pool_sizes"].get("refusing")

        wait_for(refusing, 30, "the daemon to refuse under critical pressure")
        dom = _page(gateway, tmp_path / "dashboard_pool.png")
        assert int(dom.by_id["pool-chart"]["attrs"]["data-points"]) == 2
        note = dom.by_id["pool-note"]
        assert note["attrs"]["data-slots"] == "8" and note["attrs"]["data-refusing"] == "1"
        assert "8 of 32 slots per layer now (floor 8" in note["text"] and "new requests refused" in note["text"]
        rows = [r for r in dom.rows if r.get("data-resize")]
        assert [(r["data-slots-from"], r["data-slots-to"], r["data-level"]) for r in rows] == [("32", "8", "critical")]
        assert "memory pressure critical (drawn by the test)" in dom.by_id["resizes"]["text"]
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop(15.0)
        shutil.rmtree(rt, ignore_errors=True)


def test_a_batch_decoding_through_a_shrink_to_the_floor_equals_stock_batching(tmp_path):
    """Continuous batching at 50% (8 slots: a batch of two, top-4 each) shrunk to the
    floor (4 slots) while three requests decode together, then grown back: the batched
    steps whose experts no longer fit the slots take the overflow path, and every
    request's tokens equal stock's BatchGenerator fed the same way."""
    from stock_runs import stock_batched
    from test_batching import MAX_TOKENS, _prompts, _round_robin

    from moestream.daemon.model.batching import BatchSession

    src = make_tiny_model(tmp_path / "model", "qwen3_moe", quant="4bit", seed=4)
    convert_model(src, tmp_path / "store")
    model, tokenizer = stock_load(str(src))
    want = stock_batched(model, _prompts(), MAX_TOKENS, sorted(tokenizer.eos_token_ids))
    sm = load_streaming_model(tmp_path / "store", Settings(capacity=8, direct_io=True))
    try:
        session = BatchSession(sm, max_batch=8)
        assert session.max_batch == 2
        source, clock = ManualPressure(), Clock()
        elastic = ElasticPool(source, LOG, clock=clock)
        elastic.attach(sm)
        gens = [session.steps(p, GREEDY, m) for p, m in zip(_prompts(), MAX_TOKENS)]
        out: list[list[int]] = [[] for _ in gens]
        slots, overflows = [], [0]

        def between() -> None:  # the engine's loop, between two steps
            turn = len(overflows)
            source.set("critical" if 4 <= turn < 14 else "normal")
            clock.now += 1.0
            elastic.tick()
            slots.append(elastic.slots())
            overflows.append(sum(p.stats.overflow_forwards for p in sm.pools))

        _round_robin(gens, out, between)
        session.close()
        assert out == want, "a resize changed a batched token"
        assert 4 in slots and slots[-1] == 8
        # The prompts were prefilled by then: what overflowed at the floor were batched decode steps.
        assert overflows[13] > overflows[5], "no batched step at the floor took the overflow path"
    finally:
        sm.close()
